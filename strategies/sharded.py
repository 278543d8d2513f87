"""Di-PS with a sharded parameter server: the ServerApp is the leader, followers own the model.

Di-PS §4.1: "a leader PS is introduced to serve as the central controller" of follower PSs that
each manage several layers. Here the asynchronous loop (`AsyncOuterLoop`: grace window,
membership, versions, tokens, the penalty's statistics and decision) stays in the leader; what
touched model-sized data moves to the followers (`fl_geo.ps.follower.FollowerShard`):

- per reply, every follower reports its shard's per-tensor sums of squares; the leader combines
  them into G (`ps.norm`: the global L2 norm, or Di-PS's sum of shard norms), scores it, and tells
  every follower to fold the update with its weight, or to drop it;
- per outer step, the leader sends the total weight, gets Δ̄'s per-tensor sums back, computes the
  clip factor min(1, φ/(‖Δ̄‖+ε)) and has every follower step.

Followers live in this process (``ps.transport=local``: updates still come in Flower replies;
with one follower this is the single-server Di-PS) or are processes behind the gRPC data path
(``grpc``: clients pull and push shards there, Flower carries only control). The leader reaches
them only through its backend (`fl_geo.ps.backend`). Both run the same `FollowerShard` code, so
every F gives the same bits for a seed (docs/sharded_ps.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from fl_geo.config import ConfigError, FlGeoConfig
from fl_geo.core.shards import ShardPlan, global_norm, sum_of_shard_norms
from fl_geo.ps.backend import FollowerBackend, follower_backend
from fl_geo.ps.client import MAX_PULL_ROUNDS
from fl_geo.ps.follower import FollowerError
from fl_geo.runtime.dispatch import Event
from fl_geo.strategies.asynchronous import AsyncOuterLoop
from fl_geo.strategies.downlink import ShardedDownPlan
from fl_geo.strategies.replies import (
    ReplyError,
    TrainReply,
    metric_whole,
    read_reply_metrics,
    require_declaration,
)
from fl_geo.strategies.server_model import ServerModel, outer_optimizer_from_config

log = logging.getLogger("fl_geo")


def read_control_reply(ev: Event, expected_version: int, latest_version: int, max_steps: int | None = None,
                       step_tokens: int | None = None, most_pulled: int | None = None) -> tuple[TrainReply, int, int | None]:
    """A train reply of the gRPC transport: metrics only (the update went to the followers),
    checked like every train reply (`read_reply_metrics`). Returns the reply, the model version
    the client pulled (never older than the job's, never newer than ``latest_version``: a claim
    from the future would make the staleness negative) and the payload bytes it says it received
    from the followers (``ps_pulled_bytes``: a whole number up to ``most_pulled``; None from a
    client that does not report them)."""
    assert ev.reply is not None
    require_declaration(ev.reply, ("control",))
    content = ev.reply.content
    if "metrics" not in content.metric_records:
        raise ReplyError("reply lacks the 'metrics' record")
    if "arrays" in content.array_records:
        raise ReplyError("reply carries arrays although updates go to the followers (ps.transport=grpc)")
    m = content.metric_records["metrics"]
    if "ps_pushed_bytes" not in m:
        raise ReplyError("reply metrics lack ['ps_pushed_bytes']")
    checked = read_reply_metrics(m, expected_version, max_steps, step_tokens)
    # The client pulls θ itself: a step between dispatch and pull gives it a newer version, never an older one.
    pulled = metric_whole(m, "ps_version", 0) if "ps_version" in m else expected_version
    if pulled < expected_version:
        raise ReplyError(f"reply says it pulled model version {pulled}, older than the {expected_version} it was sent")
    if pulled > latest_version:
        raise ReplyError(f"reply says it pulled model version {pulled}, the followers hold {latest_version}")
    pushed = metric_whole(m, "ps_pushed_bytes", 0)
    received = metric_whole(m, "ps_pulled_bytes", 0, most_pulled) if "ps_pulled_bytes" in m else None
    return TrainReply([], checked.tokens, checked.loss, checked.step_time_s, pushed, checked.steps,
                      checked.noisy_steps), pulled, received


class ShardedDiPSLoop(AsyncOuterLoop):
    """`AsyncOuterLoop` whose model, outer state and running sum live on ``ps.followers`` shards."""

    supports_plain_clients: ClassVar[bool] = False

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        """The followers hold each shard's outer state and running sum; the leader keeps θ (views of
        the shards in process, a gathered copy otherwise) and the outer learning rate."""
        return ServerModel.held_elsewhere(cfg, global_params)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg, ps = self.cfg, self.cfg.ps
        try:
            self.plan = ShardPlan.build(self.spec, ps.followers)
        except ValueError as exc:
            raise ConfigError(f"ps.followers={ps.followers}: {exc}") from None
        self._plain_total = 0.0  # Σ weights without the penalty (with it, the penalty keeps it)
        # what the sites say they received from the followers (comm/bytes_down_pulled_total),
        # beside comm/bytes_down_total, which the leader counts from what it sends or plans
        self.bytes_down_pulled = 0
        self._bound_key = -1
        self.voided = 0
        send = "params" if self._send == "params" else "pseudo_grad"
        compress = self.uplink.settings if self.uplink is not None else None
        if compress is not None and ps.transport == "grpc":
            # each shard travels as its own payload: the clock charges the shards' payloads
            self.cost = replace(self.cost, up_shards=tuple(sh.numel for sh in self.plan.shards))
        # wire.compress_down with follower processes: they keep x̂ by shard and answer the pulls;
        # the leader only plans what each job is sent (bytes, clock). In process: `global_downlink`.
        down = cfg.wire.downlink() if ps.transport == "grpc" else None
        self.down_plan = (ShardedDownPlan(down, [sh.numel for sh in self.plan.shards], cfg.wire.down)
                          if down is not None else None)
        self.backend: FollowerBackend = follower_backend(
            self.plan, ps, self.global_params, lambda numel: outer_optimizer_from_config(cfg, numel),
            # wire.compress: the followers fold the decoded fp32 Δ̂, as the unsharded loop does
            wire="fp32" if compress is not None else cfg.wire.up,
            send=send, torch_threads=cfg.run.server_threads, run_dir=self._follower_root, compress=compress,
            compress_down=down, wire_down=cfg.wire.down)
        log.info("sharded parameter server: %d follower(s) (%s), shards of %s elements", ps.followers,
                 ps.transport, ", ".join(str(s.numel) for s in self.plan.shards))

    def global_downlink(self, cfg: FlGeoConfig, spec: Any, global_params: torch.Tensor) -> Any:
        """In process the leader's downlink serves the sites (its train messages carry the model);
        with follower processes the followers do (`down_plan`), and the leader keeps no x̂."""
        if cfg.ps.followers and cfg.ps.transport == "grpc":
            return None
        return super().global_downlink(cfg, spec, global_params)

    def down_message(self, downlink: Any, node: int, x: torch.Tensor, key: Any) -> Any:
        if self.down_plan is None:
            return super().down_message(downlink, node, x, key)
        return self.down_plan.message(node, self.version)

    def downlink_metrics(self) -> dict[str, float]:
        metrics = self.down_plan.metrics() if self.down_plan is not None else super().downlink_metrics()
        if self.backend.data_path:
            metrics["comm/bytes_down_pulled_total"] = float(self.bytes_down_pulled)
        return metrics

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "bytes_down_pulled": self.bytes_down_pulled}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pulled = state.pop("bytes_down_pulled", 0)  # checkpoints before 2026-11-30 lack it
        if not isinstance(pulled, int) or isinstance(pulled, bool) or pulled < 0:
            raise ValueError(f"checkpoint's bytes_down_pulled is malformed: {pulled!r}")
        super().load_extra_state(state)
        self.bytes_down_pulled = pulled

    @property
    def followers(self) -> list[Any]:
        """The followers' `fl_geo.ps.leader_view.Follower` views, in shard order (the backend's)."""
        return self.backend.followers

    def _follower_root(self) -> Path:
        """Where follower processes keep their files without ``ps.workdir``: the run directory.
        A public strategy whose logger keeps no directory must name one."""
        run_dir = getattr(self.logger, "run_dir", None)
        if run_dir is None:
            raise ConfigError("ps.transport=grpc needs a directory for the follower processes' checkpoints: set "
                              "ps.workdir (this run's logger keeps no run directory)")
        return Path(run_dir)
    # ---- checkpoint and resume of the leader -------------------------------------------------------
    def model_state(self) -> dict[str, Any]:
        """In process: θ (views of the followers' shards) and each shard's outer state. Follower
        processes: only the version they must resume from; θ and the outer state are in their
        own checkpoints, written after every step (Di-PS §4.3: the leader saves metadata)."""
        return self.backend.model_state(self.version)

    def prepare_model_state(self, state: dict[str, Any]) -> Callable[[], None]:
        return self.backend.prepare_model_state(state)

    # ---- follower failures ---------------------------------------------------------------------
    def _followers_ok(self) -> bool:
        """Restart dead followers (heartbeats missed or process gone); False when this window
        was voided because one of them lost what it held."""
        if self.backend.healthy():
            return True
        self._recover()
        return False

    def _recover(self) -> None:
        """Di-PS §4.3: restart dead followers from their newest checkpoint (the state after the
        last outer step they acknowledged) and void the current window on every follower.

        Outer steps wait meanwhile (this call blocks); clients keep training and their transfers
        retry. Updates folded in this window count as failed, not accepted: no step that
        completed is lost, and no half-applied window is stepped. Pushes for jobs not handled yet
        stay on the live followers; a job whose push the restarted follower lost fails when its
        reply is handled, and its worker gets the current model."""
        restarted = self.backend.recover(self.version)
        if self.down_plan is not None:  # a restarted follower's x̂_s has a new lineage: x̂ whole next
            self.down_plan.forget()
        for f in self.followers:
            f.reset_window()
        if self.penalty is not None:
            self.penalty.discard_step()
        t = self.tally
        log.warning("follower(s) %s restarted from their checkpoint at version %d: the %d update(s) folded in this "
                    "window are void (counted as failed); their workers get the current model", restarted,
                    self.version, t.accepted)
        self.voided += t.accepted
        t.errors += t.accepted
        redo, self.waiting = list(self.waiting), []  # this window's pushers: nothing of theirs will be stepped
        self.dispatch([n for n in self.idle_nodes() if n in redo])
        t.accepted = t.tokens = t.steps = t.noisy_steps_accepted = t.bytes_up = t.staleness_sum = t.staleness_max = 0
        t.loss_x_tokens = t.step_time_sum = t.norm_sum = 0.0
        t.loss_tokens = 0
        self._plain_total = 0.0

    # ---- dispatch: on the data path a train message carries control only --------------------------
    def dispatch(self, nodes: list[int]) -> None:
        super().dispatch(nodes)
        if nodes and self.backend.data_path:
            self.dispatcher.poll()  # let clients start (and pull) at the version they were sent

    def model_records(self) -> tuple[dict[str, Any], int]:
        if not self.backend.data_path:
            return super().model_records()
        return {}, self.cost.sent_bytes(self.cfg.wire.down)

    def job_config(self, node: int, job: str) -> dict[str, Any]:
        return self.backend.job_config(job, self.version)

    # ---- replies ---------------------------------------------------------------------------------
    def read_reply(self, ev: Event) -> TrainReply:
        if not self.backend.data_path:
            return super().read_reply(ev)
        node = ev.job.node
        # a site pulls each shard whole at most MAX_PULL_ROUNDS times, at most 4 bytes a parameter
        r, pulled, received = read_control_reply(ev, int(ev.job.meta["version"]), self.version,
                                                 max_steps=self.job_steps(node), step_tokens=self.step_tokens(node),
                                                 most_pulled=MAX_PULL_ROUNDS * 4 * self.spec.numel)
        ev.job.meta["version"] = pulled  # staleness counts from the model the client really pulled
        self.bytes_down_pulled += received or 0
        if self.down_plan is not None:
            self.down_plan.pulled(node, pulled)
        return r

    def handle(self, ev: Event) -> None:
        self.backend.release(str(ev.job.meta.get("job", "")))
        self._followers_ok()
        if not ev.ok:
            self.discard(ev)  # a client may have pushed before it failed
            if self.down_plan is not None:
                self.down_plan.forget(ev.job.node)
        super().handle(ev)

    def discard(self, ev: Event) -> None:
        job = str(ev.job.meta.get("job", ""))
        if job:
            for f in self.followers:
                f.drop(job)

    def fold_update(self, ev: Event, r: TrainReply, staleness: int) -> float | None:
        node, job = ev.job.node, str(ev.job.meta["job"])
        try:
            self.backend.push(job, r.pieces)
            missing = [i for i, f in enumerate(self.followers) if not f.has(job)]
            if missing:
                # pushed to a follower that has since restarted (or never arrived): the job failed
                log.warning("job %s of node %s: follower(s) %s hold no push for it; counted as failed", job, node, missing)
                self._redo(ev)
                return None
            sums = [f.norms(job) for f in self.followers]
        except FollowerError as exc:
            self._reject(self.tally, node, f"update not usable on the followers: {exc}")
            self.discard(ev)
            return None
        except self.backend.unreachable as exc:
            log.warning("follower unreachable while handling job %s: %s", job, exc)
            self._recover()
            self._redo(ev)
            return None
        l2 = global_norm(sums)
        g = l2 if self.cfg.ps.norm == "global" else sum_of_shard_norms(sums)
        reason = None
        bound = self.update_bound()
        if not math.isfinite(l2):
            reason = "update holds NaN or Inf values"
        elif bound is not None and l2 > bound:
            reason = f"update norm {l2:.4g} exceeds the bound {bound:.4g} (strategy.max_update_ratio)"
        weight, rescale = 0.0, 1.0
        if reason is None and self.penalty is not None:
            key = self.partition_of(node) if node in self.profiles else node
            verdict = self.penalty.observe(key, torch.tensor([g], dtype=torch.float64), tokens=r.tokens, staleness=staleness)
            if bool(verdict.scored.any()):
                z = float(verdict.z.max())
                self.tally.max_z = z if math.isnan(self.tally.max_z) else max(self.tally.max_z, z)
            if not verdict.any_accepted:
                reason = f"outlier (z={float(verdict.z.max()):.2f}, norm={g:.4g}, rule {self.cfg.penalty.rule})"
            weight, rescale = float(verdict.weights[0]), float(verdict.rescale[0])
        elif reason is None:
            weight = self._weight(r.tokens, staleness)
            self._plain_total += weight
        if reason is not None:
            self._reject(self.tally, node, reason)
            self.discard(ev)
            return None
        try:
            for f in self.followers:
                f.fold(job, weight, rescale)
        except self.backend.unreachable as exc:
            log.warning("follower unreachable while folding job %s: %s", job, exc)
            self._recover()  # voids the window, this update included
            self.discard(ev)
            return None
        return g

    def _redo(self, ev: Event) -> None:
        """A job whose update a follower lost: count it as failed and give its worker the
        current model now (it is not a pusher of this step: nothing of it will be stepped)."""
        self.tally.errors += 1
        self.discard(ev)
        node = ev.job.node
        if node in self.waiting:
            self.waiting.remove(node)
        self.dispatch([n for n in self.idle_nodes() if n == node])

    def update_bound(self) -> float | None:
        """``strategy.max_update_ratio`` × max(‖θ‖, 1), with ‖θ‖ from the followers' shards."""
        ratio = self.cfg.strategy.max_update_ratio
        if not ratio:
            return None
        if self._bound_key != self.version or self._bound is None:
            self._bound = ratio * max(global_norm([f.theta_sq_sums() for f in self.followers]), 1.0)
            self._bound_key = self.version
        return self._bound

    # ---- the outer step ------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        self._followers_ok()  # a dead follower voids the window before anything is stepped
        metrics = super().step()
        metrics["ps/voided_total"] = self.voided  # updates a follower restart voided (Di-PS §4.3)
        return metrics

    def apply_update(self) -> bool:
        if self.tally.accepted == 0:
            return False  # voided by a follower restart
        try:
            return self._sharded_step()
        except self.backend.unreachable as exc:
            log.warning("follower unreachable during outer step %d: %s", self.version + 1, exc)
            self._recover()
            return False

    def _sharded_step(self) -> bool:
        total = float(self.penalty.total_weight[0]) if self.penalty is not None else self._plain_total
        sums = [f.mean_sq_sums(total) for f in self.followers]
        factor = 1.0
        if self.penalty is not None and self.penalty.clip is not None:
            norm = global_norm(sums)
            if not math.isfinite(norm):
                raise FloatingPointError("the averaged update is not finite; refusing to step")
            factor = min(1.0, float(self.penalty.clip_thresholds()[0]) / (norm + self.penalty.eps))
            self.penalty.record_clipped(torch.tensor([factor * norm], dtype=torch.float64))
            self.penalised.record_clip(norm, [factor])
        versions = {f.step(factor, self.optimizer.lr) for f in self.followers}
        if versions != {self.version + 1}:
            raise RuntimeError(f"followers disagree on the model version after the step: {sorted(versions)}")
        self._plain_total = 0.0
        return True

    # ---- model access and life cycle -------------------------------------------------------------
    def sync_model(self) -> None:
        """Make the leader's buffer hold the followers' θ (evaluation, the end)."""
        self.backend.sync_model(self.version)

    def evaluate(self) -> dict[str, float]:
        if self.evaluator is not None:
            self.sync_model()
        return super().evaluate()

    # ---- kernel hooks: the follower processes live as long as the run -----------------------------
    def open(self) -> None:
        """Start the followers: a fresh run's from this run's model, a resumed leader's from their
        state of its restored step (the checkpoint's version, which `prepare_model_state` checked
        is the one the followers were told to resume from)."""
        self.backend.start(self.version if self.resumed else None)

    def finish(self) -> None:
        super().finish()
        self.sync_model()

    def close(self) -> None:
        self.backend.stop()
