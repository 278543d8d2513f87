"""Synchronous outer loop: DiLoCo, EDiT, A-EDiT and the FL baselines FedAvg, FedAvgM, FedAdam, FedYogi.

All are one loop (docs/algorithms.md §3): every selected datacenter starts from θ_t, runs H inner
steps, replies with Δ_i = θ_t − θ_i; the server folds the replies into one streaming weighted sum
(uniform or token weights, one model-sized buffer however many replies) and applies its outer
optimizer to Δ̄. The baselines differ only in the outer optimizer: ``nesterov`` (DiLoCo), ``avg``
(FedAvg: θ ← θ − Δ̄ = mean of the local models), ``sgdm`` (FedAvgM), ``fedadam``/``fedyogi``.

EDiT (docs/algorithms.md §4) is DiLoCo with the pseudo-gradient penalty applied per module: outlier
rejection against per-(node, module) EMA statistics, norm-softmax weights, clipping, rollback of
modules every worker failed on; optionally a warm-up of one-step rounds with plain averaging
first (``strategy.sync_warmup_steps``). A-EDiT replaces H by a time budget
(``strategy.time_budget_s``): nobody waits for a straggler to finish H steps, and the steps each
worker managed can be mixed into the weights (``strategy.step_weight_ratio``).

A reply is validated before it touches anything (metrics present, exact keys, shapes and dtypes,
finite values); a bad one is logged with its node and reason, counted in ``outer/rejected``, and the
global model and optimizer state stay exactly as they were.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from flwr.app import Message, MessageType, RecordDict

from fl_geo.core.robust import median_norm_outliers
from fl_geo.core.step_weights import StepWeightMix
from fl_geo.core.weights import staleness_weight
from fl_geo.runtime.dispatch import NODE_DOWN, Event, JobTiming, RoundOutcome
from fl_geo.runtime.protocol import TrainRequest
from fl_geo.runtime.wire import PayloadError, check_finite_and_norm, encode, payload_nbytes
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.kernel import NoLiveNode
from fl_geo.strategies.replies import ReplyError, Tally, TrainReply, read_reply
from fl_geo.strategies.robust_rules import DIRECTION_RULES, DirectionRule

log = logging.getLogger("fl_geo")



class SyncOuterLoop(OuterLoop):
    """Runs ``run.rounds`` synchronous outer steps over the nodes of a Flower grid, or fewer when
    ``run.max_tokens`` is reached first."""

    # What a train reply may declare in its arrays (the data-parallel loop asks for ``grad``).
    reply_payloads: ClassVar[tuple[str, ...]] = ("pseudo_grad",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rng = random.Random(self.cfg.run.seed)
        self._held: list[tuple[int, TrainReply]] = []  # strategy.robust: the round's valid replies
        s = self.cfg.strategy
        self.warmup_left = s.sync_warmup_steps  # EDiT warm-up: one-step rounds still to run
        self.step_mix: StepWeightMix | None = None
        if self.penalty is not None and s.step_weight_ratio > 0:
            self.step_mix = StepWeightMix(self.penalty, s.step_weight_ratio)
        self.rounds_done = 0
        self._round_deltas: dict[int, int | None] = {}  # wire.compress_down: each node's deltas this round
        self.direction: DirectionRule | None = None  # strategy.robust's direction-aware rules
        if s.robust in DIRECTION_RULES:
            self.direction = DirectionRule(s.robust, self.spec.numel, trim=s.robust_trim, iters=s.robust_clip_iters,
                                           cos_min=s.robust_cos_min, window=s.robust_window)

    # ---- checkpoint -----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        state = {"rounds_done": self.rounds_done, "warmup_left": self.warmup_left,
                 "rng": [version, list(internal), gauss]}
        if self.direction is not None:
            state["robust"] = self.direction.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("rounds_done", "warmup_left", "rng") if k not in state]
        if missing:
            raise ValueError(f"synchronous loop state lacks keys {missing}")
        version, internal, gauss = state["rng"]
        rng = random.Random()
        rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        rounds_done, warmup_left = int(state["rounds_done"]), int(state["warmup_left"])
        if rounds_done < 0 or warmup_left < 0:
            raise ValueError(f"synchronous loop state has negative counters ({rounds_done}, {warmup_left})")
        if self.direction is not None:
            if "robust" not in state:
                raise ValueError(f"checkpoint has no state of strategy.robust={self.direction.rule}")
            self.direction.load_state_dict(dict(state["robust"]))
        self._rng, self.rounds_done, self.warmup_left = rng, rounds_done, warmup_left

    # ---- selection and messages ---------------------------------------------------------------
    def refresh_nodes(self) -> list[int]:
        """Every live, profiled node without a job in flight, in rank order."""
        return self.free_nodes()

    def select(self, nodes: list[int]) -> list[int]:
        k = self.cfg.strategy.clients_per_round
        if k and k < len(nodes):
            chosen = set(self._rng.sample(nodes, k))
            return [n for n in nodes if n in chosen]
        return nodes

    def _inner_steps(self, node: int, warm: bool) -> int:
        """H; 1 in the EDiT warm-up; the steps a time budget buys this node in virtual time; or
        DynUpd's H·speed_i/max speed."""
        s = self.cfg.strategy
        if warm:
            return 1
        if s.time_budget_s > 0 and self.scenario is not None:
            return self.scenario.time_budget_steps(s.time_budget_s, self.profiles[node].partition_id)
        return self.job_steps(node)  # DiLoCo + DynUpd (HALoS Table 1) with strategy.dynupd

    def _message(self, node: int, arrays: Any, rnd: int, mtype: str, **extra: Any) -> Message:
        # With checkpoints on, each node keeps the inner state it had at the newest checkpoint, so
        # that a server resumed from it, sending the rounds after it again, gets the same results
        # (clients/persist.py).
        checkpoint_step = self.checkpoint_step if self.cfg.run.checkpoint_every else None
        config = dict(self._client_cfg, round=rnd, base_version=self.version, checkpoint_step=checkpoint_step,
                      **extra)
        content = RecordDict({"arrays": arrays, **self.request_records(TrainRequest(**config), self.user_train_config)})
        return Message(content, dst_node_id=node, message_type=mtype)

    # ---- reply handling -------------------------------------------------------------------------
    def fold_replies(self, stats: Tally, group: Sequence[tuple[int, Message]], warm: bool = False) -> None:
        """Validate a group of replies and fold the good ones in one pass; never raises on bad input.

        The fold checks every value for NaN/Inf before anything it carries reaches the sum, and
        gives the same bits as folding the accepted replies one by one in order, however the
        replies were grouped by arrival. With a penalty (outside the warm-up) each reply is
        normed, tested and folded with its weight (``PenalisedFold.fold``).
        """
        valid: list[tuple[int, TrainReply]] = []
        for node, reply in group:
            try:
                # an undeclared (Flower-convention) reply's Δ is taken against the model sent this round
                # (a loop that takes no plain Flower ClientApp keeps no base: an undeclared reply is refused)
                base = self.global_params if self.supports_plain_clients else None
                valid.append((node, read_reply(reply, self.spec, self.cfg.wire.up, expected_version=self.version,
                                               base=base, payloads=self.reply_payloads,
                                               max_steps=self._inner_steps(node, warm),
                                               step_tokens=self.step_tokens(node), compressor=self.uplink)))
            except ReplyError as exc:
                self._reject(stats, node, str(exc))
        if not valid:
            return
        # Judged against the whole round, so folded at its end: with a robust rule; and the plain
        # replies' example claims while no claim has been accepted yet (their reference is then
        # the round's claims). Once anything is held, the rest of the round is held too, so the
        # fold keeps the arrival order (and its bits).
        if (self.cfg.strategy.robust != "none" or self._held
                or (self.claims.awaiting_first() and any(r.plain for _, r in valid))):
            self._held.extend(valid)
            return
        valid = self.claims.judge(stats, valid)
        if valid:
            self._fold_valid(stats, valid, warm)

    def fold_held(self, stats: Tally, warm: bool) -> None:
        """``strategy.robust``: the round is complete. ``median_norm``: reject the updates whose
        norm is beyond the bound of the round's median (fl_geo.core.robust), fold the others in the
        order they were received; the direction-aware rules: `_fold_directed`."""
        held, self._held = self._held, []
        held = self.claims.judge(stats, held, whole_round=True)
        if self.cfg.strategy.robust == "none":
            if held:
                self._fold_valid(stats, held, warm)
            return
        if self.direction is not None:
            self._fold_directed(stats, held, warm)
            return
        norms = []
        for _, r in held:
            try:
                norms.append(check_finite_and_norm(r.pieces))
            except PayloadError:
                norms.append(float("nan"))  # refused by the fold with its own reason
        s = self.cfg.strategy
        outliers = median_norm_outliers(norms, s.robust_factor)
        for i, reason in outliers.items():
            self._reject(stats, held[i][0], reason)
        kept = [h for i, h in enumerate(held) if i not in outliers]
        if kept:
            self._fold_valid(stats, kept, warm)

    def _fold_directed(self, stats: Tally, held: list[tuple[int, TrainReply]], warm: bool) -> None:
        """The direction-aware rules (strategies/robust_rules.py): rejections are logged and
        counted like any; the kept replies fold in the order received, centered-clipped when the
        rule says so; a coordinate rule's aggregate is folded once, unweighted, in their place."""
        assert self.direction is not None
        tokens_weighted = self.cfg.strategy.weighting == "tokens"
        weights = [float(r.tokens) if tokens_weighted else 1.0 for _, r in held]
        judged = self.direction.judge([r.pieces for _, r in held], weights, self.update_bound())
        for i, reason in judged.rejected.items():
            self._reject(stats, held[i][0], reason)
        kept = [i for i in range(len(held)) if i not in judged.rejected]
        if not kept:
            return
        if judged.aggregate is None:
            self._fold_valid(stats, [(held[i][0], replace(held[i][1], pieces=[(0, judged.rows[i])]) if i in judged.rows
                                      else held[i][1]) for i in kept], warm)
            return
        stats.noisy_steps += sum(held[i][1].noisy_steps for i in kept)
        self.accumulator.add(judged.aggregate, 1.0)
        for i in kept:
            stats.accept(held[i][1], judged.norms[i])

    def _fold_valid(self, stats: Tally, valid: list[tuple[int, TrainReply]], warm: bool,
                    factor: float = 1.0) -> None:
        """Fold validated replies (weights × ``factor``, penalty, NaN/Inf and model-norm checks)."""
        stats.noisy_steps += sum(r.noisy_steps for _, r in valid)
        if self.penalty is not None and not warm:
            for node, r in valid:
                verdict = self.penalised.fold(stats, node, r.pieces, r.tokens)
                if verdict is None:
                    continue
                if self.step_mix is not None:
                    self.step_mix.fold_(r.pieces, verdict, r.steps)
                stats.accept(r, float(verdict.norms.norm()))
            return
        tokens_weighted = self.cfg.strategy.weighting == "tokens"
        weights = [(float(r.tokens) if tokens_weighted else 1.0) * factor for _, r in valid]
        result = self.accumulator.add_batch_checked([r.pieces for _, r in valid], weights, self.update_bound())
        for i, (node, r) in enumerate(valid):
            if i in result.rejected:
                self._reject(stats, node, result.rejected[i])
            else:
                stats.accept(r, float(result.norms[i]))

    def fold_late(self, stats: Tally, ev: Event) -> None:
        """A reply of an earlier round's job that missed its quorum (``strategy.quorum``):
        ``late_replies=drop`` counts it; ``fold`` folds it into this round with the staleness
        weight 1/sqrt(1 + τ), τ the model versions it is behind, after the usual checks against
        the job it answers (its version, its steps)."""
        if not ev.ok:
            stats.late_failed += 1
            if self.downlink is not None:
                self.downlink.forget(ev.job.node)
            return
        version, steps = int(ev.job.meta["version"]), int(ev.job.meta["steps"])
        if self.cfg.strategy.late_replies == "drop":
            stats.late_dropped += 1
            if self.dispatcher.goodput is not None:  # its whole job was work thrown away as too stale
                self.dispatcher.goodput.verdict(ev.job.node, "stale")
            log.debug("late reply from node %s (model version %d) dropped", ev.job.node, version)
            return
        try:
            r = read_reply(ev.reply, self.spec, self.cfg.wire.up, expected_version=version,
                           base=ev.job.meta.get("base"), max_steps=steps, step_tokens=self.step_tokens(ev.job.node),
                           compressor=self.uplink)
        except ReplyError as exc:
            self._reject(stats, ev.job.node, str(exc))
            return
        kept = self.claims.judge(stats, [(ev.job.node, r)])
        if not kept:
            return
        accepted = stats.accepted
        self._fold_valid(stats, kept, warm=False, factor=staleness_weight(self.version - version))
        stats.late_folded += stats.accepted - accepted

    # ---- the loop -----------------------------------------------------------------------------
    def _round_nodes(self) -> list[int]:
        """The nodes this round trains on; waits for repairs while every node is down.

        Raises `NoLiveNode` when none is left.
        """
        nodes = self.select(self.refresh_nodes())
        while not nodes and self.dispatcher.wait_for_repair():  # every node down: on to the next repair
            nodes = self.select(self.refresh_nodes())
        if not nodes:
            raise NoLiveNode("no live node to train on (all vanished or failed)")
        return nodes

    def _train_messages(self, rnd: int, nodes: list[int], warm: bool
                        ) -> tuple[list[Message], dict[int, int], int]:
        """The round's train messages, each node's inner steps, and the bytes sent down in all."""
        s = self.cfg.strategy
        arrays = encode(self.global_params, self.spec, self.cfg.wire.down) if self.downlink is None else None
        steps = {n: self._inner_steps(n, warm) for n in nodes}
        # A-EDiT on a wall clock: the client trains for the budget (H caps it)
        budget = s.time_budget_s if (s.time_budget_s > 0 and self.scenario is None and not warm) else 0.0
        msgs, down = [], 0
        self._round_deltas = {}
        for n in nodes:
            sent = self.down_message(self.downlink, n, self.global_params, self.version)
            if sent is None:  # the model whole (wire.compress_down off, or a plain Flower ClientApp)
                if arrays is None:
                    arrays = encode(self.global_params, self.spec, self.cfg.wire.down)
                record, fields, nbytes = self.arrays_for(n, arrays, self.global_params), {}, payload_nbytes(arrays)
                self._round_deltas[n] = None
            else:  # x̂ whole or its deltas (strategies/downlink.py)
                record, fields, nbytes, self._round_deltas[n] = sent
            down += nbytes
            msgs.append(self._message(n, record, rnd, MessageType.TRAIN, inner_steps=steps[n], time_budget_s=budget,
                                      **fields))
        return msgs, steps, down

    def _run_train_jobs(self, nodes: list[int], msgs: list[Message], steps: dict[int, int],
                        stats: Tally, warm: bool) -> RoundOutcome:
        """Send the train messages and fold the replies into ``stats`` as they arrive.

        With a quorum (``strategy.quorum``) each job carries the model version, steps and base it
        was sent with, so a late reply can still be checked and folded. Returns the dispatcher's
        outcome.
        """
        s = self.cfg.strategy
        order = nodes if s.fold_order == "rank" else None
        slots = [self.profiles[n].partition_id for n in nodes]
        # Compute only: the exchange of a synchronous round is modelled as one ring all-reduce over
        # the slowest link of the best ring (docs/algorithms.md §8). A wall clock ignores the
        # timings; the steps also key the reply deadline (jobs of other lengths are not compared).
        timings = [self._job_timing(slot, steps[n]) for slot, n in zip(slots, nodes, strict=True)]
        quorum = math.ceil(s.quorum * len(nodes)) if s.quorum > 0 else 0
        meta = [{"version": self.version, "steps": steps[n], "base": self.base_snapshot(n, self.global_params)}
                for n in nodes] if quorum else None
        return self.dispatcher.run_jobs(
            msgs,
            on_replies=lambda group: self.fold_replies(stats, group, warm),
            order=order,
            timeout_s=s.round_timeout_s,
            timings=timings,
            meta=meta,
            quorum=quorum,
            on_late=lambda ev: self.fold_late(stats, ev),
        )

    def _job_timing(self, slot: int, steps: int) -> JobTiming:
        """What the virtual clock charges for one train job: ``steps`` inner steps on scenario
        node ``slot`` and the latency of the job's message to and from the server region (no
        bytes: the exchange is the all-reduce, `_model_allreduce`)."""
        return JobTiming(slot, steps)

    def _model_allreduce(self, nodes: list[int], outcome: RoundOutcome) -> None:
        """Scenario clock only: advance it by one ring all-reduce among the nodes that replied."""
        clock = self.dispatcher.clock
        # nodes lost to the failure trace, and those still training when the quorum came, take
        # no part in the all-reduce
        pending = set(outcome.pending)
        reduced = [self.profiles[n].partition_id for n in nodes
                   if outcome.errors.get(n) != NODE_DOWN and n not in pending]
        if self.scenario is not None and reduced:
            nbytes = self.cost.charged_up_bytes(self.cfg.wire.up)  # compressed with wire.compress
            if self.downlink is not None:
                # wire.compress_down: the ring's all-gather half carries what the sites are sent
                # (the largest of the round: x̂ whole for a site that needs it), its reduce-scatter
                # half the update; a ring's time is linear in its bytes, so one ring of the mean
                down = max(self.cost.charged_down_bytes(self.cfg.wire.down, self._round_deltas.get(n))
                           for n in nodes if self.profiles[n].partition_id in reduced)
                nbytes = (nbytes + down + 1) // 2
            clock.advance_to(clock.now() + self.cost.allreduce_s(reduced, nbytes, start=clock.now()))

    def _step_if_enough(self, rnd: int, stats: Tally, warm: bool) -> tuple[float, list[str]]:
        """The outer step when at least ``strategy.min_replies`` updates were accepted.

        Returns ‖Δ̄‖ and the rolled-back modules, or NaN and none when the step is skipped (a
        warning is logged and the round's updates count as unused goodput).
        """
        s = self.cfg.strategy
        stepped = stats.accepted >= s.min_replies
        pg_norm = float("nan")
        rolled: list[str] = []
        if stepped:
            pg_norm, rolled = self._step(warm)
            self.version += 1
        else:
            log.warning(
                "round %d: %d accepted update(s) < strategy.min_replies=%d; outer step skipped, model unchanged",
                rnd, stats.accepted, s.min_replies,
            )
            if self.dispatcher.goodput is not None:
                self.dispatcher.goodput.settle(accepted=False)  # the round's updates were not used
        return pg_norm, rolled

    def _train_round_metrics(self, stats: Tally, outcome: RoundOutcome, warm: bool, pg_norm: float,
                             rolled: list[str], down: int) -> dict[str, float]:
        """The metrics a synchronous round reports (quorum and penalty figures when enabled)."""
        s = self.cfg.strategy
        metrics = {
            **self.tally_metrics(stats),
            "outer/pseudo_grad_norm": pg_norm,
            "outer/warmup": int(warm),
            "train/inner_steps": stats.mean(stats.steps),
            "train/step_time_s": stats.mean(stats.step_time_sum),
            "data/noisy_steps": stats.noisy_steps,
            "data/noisy_steps_accepted": stats.noisy_steps_accepted,
            "comm/bytes_down": down,
        }
        if s.quorum > 0:
            metrics.update({"outer/pending": len(outcome.pending), "outer/late_folded": stats.late_folded,
                            "outer/late_dropped": stats.late_dropped, "outer/late_failed": stats.late_failed})
        if self.penalty is not None and not warm:
            metrics["outer/rejected_modules"] = stats.rejected_groups
            metrics["outer/max_z"] = stats.max_z
            metrics["outer/rolled_back_modules"] = len(rolled)
            metrics.update(self.penalised.clip_metrics())
        return metrics

    def train_round(self, rnd: int) -> dict[str, float]:
        s = self.cfg.strategy
        warm = self.warmup_left > 0
        self.wait_for_quorum()
        nodes = self._round_nodes()
        msgs, steps, down = self._train_messages(rnd, nodes, warm)
        stats = Tally()
        self.accumulator.reset()
        if self.step_mix is not None:
            self.step_mix.reset()
        outcome = self._run_train_jobs(nodes, msgs, steps, stats, warm)
        if s.robust != "none" or self._held:
            self.fold_held(stats, warm)
        self._model_allreduce(nodes, outcome)
        failed = len(outcome.errors) + len(outcome.vanished) + len(outcome.timed_out)
        if self.downlink is not None:  # a failed job's node may not hold what it was sent
            for n in (*outcome.errors, *outcome.vanished, *outcome.timed_out):
                self.downlink.forget(n)
        pg_norm, rolled = self._step_if_enough(rnd, stats, warm)
        if self.penalty is not None and not warm:
            self.penalty.commit()  # statistics learn from the accepted updates only
        if warm:
            self.warmup_left -= 1
        self.total_bytes_down += down
        stats.errors = failed  # error replies, vanished and timed-out nodes
        return self._train_round_metrics(stats, outcome, warm, pg_norm, rolled, down)

    def _step(self, warm: bool) -> tuple[float, list[str]]:
        """One outer step on the folded replies; returns ‖Δ̄‖ and the rolled-back modules.

        Warm-up: plain averaging θ ← θ − Δ̄ (the outer optimizer and its momentum are untouched).
        Penalty: Σ w·Δ / Σ w per module, the step-weight mix, clip, step with rollback.
        """
        if warm:
            mean = self.accumulator.mean()
            self.global_params.sub_(mean)
            return float(torch.linalg.vector_norm(mean)), []
        if self.penalty is not None:
            buf = self.accumulator.buffer
            self.penalty.normalise_(buf)
            if self.step_mix is not None:
                self.step_mix.mix_(buf)
            pg_norm = float(torch.linalg.vector_norm(buf))
            return pg_norm, self.penalised.step(buf)
        mean = self.accumulator.mean()
        pg_norm = float(torch.linalg.vector_norm(mean))
        self.optimizer.step(self.global_params, mean)
        return pg_norm, []

    # ---- policy hooks of the kernel (`OuterLoop.run`) ----------------------------------------------
    def done(self) -> bool:
        """Every round is trained (warm-up rounds included), or ``run.max_tokens`` is reached (the
        round that reaches it is the last one); true at once when resumed from the final checkpoint."""
        r = self.cfg.run
        total = r.rounds + self.cfg.strategy.sync_warmup_steps
        return self.rounds_done >= total or (r.max_tokens > 0 and self.total_tokens >= r.max_tokens)

    def advance(self) -> bool:
        """One synchronous round, logged. Quorum rounds leave jobs in flight: the kernel's `drain`
        lets them finish (nothing is folded) when the run ends."""
        rnd = self.rounds_done + 1
        metrics = self.train_round(rnd)
        self.rounds_done = rnd
        self.record_step(rnd, metrics, self.done())
        return True
