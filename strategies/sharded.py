"""Di-PS with a sharded parameter server: the ServerApp is the leader, followers own the model.

Di-PS §4.1: "a leader PS is introduced to serve as the central controller" of follower PSs that
each manage several layers. Here the asynchronous loop (`AsyncOuterLoop`: grace window,
membership, versions, tokens, the penalty's statistics and decision) stays in the leader; what
touched model-sized data moves to the followers (`fl_geo.follower.FollowerShard`):

- per reply, every follower reports its shard's per-tensor sums of squares; the leader combines
  them into G (`ps.norm`: the global L2 norm, or Di-PS's sum of shard norms), scores it, and tells
  every follower to fold the update with its weight, or to drop it;
- per outer step, the leader sends the total weight, gets Δ̄'s per-tensor sums back, computes the
  clip factor min(1, φ/(‖Δ̄‖+ε)) and has every follower step.

Followers live in this process (``ps.transport=local``: updates still come in Flower replies;
with one follower this is the single-server Di-PS) or are processes behind the gRPC data path
(``grpc``: clients pull and push shards there, Flower carries only control). Both run the same
`FollowerShard` code, so every F gives the same bits for a seed (docs/sharded_ps.md).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

import torch

from fl_geo.accumulate import WeightedAccumulator
from fl_geo.config import ConfigError
from fl_geo.dispatch import Event
from fl_geo.follower import FollowerError, FollowerShard
from fl_geo.progress import Progress
from fl_geo.shards import ShardPlan, global_norm, sum_of_shard_norms
from fl_geo.strategies.asynchronous import AsyncOuterLoop
from fl_geo.strategies.base import outer_optimizer_from_config
from fl_geo.strategies.replies import REPLY_METRICS, ReplyError, TrainReply

log = logging.getLogger("fl_geo")


class Follower(Protocol):
    """What the leader asks of a follower, in process or over the data path."""

    def norms(self, job: str) -> list[float]: ...
    def fold(self, job: str, weight: float, rescale: float = 1.0) -> None: ...
    def drop(self, job: str) -> None: ...
    def mean_sq_sums(self, total_weight: float) -> list[float]: ...
    def step(self, clip_factor: float = 1.0, lr: float | None = None) -> int: ...
    def reset_window(self, drop_pending: bool = False) -> None: ...
    def theta_sq_sums(self) -> list[float]: ...


def read_control_reply(ev: Event, expected_version: int) -> TrainReply:
    """A train reply of the gRPC transport: metrics only (the update went to the followers)."""
    assert ev.reply is not None
    content = ev.reply.content
    if "metrics" not in content.metric_records:
        raise ReplyError("reply lacks the 'metrics' record")
    if "arrays" in content.array_records:
        raise ReplyError("reply carries arrays although updates go to the followers (ps.transport=grpc)")
    m = content.metric_records["metrics"]
    missing = [k for k in (*REPLY_METRICS, "ps_pushed_bytes") if k not in m]
    if missing:
        raise ReplyError(f"reply metrics lack {missing}")
    if "base_version" in m and int(m["base_version"]) != expected_version:
        raise ReplyError(f"reply says it trained from model version {int(m['base_version'])}, the job sent {expected_version}")
    tokens, loss, steps = int(m["tokens"]), float(m["train_loss"]), int(m["steps"])
    if tokens <= 0 or steps < 1 or not math.isfinite(loss):
        raise ReplyError(f"implausible metrics (tokens={tokens}, steps={steps}, train_loss={loss})")
    noisy = int(m["noisy_steps"]) if "noisy_steps" in m else 0
    return TrainReply([], tokens, loss, float(m["step_time_s"]), int(m["ps_pushed_bytes"]), steps, noisy)


class ShardedDiPSLoop(AsyncOuterLoop):
    """`AsyncOuterLoop` whose model, outer state and running sum live on ``ps.followers`` shards."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg, ps = self.cfg, self.cfg.ps
        try:
            self.plan = ShardPlan.build(self.spec, ps.followers)
        except ValueError as exc:
            raise ConfigError(f"ps.followers={ps.followers}: {exc}") from None
        self.accumulator = WeightedAccumulator(1)  # the followers hold the running sums
        self._plain_total = 0.0  # Σ weights without the penalty (with it, the penalty keeps it)
        self._bound_key = -1
        self.supervisor: Any = None
        self.voided = 0
        send = "params" if self._send == "params" else "pseudo_grad"
        if ps.transport == "local":
            # Views into the leader's buffer: evaluation and the final model need no gather.
            self.followers: list[Any] = [
                FollowerShard(self.plan, s.index, outer_optimizer_from_config(cfg, s.numel),
                              params=self.global_params[s.begin:s.end], wire=cfg.wire.up, send=send,
                              max_pending=ps.max_pending)
                for s in self.plan.shards]
        else:
            from fl_geo.dataplane import FollowerClient, FollowerSupervisor

            workdir = Path(ps.workdir) if ps.workdir else Path(self.logger.run_dir) / "ps"
            opt = outer_optimizer_from_config(cfg, 1)
            kwargs = {k: v for k, v in opt.state_dict().items() if k not in ("numel", "steps")}
            self.supervisor = FollowerSupervisor(
                self.plan, workdir, optimizer_name=opt.name, optimizer_kwargs=kwargs, wire=cfg.wire.up,
                send=send, keep=ps.checkpoint_keep, heartbeat_s=ps.heartbeat_s, max_pending=ps.max_pending)
            self.supervisor.start(self.global_params)
            self.followers = [RemoteFollower(FollowerClient(a, retry_s=ps.retry_s)) for a in self.supervisor.addresses]
        log.info("sharded parameter server: %d follower(s) (%s), shards of %s elements", ps.followers,
                 ps.transport, ", ".join(str(s.numel) for s in self.plan.shards))

    # ---- dispatch: with the gRPC transport a train message carries control only ------------------
    def model_records(self) -> tuple[dict[str, Any], int]:
        if self.supervisor is None:
            return super().model_records()
        return {}, self._nbytes_wire(self.cfg.wire.down)

    def _nbytes_wire(self, precision: str) -> int:
        return self.spec.numel * (4 if precision == "fp32" else 2)

    def job_config(self, node: int, job: str) -> dict[str, Any]:
        if self.supervisor is None:
            return {}
        ps = self.cfg.ps
        return {
            "ps_job": job,
            "ps_addresses": json.dumps(self.supervisor.addresses),
            "ps_shards": json.dumps([[s.begin, s.end] for s in self.plan.shards]),
            "ps_push_order": json.dumps(self.push_order(node)),
            "ps_chunk_bytes": ps.chunk_mib << 20,
            "ps_retry_s": ps.retry_s,
        }

    def push_order(self, node: int) -> list[int]:
        """The order a client sends its shards in: rotated by rank so that clients finishing
        together start on different followers (Di-PS Appendix A's no-conflict goal)."""
        f = self.plan.num_shards
        r = self.profiles[node].rank % f if node in self.profiles else 0
        return [(r + i) % f for i in range(f)]

    # ---- replies ---------------------------------------------------------------------------------
    def read_reply(self, ev: Event) -> TrainReply:
        if self.supervisor is None:
            return super().read_reply(ev)
        return read_control_reply(ev, int(ev.job.meta["version"]))

    def handle(self, ev: Event) -> None:
        if not ev.ok:
            self.discard(ev)  # a client may have pushed before it failed
        super().handle(ev)

    def discard(self, ev: Event) -> None:
        job = str(ev.job.meta.get("job", ""))
        if job:
            for f in self.followers:
                f.drop(job)

    def _push_local(self, job: str, pieces: list[tuple[int, torch.Tensor]]) -> None:
        """In-process transport: the reply's pieces (spec order) stream into each shard's buffer."""
        pieces = sorted(pieces, key=lambda p: p[0])
        k = 0
        for f, s in zip(self.followers, self.plan.shards, strict=True):
            buf = f.open_push(job)
            while k < len(pieces) and pieces[k][0] < s.end:
                offset, piece = pieces[k]
                buf.write(offset - s.begin, piece.reshape(-1))
                k += 1
            f.close_push(job)

    def fold_update(self, ev: Event, r: TrainReply, staleness: int) -> float | None:
        node, job = ev.job.node, str(ev.job.meta["job"])
        try:
            if self.supervisor is None:
                self._push_local(job, r.pieces)
            sums = [f.norms(job) for f in self.followers]
        except FollowerError as exc:
            self._reject(self.tally, node, f"update not usable on the followers: {exc}")
            self.discard(ev)
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
        for f in self.followers:
            f.fold(job, weight, rescale)
        return g

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
    def apply_update(self) -> None:
        total = float(self.penalty.total_weight[0]) if self.penalty is not None else self._plain_total
        sums = [f.mean_sq_sums(total) for f in self.followers]
        factor = 1.0
        if self.penalty is not None and self.penalty.clip is not None:
            norm = global_norm(sums)
            if not math.isfinite(norm):
                raise FloatingPointError("the averaged update is not finite; refusing to step")
            factor = min(1.0, self.penalty.clip / (norm + self.penalty.eps))
        versions = {f.step(factor, self.optimizer.lr) for f in self.followers}
        if versions != {self.version + 1}:
            raise RuntimeError(f"followers disagree on the model version after the step: {sorted(versions)}")
        self._plain_total = 0.0

    # ---- model access and life cycle -------------------------------------------------------------
    def sync_model(self) -> None:
        """Gather θ from follower processes into the leader's buffer (evaluation, the end)."""
        if self.supervisor is None:
            return
        for f, s in zip(self.followers, self.plan.shards, strict=True):
            version, theta = f.pull_params(s.numel)
            if version != self.version:
                raise RuntimeError(f"follower {s.index} holds version {version}, the leader {self.version}")
            self.global_params[s.begin:s.end].copy_(theta)

    def evaluate(self) -> dict[str, float]:
        if self.evaluator is not None:
            self.sync_model()
        return super().evaluate()

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        try:
            out = super().run(progress)
            self.sync_model()
            return out
        finally:
            if self.supervisor is not None:
                self.supervisor.stop()


class RemoteFollower:
    """The `Follower` interface over the data path's control calls (`fl_geo.dataplane`)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def norms(self, job: str) -> list[float]:
        return [float(x) for x in self.client.control("norms", job=job)["sq_sums"]]

    def fold(self, job: str, weight: float, rescale: float = 1.0) -> None:
        self.client.control("fold", job=job, weight=weight, rescale=rescale)

    def drop(self, job: str) -> None:
        self.client.control("drop", job=job)

    def mean_sq_sums(self, total_weight: float) -> list[float]:
        return [float(x) for x in self.client.control("mean_sq_sums", total_weight=total_weight)["sq_sums"]]

    def step(self, clip_factor: float = 1.0, lr: float | None = None) -> int:
        return int(self.client.control("step", clip_factor=clip_factor, lr=lr)["version"])

    def reset_window(self, drop_pending: bool = False) -> None:
        self.client.control("reset_window", drop_pending=drop_pending)

    def theta_sq_sums(self) -> list[float]:
        return [float(x) for x in self.client.control("theta_sq_sums")["sq_sums"]]

    def pull_params(self, numel: int) -> tuple[int, torch.Tensor]:
        version, theta = self.client.pull(0, numel, wire="fp32")
        return int(version), theta
