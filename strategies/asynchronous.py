"""Asynchronous buffered aggregation: FedBuff, FedAsync, naive async DiLoCo, Async-Local-SGD, Di-PS.

One loop (docs/algorithms.md §5, Di-PS Algorithm 1); the methods are policies on it:

- the server never waits for every worker: it takes the next resolved job from the dispatcher in
  clock order, validates the reply, scores it (Di-PS penalty), and folds it into one running weighted
  sum (O(1) model-sized buffers, however many replies);
- it steps when the buffer holds ``buffer_size`` accepted updates (FedBuff K; 1 for FedAsync, naive
  async DiLoCo and Async-Local-SGD), when the grace window after the last arrival closes (Di-PS), or
  when every live worker has reported;
- the new model goes to every worker that pushed in this step, rejected ones included, and to new or
  idle workers; the rest keep training on their older base (their staleness grows).

Pseudo-gradient base: ``dispatch`` (Δ against the version the worker started from; FedBuff,
Async-Local-SGD) or ``current`` (Di-PS line 10: workers send parameters, g = θ_current − θ_worker, and
FedAsync's mixing θ ← (1−α_t)θ + α_t·θ_i = θ − α_t·g).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from flwr.app import Message, MessageType, RecordDict

from fl_geo.core.claims import MIN_PEERS
from fl_geo.core.grace import GraceTimer
from fl_geo.core.robust import NormWindow
from fl_geo.core.weights import staleness_weight
from fl_geo.runtime.dispatch import TIMED_OUT, Event, JobTiming
from fl_geo.runtime.protocol import TrainRequest
from fl_geo.runtime.wire import PayloadError, check_finite_and_norm, encode, payload_nbytes
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.replies import ReplyError, Tally, TrainReply, read_reply
from fl_geo.strategies.robust_rules import DirectionRule, flat_row

log = logging.getLogger("fl_geo")



def fedasync_alpha(alpha: float, exponent: float, staleness: int) -> float:
    """FedAsync's polynomial staleness mixing α_t = α·(1 + τ)^−a."""
    return alpha * (1.0 + staleness) ** (-exponent)


