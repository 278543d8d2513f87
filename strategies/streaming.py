"""Streaming DiLoCo and CoCoDC (docs/algorithms.md §7) as a synchronous loop of short messages.

Every worker keeps its own model θ^m between messages (``context.state``, clients/datacenter.py
``train.stream``); the server keeps the global model ``global_params`` and one outer optimizer per
fragment (`fl_geo.core.streaming`). Time is counted in inner steps ``t`` (all workers advance in lock
step), and the schedule's *events* cut it into ticks: a fragment's sync start, a fragment's
apply, and the end of each H-step period (one logged "round"). One tick = one ``train.stream``
message per worker, dispatched together (`Dispatcher.run_jobs`):

* the message starting at ``t`` carries the new global fragment θ^g_p of every sync due to be
  applied at ``t`` (``stream_apply``, records ``frag_<p>``), the number of steps to the next event
  (``stream_steps``) and the fragments whose sync starts at the tick's end (``stream_sync``);
* each reply carries Δ_p = θ^g_p − θ^m_p for those fragments; the server averages them (token
  or uniform weights, folded in rank order) and steps fragment p's outer optimizer on its slice
  of ``global_params`` right away, then attaches the result to the message that starts τ steps
  later (``apply = start + τ``). With τ = 0 that is the very next message.

Schedules: fixed (torchft round-robin, `fixed_schedule`: fragment p syncs at (p+1)·H/P − τ and
applies at (p+1)·H/P of every period) or adaptive (CoCoDC Algorithm 2, `AdaptiveSchedule`: a
sync every h = ⌊H/N⌋ steps, the server choosing the fragment; each applies τ steps later).

Virtual time: each tick costs the slowest worker's compute for its steps (the dispatcher's job
timings). A fragment's ring all-reduce (`Scenario.allreduce_time` of its modelled bytes) starts
when its sync starts, runs behind the following ticks' compute and must be over before the tick
that applies it begins: only the part not hidden behind compute is charged. All-reduces share the
WAN one at a time (a sync that starts while another is on the wire queues behind it).

In deployment a Flower message does not overlap compute with transfer; the staleness semantics
(a fragment's update is applied τ steps after its sync started) hold all the same, because the
server, not the network, decides when the new fragment reaches the workers.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, Message, MessageType, RecordDict

from fl_geo.config import ConfigError, FlGeoConfig
from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.claims import ReportedTimes, robust_time
from fl_geo.core.streaming import (
    AdaptiveSchedule,
    FixedSchedule,
    FragmentOuterOptimizers,
    Fragments,
    fragment_record,
    fragment_spec,
)
from fl_geo.runtime.dispatch import JobTiming
from fl_geo.runtime.protocol import EvaluateRequest, StreamRequest
from fl_geo.runtime.wire import PayloadError, check_finite_and_norm, encode, payload_nbytes
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.kernel import NoLiveNode
from fl_geo.strategies.replies import (
    ReplyError,
    Tally,
)
from fl_geo.strategies.server_model import ServerModel
from fl_geo.strategies.stream_replies import StreamReply, read_stream_reply

log = logging.getLogger("fl_geo")

STREAM_MESSAGE_TYPE = f"{MessageType.TRAIN}.stream"  # -> @app.train("stream")
WORKER_EVAL_MESSAGE_TYPE = f"{MessageType.EVALUATE}.stream"  # -> @app.evaluate("stream")
# streaming.rule -> the ``stream_rule`` a train.stream message carries (docs/protocol.md; the wire
# names predate the setting and deployed ClientApps read them).
WIRE_RULES = {"blend": "streaming", "compensate": "cocodc"}


@dataclass
class _Sync:
    """A fragment sync whose new global fragment the workers have not applied yet."""

    start: int  # step at which the sync started (t_p)
    apply: int  # step at whose message the new fragment is attached (t_p + τ)
    # the new θ^g_p in the downlink precision; None for a sync restored from a checkpoint, encoded
    # again from θ when it is sent (fragment p does not change while its sync is in flight)
    record: ArrayRecord | None
    comm_done: float  # virtual time at which its all-reduce is over (0 with a wall clock)
    norm: float  # ‖Δ̄_p‖₂ (CoCoDC's change rate)


@dataclass
class _RoundStats:
    """What one H-step period (one logged round) adds up to, over its ticks."""

    tally: Tally = field(default_factory=Tally)
    bytes_down: int = 0
    failed: int = 0
    ticks: int = 0
    syncs: int = 0
    syncs_by_fragment: dict[int, int] = field(default_factory=dict)
    skipped_syncs: int = 0
    pg_norm_sum: float = 0.0
    update_norm_sum: float = 0.0
    update_norms: int = 0
    overlap_sum: int = 0
    overlap_count: int = 0
    overlap_max: int = -1
    nodes: set[int] = field(default_factory=set)


def _mean(total: float, n: int) -> float:
    return total / n if n else float("nan")


class StreamingLoop(OuterLoop):
    """``run.rounds`` periods of H inner steps per worker (or fewer, at ``run.max_tokens``), each
    cut into ticks by the fragment schedule; ``outer/step`` counts fragment outer steps."""

    supports_plain_clients: ClassVar[bool] = False

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        """One outer optimizer and one running sum per fragment (`FragmentOuterOptimizers`, the
        per-fragment accumulators); the loop keeps θ."""
        return ServerModel.held_elsewhere(cfg, global_params)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s, st = self.cfg.strategy, self.cfg.streaming
        self.H, self.P, self.tau = s.inner_steps, st.fragments, st.overlap
        self.rule = WIRE_RULES[st.rule]  # what the ClientApp's train.stream handler calls the merge
        try:  # where the real model is first known (a public class's own model was not validated)
            self.fragments = Fragments(self.spec, self.P)
        except ValueError as exc:
            raise ConfigError(f"streaming.fragments (P={self.P}) does not fit the model: {exc}") from None
        if s.outer_optimizer != "nesterov":
            raise ConfigError(f"strategy {s.name} uses outer_optimizer nesterov, got {s.outer_optimizer!r}")
        self.frag_specs = [fragment_spec(self.fragments, p) for p in range(self.P)]
        self.outer = FragmentOuterOptimizers(self.fragments, s.outer_optimizer, lr=s.outer_lr,
                                             momentum=s.outer_momentum)
        self._accumulators: dict[int, WeightedAccumulator] = {}
        self.schedule: AdaptiveSchedule | None = None
        self.fixed: FixedSchedule | None = None
        if st.adaptive:
            self.schedule = AdaptiveSchedule(self.P, self.H, st.gamma)
        else:
            self.fixed = FixedSchedule(self.P, self.H, self.tau)
        self.step = 0  # inner steps every worker has run (lock step)
        self.in_flight: dict[int, _Sync] = {}
        self._initialised: set[int] = set()  # nodes that hold streaming state
        # after a resume: the partitions that held streaming state at the checkpoint (node ids do
        # not survive a restart); their nodes are sent no model, they reload and rewind their own
        self._restored_partitions: set[int] = set()
        self._link_free = 0.0  # virtual time at which the WAN is free for the next all-reduce
        self._next_adaptive: int | None = None
        self.interval = self.H // self.P  # adaptive h (updated at every sync decision)
        self._stats = _RoundStats()  # the round being trained (`advance`)
        self._ended = False  # the round that reached run.max_tokens was logged
        self._measured_tc: float | None = None  # wall clock: slowest step time of the last tick
        self._measured_ts: float | None = None  # wall clock: exchange overhead of the last sync tick
        # wall clock: the sites' reported times, each capped by its own history (fl_geo.core.claims)
        self._step_times, self._train_times = ReportedTimes(), ReportedTimes()
        self._tick_step_times: list[float] = []
        self._tick_train_times: list[float] = []
        self.peak_bytes_per_sync = 0
        self._rule_cfg = {
            "stream_rule": self.rule,
            "fragments": self.P,
            "alpha": float(st.alpha),
            "lambda": float(st.compensation),
            "tau": self.tau,
            "H": self.H,
        }

    # ---- schedule -------------------------------------------------------------------------------
    def _slots(self, nodes: Sequence[int]) -> list[int]:
        return [self.profiles[n].partition_id for n in nodes]

    def _allreduce_s(self, p: int, slots: list[int], start: float | None = None) -> float:
        """Fragment p's all-reduce of its share of the modelled model (compressed when the
        fragments are); ``start`` (virtual s) lets the scenario's link windows act on it."""
        if self.scenario is None:
            return 0.0
        nbytes = self.cost.charged_share_bytes(self.fragments.numel(p), self.cfg.wire.up)
        return self.cost.allreduce_s(slots, nbytes, start=start)

    def _adaptive_interval(self, nodes: Sequence[int]) -> int:
        """h of CoCoDC Eq. 10 from T_c (one inner step) and T_s (one fragment sync, the mean over
        fragments): modelled by the scenario on a virtual clock (the slowest worker's step),
        measured on a wall clock from the replies' reported times, robustly (`_measure`: the
        median site, so no single site steers h); H/P until both have been measured."""
        assert self.schedule is not None
        if self.scenario is not None:
            slots = self._slots(nodes)
            t_c = max(self.scenario.step_time(i) for i in slots)
            t_s = sum(self._allreduce_s(p, slots) for p in range(self.P)) / self.P
        else:
            t_c, t_s = self._measured_tc or 0.0, self._measured_ts or 0.0
        if not (t_c > 0 and t_s > 0):  # one worker (no all-reduce) or nothing measured yet
            return max(1, self.H // self.P)
        return self.schedule.interval(t_c, t_s)

    def _next_sync_after(self, t: int) -> int:
        """The first sync start after step ``t``."""
        if self.fixed is not None:
            return self.fixed.next_start_after(t)
        assert self._next_adaptive is not None
        return self._next_adaptive

    def _syncs_at(self, end: int, nodes: Sequence[int]) -> list[int]:
        """Fragments whose sync starts at step ``end`` (the end of the tick being dispatched)."""
        if self.fixed is not None:
            return self.fixed.starts_at(end)
        if end != self._next_adaptive:
            return []
        self.interval = self._adaptive_interval(nodes)
        self._next_adaptive = end + self.interval
        p = self.schedule.choose(end, frozenset(self.in_flight))
        if p is None:
            log.warning("step %d: every fragment is still in flight; this sync slot is skipped", end)
            return []
        return [p]

    def _take_applies(self) -> list[tuple[int, _Sync]]:
        """Syncs whose new fragment the message starting now carries; they complete here."""
        due = sorted(p for p, sync in self.in_flight.items() if sync.apply == self.step)
        out = [(p, self.in_flight.pop(p)) for p in due]
        if self.schedule is not None:
            for p, sync in out:
                self.schedule.completed(p, self.step, sync.norm)
        return out

    def _record_of(self, p: int, sync: _Sync) -> ArrayRecord:
        """The new θ^g_p a sync sends (encoded again for a sync restored from a checkpoint)."""
        if sync.record is None:
            sync.record = encode(self.fragments.gather(self.global_params, p), self.frag_specs[p], self.cfg.wire.down)
        return sync.record

    def _keep_state_at(self, start: int) -> bool:
        """Whether workers keep their state from the start of the tick at step ``start``: the
        step of a checkpoint (the end of every ``run.checkpoint_every``-th period), to which a
        resumed server rewinds them (clients/stream.py)."""
        every = self.cfg.run.checkpoint_every
        return bool(every) and start > 0 and start % (self.H * every) == 0

    # ---- one tick -------------------------------------------------------------------------------
    def _accumulator(self, p: int) -> WeightedAccumulator:
        if p not in self._accumulators:
            self._accumulators[p] = WeightedAccumulator(self.fragments.numel(p))
        return self._accumulators[p]

    def _fold(self, stats: _RoundStats, group: Sequence[tuple[int, Message]], syncs: list[int], steps: int) -> None:
        """Validate a group of replies and fold every fragment's Δ_p; never raises on bad input.

        A reply is accepted or rejected as a whole. With one fragment per tick (always, for both
        schedules) the fold's own NaN/Inf check decides; with several, each reply's fragments are
        checked first so that none of them is folded when another one is bad.
        """
        tally = stats.tally
        valid: list[tuple[int, StreamReply]] = []
        for node, reply in group:
            try:
                r = read_stream_reply(reply, self.frag_specs, syncs, steps, self.cfg.wire.up,
                                      self.uplink, step_tokens=self.step_tokens(node),
                                      stream_step=self.step, version=self.version)
            except ReplyError as exc:
                self._reject(tally, node, str(exc))
                continue
            if len(syncs) > 1:
                try:
                    for p in syncs:
                        check_finite_and_norm(r.deltas[p], self.frag_specs[p])
                except PayloadError as exc:
                    self._reject(tally, node, f"{fragment_record(p)}: {exc}")
                    continue
            valid.append((node, r))
            site = self.partition_of(node)  # each site's times capped by its own earlier ones
            self._tick_step_times.append(self._step_times.bound(site, r.reply.step_time_s))
            self._tick_train_times.append(self._train_times.bound(site, r.train_time_s))
        if not valid:
            return
        tally.noisy_steps += sum(r.reply.noisy_steps for _, r in valid)
        tokens_weighted = self.cfg.strategy.weighting == "tokens"
        weights = [float(r.reply.tokens) if tokens_weighted else 1.0 for _, r in valid]
        accepted = list(range(len(valid)))
        norms = [0.0] * len(valid)
        for p in syncs:
            batch = list(accepted)
            result = self._accumulator(p).add_batch_checked([valid[i][1].deltas[p] for i in batch],
                                                            [weights[i] for i in batch])
            for j, i in enumerate(batch):
                if j in result.rejected:
                    self._reject(tally, valid[i][0], f"{fragment_record(p)}: {result.rejected[j]}")
                    accepted.remove(i)
                else:
                    norms[i] = math.hypot(norms[i], float(result.norms[j]))
        for i in accepted:
            node, r = valid[i]
            tally.accept(r.reply, norms[i])
            stats.nodes.add(node)
            if syncs:
                stats.update_norm_sum += norms[i]
                stats.update_norms += 1
                self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, *r.nbytes.values())
            if r.overlap_count:
                stats.overlap_sum += r.overlap_sum
                stats.overlap_count += r.overlap_count
                stats.overlap_max = max(stats.overlap_max, r.overlap_max)

    def _tick(self, rnd: int, end: int, applies: list[tuple[int, _Sync]], stats: _RoundStats) -> None:
        s = self.cfg.strategy
        start, steps = self.step, end - self.step
        clock = self.dispatcher.clock
        nodes = self.free_nodes()
        if not nodes:
            raise NoLiveNode("no live node to train on (all vanished or failed)")
        syncs = self._syncs_at(end, nodes)
        if clock.is_virtual:  # the applied fragments' all-reduces must be over
            for _, sync in applies:
                clock.advance_to(sync.comm_done)
        init = [n for n in nodes if n not in self._initialised and self.partition_of(n) not in self._restored_partitions]
        init_arrays = encode(self.global_params, self.spec, self.cfg.wire.down) if init else None
        apply_ids = [p for p, _ in applies]
        msgs = []
        for n in nodes:
            fresh = n in init
            config = dict(self._client_cfg, **self._rule_cfg, round=rnd, base_version=self.version,
                          stream_step=start, stream_steps=steps,
                          # a node initialised now gets the current global model, outer steps of
                          # syncs still in flight included: nothing to apply on top of it
                          stream_apply=json.dumps([] if fresh else apply_ids),
                          stream_sync=json.dumps(syncs), stream_keep=self._keep_state_at(start))
            config["lambda_"] = config.pop("lambda")  # a Python keyword: the dataclass field's name
            records: dict[str, Any] = self.request_records(StreamRequest(**config), self.user_train_config)
            if fresh:
                assert init_arrays is not None
                records["arrays"] = init_arrays
                stats.bytes_down += payload_nbytes(init_arrays)
            else:
                for p, sync in applies:
                    record = self._record_of(p, sync)
                    records[fragment_record(p)] = record
                    stats.bytes_down += payload_nbytes(record)
            msgs.append(Message(RecordDict(records), dst_node_id=n, message_type=STREAM_MESSAGE_TYPE))
        for p in syncs:
            self._accumulator(p).reset()
        order = nodes if s.fold_order == "rank" else None
        # (a wall clock ignores the timings; their steps key the reply deadline)
        timings = [JobTiming(slot, steps) for slot in self._slots(nodes)]
        self._tick_step_times, self._tick_train_times = [], []
        t0 = time.perf_counter()
        outcome = self.dispatcher.run_jobs(
            msgs,
            on_replies=lambda group: self._fold(stats, group, syncs, steps),
            order=order,
            timeout_s=s.round_timeout_s,
            timings=timings,
        )
        wall = time.perf_counter() - t0
        self._initialised.update(nodes)
        self._restored_partitions -= {self.partition_of(n) for n in nodes}
        lost = set(outcome.errors) | set(outcome.vanished) | set(outcome.timed_out)
        self._initialised -= lost  # their state may be gone or half-written: initialise again
        stats.failed += len(lost)
        stats.ticks += 1
        self._measure(wall, bool(syncs or applies))
        self.step = end
        slots = self._slots([n for n in nodes if n not in lost]) or self._slots(nodes)
        for p in syncs:
            self._outer_step(p, end, slots, stats)

    def _measure(self, wall: float, exchanged: bool) -> None:
        """Wall-clock T_c / T_s for the adaptive schedule (unused with a scenario, whose modelled
        times are the schedule's; reported times never reach it then): the median over the
        tick's replies of their step times, and, when fragments travelled, the tick's wall time
        outside the median worker's training (transfer, (de)serialisation, merging). Each site's
        times are first capped at 4 × its own median of earlier reports (`ReportedTimes`); the
        median across sites (not the maximum) means one site of three or more cannot move the
        schedule by what it reports."""
        if self.scenario is not None or self.schedule is None:
            return
        step_time, train_time = robust_time(self._tick_step_times), robust_time(self._tick_train_times)
        if step_time > 0:
            self._measured_tc = step_time
        if exchanged and train_time > 0:
            self._measured_ts = max(1e-6, wall - train_time)

    def _outer_step(self, p: int, end: int, slots: list[int], stats: _RoundStats) -> None:
        """Fragment p's outer step on the mean Δ_p; its result is applied τ steps later."""
        acc = self._accumulator(p)
        if acc.count < self.cfg.strategy.min_replies:
            log.warning("step %d: fragment %d got %d accepted update(s) < strategy.min_replies=%d; "
                        "its outer step is skipped, the global fragment is unchanged",
                        end, p, acc.count, self.cfg.strategy.min_replies)
            stats.skipped_syncs += 1
            return
        mean = acc.mean()
        norm = float(torch.linalg.vector_norm(mean))
        fragment = self.fragments.gather(self.global_params, p)
        self.outer.step(p, fragment, mean)
        self.fragments.scatter_(self.global_params, p, fragment)
        self.version += 1
        stats.syncs += 1
        stats.syncs_by_fragment[p] = stats.syncs_by_fragment.get(p, 0) + 1
        stats.pg_norm_sum += norm
        done = 0.0
        clock = self.dispatcher.clock
        if clock.is_virtual:
            begin = max(clock.now(), self._link_free)
            done = self._link_free = begin + self._allreduce_s(p, slots, start=begin)
        record = encode(fragment, self.frag_specs[p], self.cfg.wire.down)
        self.in_flight[p] = _Sync(end, end + self.tau, record, done, norm)

    # ---- the loop -------------------------------------------------------------------------------
    def _model_time(self) -> float:
        """Virtual time at which the current global model exists: now, or later while an
        all-reduce whose outer step it already holds is still on the wire."""
        if not self.dispatcher.clock.is_virtual:
            return float("nan")
        return max([self.dispatcher.clock.now(), *(s.comm_done for s in self.in_flight.values())])

    def _round_metrics(self, stats: _RoundStats) -> dict[str, float]:
        t = stats.tally
        t.errors = stats.failed
        self.total_bytes_down += stats.bytes_down
        return {
            **self.tally_metrics(t),
            # per-fragment norms: a round holds several syncs, each with its own updates
            "outer/update_norm": _mean(stats.update_norm_sum, stats.update_norms),
            "outer/pseudo_grad_norm": _mean(stats.pg_norm_sum, stats.syncs),
            "train/inner_steps": _mean(t.steps, len(stats.nodes)),
            "train/step_time_s": _mean(t.step_time_sum, t.accepted),
            "data/noisy_steps": t.noisy_steps,
            "data/noisy_steps_accepted": t.noisy_steps_accepted,
            "comm/bytes_down": stats.bytes_down,
            "comm/peak_bytes_per_sync": self.peak_bytes_per_sync,
            "stream/syncs": stats.syncs,
            # which fragments the schedule synced (the adaptive one favours fast-changing ones)
            **{f"stream/syncs_f{p}": stats.syncs_by_fragment.get(p, 0) for p in range(self.P)},
            "stream/skipped_syncs": stats.skipped_syncs,
            "stream/messages": stats.ticks,
            "stream/overlap_steps": _mean(stats.overlap_sum, stats.overlap_count),
            "stream/overlap_steps_max": stats.overlap_max if stats.overlap_count else float("nan"),
            "stream/interval": self.interval if self.schedule is not None else self.H // self.P,
            "time/virtual_s": self._model_time(),  # when this global model exists (syncs in flight)
        }

    def worker_eval(self, rnd: int) -> dict[str, float]:
        """Validation loss of each worker's own model θ^m (``streaming.eval_workers``), on the
        held-out batches of ``val/loss``: their mean, min and max over the workers that hold one.

        The workers' models, not the server's, are what training produced at this step: the
        global model's fragments were stepped at different times and the workers have trained on
        from their merges (Streaming DiLoCo keeps part of its own model at each merge, CoCoDC the
        local progress since the sync started). Costs no modelled time (`collect_val_losses`).
        """
        nodes = [n for n in self.free_nodes() if n in self._initialised]
        records = self.request_records(EvaluateRequest(**self._client_cfg, round=rnd, base_version=self.version,
                                                       eval_batches=self.cfg.run.eval_batches),
                                       self.user_evaluate_config)
        msgs = [Message(RecordDict(records), dst_node_id=n, message_type=WORKER_EVAL_MESSAGE_TYPE) for n in nodes]
        losses = [loss for loss, _ in self.collect_val_losses(msgs, nodes)]
        if not losses:
            return {}
        return {"val/worker_loss": sum(losses) / len(losses), "val/worker_loss_min": min(losses),
                "val/worker_loss_max": max(losses)}

    # ---- checkpoint (strategies/loop_checkpoint.py) -----------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """The streaming part of a checkpoint, taken at the end of a period: the lock-step
        position, each fragment's outer optimizer, the syncs in flight (their records are encoded
        again from θ), the schedule, the WAN's queue, the measured times and which partitions
        hold streaming state. The workers' own models are theirs: with checkpoints on, each
        keeps its state from the checkpoint's step and a resumed server rewinds it there
        (clients/stream.py)."""
        return {
            "step": self.step,
            "ended": self._ended,
            "outer": self.outer.state_dict(),
            "in_flight": [[p, s.start, s.apply, s.comm_done, s.norm] for p, s in sorted(self.in_flight.items())],
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
            "next_adaptive": self._next_adaptive,
            "interval": self.interval,
            "link_free": self._link_free,
            "measured": [self._measured_tc, self._measured_ts],
            "step_times": self._step_times.state_dict(),
            "train_times": self._train_times.state_dict(),
            "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "initialised": sorted({self.partition_of(n) for n in self._initialised} | self._restored_partitions),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore `extra_state` output; ValueError (and nothing changed) if it does not fit."""
        missing = [k for k in ("step", "ended", "outer", "in_flight", "schedule", "next_adaptive", "interval",
                               "link_free", "measured", "step_times", "train_times", "peak_bytes_per_sync",
                               "initialised") if k not in state]
        if missing:
            raise ValueError(f"streaming loop state lacks keys {missing}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"streaming loop state has step {step!r}")
        outer = FragmentOuterOptimizers(self.fragments, self.cfg.strategy.outer_optimizer,
                                        lr=self.cfg.strategy.outer_lr, momentum=self.cfg.strategy.outer_momentum)
        outer.load_state_dict(dict(state["outer"]))
        in_flight: dict[int, _Sync] = {}
        for row in state["in_flight"]:
            if not isinstance(row, (list, tuple)) or len(row) != 5:
                raise ValueError(f"streaming loop state has a malformed sync in flight: {row!r}")
            p, start, apply, comm_done, norm = row
            if not (0 <= int(p) < self.P and int(start) <= step <= int(apply) and math.isfinite(float(comm_done))
                    and math.isfinite(float(norm))) or int(p) in in_flight:
                raise ValueError(f"streaming loop state has a malformed sync in flight: {row!r}")
            in_flight[int(p)] = _Sync(int(start), int(apply), None, float(comm_done), float(norm))
        if (state["schedule"] is None) != (self.schedule is None):
            raise ValueError("checkpoint's fragment schedule is not this run's (streaming.adaptive changed?)")
        schedule = None
        if self.schedule is not None:
            schedule = AdaptiveSchedule(self.P, self.H, self.cfg.streaming.gamma)
            schedule.load_state_dict(dict(state["schedule"]))
        step_times, train_times = ReportedTimes(), ReportedTimes()
        step_times.load_state_dict(dict(state["step_times"]))
        train_times.load_state_dict(dict(state["train_times"]))
        measured = [None if t is None else float(t) for t in state["measured"]]
        if len(measured) != 2:
            raise ValueError(f"streaming loop state has measured times {state['measured']!r}")
        partitions = {int(p) for p in state["initialised"]}
        next_adaptive = None if state["next_adaptive"] is None else int(state["next_adaptive"])
        interval, link_free = int(state["interval"]), float(state["link_free"])
        peak = int(state["peak_bytes_per_sync"])
        if interval < 1 or not math.isfinite(link_free) or peak < 0:
            raise ValueError(f"streaming loop state has interval {interval}, WAN free at {link_free}, peak {peak}")
        # everything validated: install
        self.step, self._ended, self.outer, self.in_flight = step, bool(state["ended"]), outer, in_flight
        if schedule is not None:
            self.schedule = schedule
        self._next_adaptive, self.interval, self._link_free = next_adaptive, interval, link_free
        self._measured_tc, self._measured_ts = measured
        self._step_times, self._train_times = step_times, train_times
        self.peak_bytes_per_sync = peak
        self._initialised, self._restored_partitions = set(), partitions

    # ---- policy hooks of the kernel (`OuterLoop.run`) ----------------------------------------------
    def begin(self) -> None:
        if self.schedule is not None and not self.resumed:  # a resumed schedule comes from the checkpoint
            self.interval = self._adaptive_interval(self.free_nodes())
            self._next_adaptive = self.interval

    def done(self) -> bool:
        """Every round's H inner steps are done, or the round that reached ``run.max_tokens`` is."""
        return self._ended or self.step >= self.cfg.run.rounds * self.H

    def advance(self) -> bool:
        """One tick: the inner steps up to the next sync start, merge or round end; the round is
        logged when its H-th step is reached."""
        r = self.cfg.run
        rnd = self.step // self.H + 1
        applies = self._take_applies()
        period_end = self.H * rnd
        end = min(period_end, self._next_sync_after(self.step), *(sync.apply for sync in self.in_flight.values()))
        self._tick(rnd, end, applies, self._stats)
        if self.step < period_end:
            return True
        stats, self._stats = self._stats, _RoundStats()
        self._ended = rnd == r.rounds or (r.max_tokens > 0 and self.total_tokens + stats.tally.tokens >= r.max_tokens)
        self.record_step(rnd, self._round_metrics(stats), self._ended)
        return True

    def step_evaluations(self, step: int, last: bool) -> dict[str, float]:
        """The server's validation and, with ``streaming.eval_workers``, the workers' own models'."""
        metrics = super().step_evaluations(step, last)
        if self.eval_due(step, last) and self.cfg.streaming.eval_workers:
            metrics.update(self.worker_eval(step))
        return metrics

    def finish(self) -> None:
        """No drain (every tick's jobs were collected); on a virtual clock the final model exists
        once its last sync is over."""
        if self.dispatcher.clock.is_virtual:
            self.dispatcher.clock.advance_to(self._model_time())