class AsyncOuterLoop(OuterLoop):
    """Runs ``run.rounds`` asynchronous outer steps (or until ``run.max_tokens``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        s = cfg.strategy
        self._scratch: torch.Tensor | None = None  # θ_current − θ_worker for the "current" base
        self.norm_window = NormWindow(s.robust_window, s.robust_factor) if s.robust == "median_norm" else None
        # strategy.robust=centered_clip or cosine (the direction-aware rules for a buffer: the
        # coordinate rules need a consensus of peers a buffer of K updates does not give; cosine
        # keeps a running one, seeded by the first step): the step's valid updates are held, as
        # fp32 rows, until it closes (`_fold_held`).
        self.direction: DirectionRule | None = None
        self._held: list[tuple[Event, TrainReply, torch.Tensor, int]] = []
        # Plain replies that arrive before any plain claim was accepted: (event, reply, staleness),
        # judged together when the step closes (`_judge_first_claims`).
        self._unjudged: list[tuple[Event, TrainReply, int]] = []
        if s.robust in ("centered_clip", "cosine"):
            self.direction = DirectionRule(s.robust, self.spec.numel, trim=s.robust_trim, iters=s.robust_clip_iters,
                                           cos_min=s.robust_cos_min, window=s.robust_window, consensus="running")
        self.dispatched_samples = 0  # for schedule_clock=global (docs/algorithms.md §1)
        self.waiting: list[int] = []  # pushers of this step: they get the new model after it
        self.tally = Tally()
        self.last_arrival: float | None = None
        self._send = "params" if s.pseudo_grad_base == "current" else "pseudo_grad"
        self._fedasync_scale = 1.0
        # strategy.grace (Di-PS's default; on whenever strategy.grace_s >= 0): a grace window closes
        # steps, estimated by ski rental on running estimates unless strategy.grace_s fixes it.
        # Without it a step waits for a full buffer or a full house only.
        self.uses_grace = s.grace
        self.grace_timer = GraceTimer(tau_max=s.grace_max_s) if s.grace and s.grace_s < 0 else None
        self._last_step_wall = 0.0
        self._job_seq = 0  # names jobs (the sharded loop keys pushed shards by it)

    # ---- checkpoint -----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """Taken right after a step: the buffer is empty and this step's pushers have new work,
        so what remains is schedule position, grace estimates and per-partition bookkeeping."""
        state = {
            "dispatched_samples": self.dispatched_samples,
            "grace": self.grace_timer.state_dict() if self.grace_timer is not None else None,
            "last_arrival": self.last_arrival,
            "fedasync_scale": self._fedasync_scale,
            "benched_partitions": sorted(self.partition_of(n) for n in self.benched),
            "errors_by_partition": {str(self.partition_of(n)): c for n, c in self._errors.items()},
        }
        if self.direction is not None:
            state["robust"] = self.direction.state_dict()
        if self.norm_window is not None:  # median_norm: the recent norms a resumed run judges against
            state["norm_window"] = self.norm_window.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        keys = ("dispatched_samples", "grace", "last_arrival", "fedasync_scale", "benched_partitions", "errors_by_partition")
        if missing := [k for k in keys if k not in state]:
            raise ValueError(f"asynchronous loop state lacks keys {missing}")
        norms = state.get("norm_window", [])  # checkpoints before 2026-11-28 lack it: an empty window
        if not all(isinstance(n, float) and math.isfinite(n) and n >= 0 for n in norms):
            raise ValueError("checkpoint's norm window is malformed")
        if self.direction is not None:
            if "robust" not in state:
                raise ValueError(f"checkpoint has no state of strategy.robust={self.direction.rule}")
            self.direction.load_state_dict(dict(state["robust"]))
        if self.grace_timer is not None:
            if state["grace"] is None:
                raise ValueError("checkpoint has no grace-window estimates but this run uses them")
            self.grace_timer.load_state_dict(state["grace"])
        if self.norm_window is not None:
            self.norm_window.load_state_dict(norms)
        self.dispatched_samples = int(state["dispatched_samples"])
        self.last_arrival = None if state["last_arrival"] is None else float(state["last_arrival"])
        self._fedasync_scale = float(state["fedasync_scale"])
        self.benched = self.nodes_of(state["benched_partitions"])
        errors = {int(k): int(v) for k, v in dict(state["errors_by_partition"]).items()}
        self._errors = {n: errors[p.partition_id] for n, p in self.profiles.items() if p.partition_id in errors}

    # ---- dispatch -----------------------------------------------------------------------------
    def dispatch(self, nodes: list[int]) -> None:
        """Send the current model to idle nodes, each with its own budget and schedule position."""
        if not nodes:
            return
        # wire.compress_down: each node gets x̂ whole or its deltas (strategies/downlink.py)
        records, down = self.model_records() if self.downlink is None else ({}, 0)
        msgs, timings, meta = [], [], []
        # position in worker steps: samples dispatched to all workers / one worker's batch
        global_batch = self.cfg.client.batch_size
        for node in nodes:
            steps = self.job_steps(node)
            job = f"v{self.version}-p{self.partition_of(node)}-{self._job_seq}"
            self._job_seq += 1
            sent = self.down_message(self.downlink, node, self.global_params, self.version)
            node_records, fields, nbytes, deltas = dict(records), {}, down, None
            if sent is not None:
                arrays, fields, nbytes, deltas = sent
                if arrays is not None:  # (None: the model travels on the sharded data path)
                    node_records["arrays"] = arrays
            elif self.downlink is not None:  # a plain Flower ClientApp: the model whole
                node_records, nbytes = self.model_records()
            config = dict(self._client_cfg, round=self.version, base_version=self.version, inner_steps=steps, send=self._send,
                          **self.job_config(node, job), **fields)
            if self.cfg.strategy.schedule_clock == "global":
                config["start_step"] = self.dispatched_samples // global_batch
            self.dispatched_samples += steps * global_batch
            if "arrays" in node_records and sent is None:
                node_records["arrays"] = self.arrays_for(node, node_records["arrays"], self.global_params)
            content = RecordDict({**node_records, **self.request_records(TrainRequest(**config), self.user_train_config)})
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
            timings.append(JobTiming(self.profiles[node].partition_id, steps, *self.cost.job_bytes(self.cfg.wire.down, self.cfg.wire.up, deltas)))
            meta.append({"version": self.version, "steps": steps, "job": job})
            if self._send == "pseudo_grad":  # (params mode: Δ is taken against the current model)
                base = self.base_snapshot(node, self.global_params)
                if base is not None:
                    meta[-1]["base"] = base
            self.total_bytes_down += nbytes
        self.dispatcher.submit(msgs, timings, meta)

    def model_records(self) -> tuple[dict[str, Any], int]:
        """What a train message carries besides its config: the model (and its bytes). The
        sharded loop's gRPC transport carries none: clients pull shards from the followers."""
        arrays = encode(self.global_params, self.spec, self.cfg.wire.down)
        return {"arrays": arrays}, payload_nbytes(arrays)

    def job_config(self, node: int, job: str) -> dict[str, Any]:
        """Extra config scalars for one job (the sharded loop: follower addresses, job id)."""
        return {}

    def idle_nodes(self) -> list[int]:
        """Free nodes that are neither waiting for this step's model nor benched."""
        return self.free_nodes(set(self.waiting) | self.benched)

    # ---- replies --------------------------------------------------------------------------------
    def handle(self, ev: Event) -> None:
        node = ev.job.node
        if ev.error != TIMED_OUT:  # a job given up at its deadline is no arrival for the grace window
            self.last_arrival = ev.time
            if self.grace_timer is not None:
                self.grace_timer.observe_arrival(ev.time)
        if self.job_failed(self.tally, node, ev.ok, ev.error):
            if self.downlink is not None:  # it may not hold what it was sent: x̂ whole next time
                self.downlink.forget(node)
            return  # error reply or vanished node: nothing to fold; it is re-dispatched if alive
        self.waiting.append(node)  # Di-PS: pushers get the new model, rejected ones included
        try:
            r = self.read_reply(ev)
        except ReplyError as exc:
            self._reject(self.tally, node, str(exc))
            self.discard(ev)
            return
        staleness = self.version - int(ev.job.meta["version"])
        if self.claims.holds_first(r):
            # Nothing accepted yet to judge this claim against: held until the step closes,
            # then judged with the step's other first claims (`_judge_first_claims`).
            self._unjudged.append((ev, r, staleness))
            return
        if r.plain and not self.claims.judge(self.tally, [(node, r)], whole_round=True):
            self.discard(ev)
            return
        self._admit(ev, r, staleness)

    def _judge_first_claims(self) -> None:
        """The step closes while the run has accepted no plain claim yet: judge the step's held
        plain replies together (`PlainClaims.judge_first`); the kept ones go on as any
        reply does, in arrival order (`_admit`)."""
        held, self._unjudged = self._unjudged, []
        kept = self.claims.judge_first(self.tally, [(ev.job.node, r) for ev, r, _ in held])
        for (ev, r, staleness), keep in zip(held, kept, strict=True):
            if keep:
                self._admit(ev, r, staleness)
            else:
                self.discard(ev)

    def _admit(self, ev: Event, r: TrainReply, staleness: int) -> None:
        """A reply whose claim passed: the norm window, the direction rule's hold, then the fold."""
        if self.norm_window is not None and not self.within_norm_bound(ev, r):
            return
        if self.direction is not None:
            update: Any = self._current_base_grad(r.pieces) if r.payload == "params" else r.pieces
            self._held.append((ev, r, flat_row(update, self.spec.numel), staleness))
            return
        norm = self.fold_update(ev, r, staleness)
        if norm is None:
            return
        if self.cfg.strategy.staleness_mixing:  # FedAsync: α_t of this (only) update
            s = self.cfg.strategy
            self._fedasync_scale = fedasync_alpha(s.mixing, s.staleness_exponent, staleness)
        self.tally.accept(r, norm, staleness)

    def read_reply(self, ev: Event) -> TrainReply:
        """Validate a train reply (the sharded loop reads a control-only reply instead). A plain
        Flower ClientApp's reply is the trained model: Δ against the model its job was sent with,
        or (params mode) against the current model, which is what ``g`` is then."""
        base = ev.job.meta.get("base", self.global_params if self._send == "params" else None)
        return read_reply(ev.reply, self.spec, self.cfg.wire.up, expected_version=int(ev.job.meta["version"]),
                          base=base, payloads=(self._send,), max_steps=self.job_steps(ev.job.node),
                          step_tokens=self.step_tokens(ev.job.node), compressor=self.uplink)

    def within_norm_bound(self, ev: Event, r: TrainReply) -> bool:
        """``strategy.robust=median_norm``: False (logged, counted) for an update whose norm is
        beyond the bound of the recent updates' median (fl_geo.core.robust)."""
        update: Any = r.pieces
        if r.payload == "params":
            update = [(0, self._current_base_grad(r.pieces))]
        try:
            norm = check_finite_and_norm(update)
        except PayloadError:
            return True  # the fold refuses it with its own reason
        reason = self.norm_window.judge(norm)
        if reason is None:
            return True
        self._reject(self.tally, ev.job.node, reason)
        self.discard(ev)
        return False

    def discard(self, ev: Event) -> None:
        """Forget whatever a rejected reply left behind (the sharded loop: pushed shards)."""

    def _fold_held(self) -> None:
        """``strategy.robust=centered_clip``: the step closes; clip the held updates' distances
        to the running center (strategies/robust_rules.py) and fold the clipped rows with their
        usual weights (and the penalty). Rejections (NaN/Inf, the model-norm bound) are logged."""
        held, self._held = self._held, []
        if not held or self.direction is None:
            return
        weights = [self._weight(r.tokens, st) for _, r, _, st in held]
        judged = self.direction.judge([row for _, _, row, _ in held], weights, self.update_bound())
        for i, (ev, r, row, staleness) in enumerate(held):
            if i in judged.rejected:
                self._reject(self.tally, ev.job.node, judged.rejected[i])
                self.discard(ev)
                continue
            if self._fold_one(ev.job.node, judged.rows[i], r, staleness, scored=row) is not None:
                self.tally.accept(r, judged.norms[i], staleness)
                if self.cfg.strategy.staleness_mixing:  # FedAsync: α_t of this (only) update
                    s = self.cfg.strategy
                    self._fedasync_scale = fedasync_alpha(s.mixing, s.staleness_exponent, staleness)

    def buffered(self) -> int:
        """Updates this step holds: accepted (folded), rejected, held for a robust rule, and
        held for their first claims to be judged."""
        return self.tally.accepted + self.tally.rejected + len(self._held) + len(self._unjudged)

    def fold_update(self, ev: Event, r: TrainReply, staleness: int) -> float | None:
        """Score and fold one valid reply; its norm, or None when it was rejected (logged)."""
        update: Any = r.pieces
        if r.payload == "params":  # θ_worker: g = θ_current − θ_worker (Di-PS line 10, FedAsync)
            update = self._current_base_grad(r.pieces)
        return self._fold_one(ev.job.node, update, r, staleness)

    def _fold_one(self, node: int, update: Any, r: TrainReply, staleness: int, scored: Any = None) -> float | None:
        """Fold one update (penalty, or weight and the model-norm bound); its norm or None.
        ``scored``: the update as it arrived, for the penalty's test (`PenalisedFold.fold`)."""
        if self.penalty is not None:
            verdict = self.penalised.fold(self.tally, node, update, r.tokens, staleness, scored=scored)
            return None if verdict is None else float(verdict.norms.norm())
        result = self.accumulator.add_batch_checked([update], [self._weight(r.tokens, staleness)], self.update_bound())
        if 0 in result.rejected:
            self._reject(self.tally, node, result.rejected[0])
            return None
        return float(result.norms[0])

    def _current_base_grad(self, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """g = θ_current − θ_worker in one reusable model-sized scratch buffer."""
        if self._scratch is None:
            self._scratch = torch.empty(self.spec.numel, dtype=torch.float32)
        g = self._scratch
        for offset, piece in pieces:
            n = piece.numel()
            torch.sub(self.global_params[offset : offset + n], piece.to(torch.float32), out=g[offset : offset + n])
        return g

    def _weight(self, tokens: int, staleness: int) -> float:
        s = self.cfg.strategy
        w = float(tokens) if s.weighting == "tokens" else 1.0
        if s.staleness_weighting:
            w *= staleness_weight(staleness)
        return w

    # ---- stepping -------------------------------------------------------------------------------
    def should_step(self) -> bool:
        if self.buffered() == 0:
            return False
        if self.awaiting_peers():
            return not self.others_training()  # unless nobody else can still reply
        if self.tally.accepted + len(self._held) + len(self._unjudged) >= self.cfg.strategy.buffer_size:
            return True
        # every live worker has reported (a late node, whose job was given up, will not)
        return not self.others_training()

    def awaiting_peers(self) -> bool:
        """True while the step may not close yet because it lacks the peers a first judgement
        needs: ``strategy.robust=cosine``'s seed (``robust_seed`` updates), or `MIN_PEERS`
        plain claims while none has been accepted (`_judge_first_claims`: with fewer, a lie
        could not be outvoted). The loop then waits for replies, not for a grace window; a step
        still closes once no other live site is training."""
        seeding = self.direction is not None and not self.direction.seeded
        if seeding and len(self._held) + len(self._unjudged) < self.cfg.strategy.robust_seed:
            return True
        return 0 < len(self._unjudged) < MIN_PEERS

    def grace(self) -> float:
        """Di-PS grace window: fixed, or the ski-rental estimate (``fl_geo.core.grace``)."""
        g = self.cfg.strategy.grace_s
        if g >= 0:
            return g
        return self.grace_timer.grace() if self.grace_timer is not None else 0.0

    def _lr_share(self) -> float:
        """outer_lr_scaling=share: the fraction of the live workers this step aggregates."""
        if self.cfg.strategy.outer_lr_scaling != "share":
            return 1.0
        live = max(len([n for n in self.dispatcher.live_nodes() if n not in self.benched]), 1)
        return min(1.0, self.tally.accepted / live)

    def step(self) -> dict[str, float]:
        import time as _time

        self.wait_for_quorum()
        t0 = _time.perf_counter()
        self._judge_first_claims()
        self._fold_held()
        t = self.tally
        base_lr = self.optimizer.lr
        self.optimizer.lr = base_lr * self._lr_share()
        stepped = t.accepted > 0 and self.apply_update()
        if stepped:
            self.version += 1
        elif self.dispatcher.goodput is not None:
            self.dispatcher.goodput.settle(accepted=False)  # nothing was folded into a step
        self.optimizer.lr = base_lr
        if self.penalty is not None:
            self.penalty.commit()  # statistics learn from accepted updates only
        self.accumulator.reset()
        if self.grace_timer is not None:
            self.grace_timer.observe_cost(self._update_cost())
        metrics = {
            **self.tally_metrics(t),
            "outer/staleness": t.mean(t.staleness_sum),
            "outer/staleness_max": t.staleness_max,
            "train/step_time_s": t.mean(t.step_time_sum),  # the accepted clients' own step timers
        }
        self._last_step_wall = _time.perf_counter() - t0
        if self.grace_timer is not None:
            metrics["outer/grace_s"] = self.grace()
        if self.penalty is not None:
            metrics["outer/max_z"] = t.max_z
            metrics.update(self.penalised.clip_metrics())
        self.tally = Tally()
        self.waiting = []
        if not self.done():  # after the last step no job is sent whose update nothing would fold
            self.dispatch(self.idle_nodes())  # this step's pushers and any new or idle node
        return metrics

    def apply_update(self) -> bool:
        """The outer step on this step's folded updates (at ``self.optimizer.lr``); False when
        nothing was stepped (the sharded loop: a follower restart voided the window)."""
        if self.penalty is not None:
            self.penalised.step()
            return True
        mean = self.accumulator.mean()
        if self.cfg.strategy.staleness_mixing:
            mean.mul_(self._fedasync_scale)
        self.optimizer.step(self.global_params, mean)
        return True

    def _update_cost(self) -> float:
        """C_m of the ski-rental rule: the time to get the new model to a worker.

        In virtual time, the modelled downlink to the pushers' regions (mean); with a wall clock
        the grace timer learns from arrivals only and C_m is the measured step duration.
        """
        if self.scenario is not None and self.waiting:
            server = self.scenario.server_region
            times = [self.cost.transfer_s(server, self.scenario.node_region(self.profiles[n].partition_id), self.cfg.wire.down)
                     for n in self.waiting if n in self.profiles]
            return sum(times) / len(times) if times else 0.0
        return self._last_step_wall

    # ---- policy hooks of the kernel (`OuterLoop.run`) ----------------------------------------------
    def done(self) -> bool:
        r = self.cfg.run
        return self.version >= r.rounds or (r.max_tokens > 0 and self.total_tokens >= r.max_tokens)

    def begin(self) -> None:
        self.dispatcher.wake_on_rejoin = True  # a repaired node gets work the moment it is back
        self.dispatch(self.idle_nodes())

    def advance(self) -> bool:
        """One event: a reply folded (and the step it completes), a grace window closed, a
        repaired node or an idle one given work. False once no node is left to train on."""
        pending = self.buffered() > 0
        # Di-PS Algorithm 1: wait forever while the buffer is empty; after each arrival the
        # step happens when no further reply comes within the grace time of the last one.
        # (a first step that awaits its peers waits for replies instead: `awaiting_peers`)
        windowed = pending and self.uses_grace and self.last_arrival is not None and not self.awaiting_peers()
        deadline = self.last_arrival + self.grace() if windowed else None
        ev = self.dispatcher.next_event(deadline=deadline)
        if ev is None and self.dispatcher.take_rejoined():
            self.dispatch(self.idle_nodes())  # the repaired node starts from the latest model
        elif ev is None and pending:
            self._log_step(self.step())
        elif ev is None:
            idle = self.idle_nodes()
            if not idle and not self.dispatcher.in_flight():
                if self.dispatcher.wait_for_repair():  # every node is down: on to the next repair
                    return True
                self.stop("no live node to train on (all vanished or benched after repeated errors)")
                return False
            self.dispatch(idle)
        else:
            self.handle(ev)
            if self.should_step():
                self._log_step(self.step())
            elif not ev.ok:
                self.dispatch([n for n in self.idle_nodes() if n == ev.job.node])
        return True

    def _log_step(self, metrics: dict[str, float]) -> None:
        """Log the step just taken (its nodes are training again: no client validation)."""
        self.record_step(self.version, metrics, self.done(), client_eval=False,
                         shown=min(self.version, self.cfg.run.rounds))
