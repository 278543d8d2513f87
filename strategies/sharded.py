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
(``grpc``: clients pull and push shards there, Flower carries only control). Both run the same
`FollowerShard` code, so every F gives the same bits for a seed (docs/sharded_ps.md).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from fl_geo.config import ConfigError, FlGeoConfig
from fl_geo.core.shards import ShardPlan, global_norm, sum_of_shard_norms
from fl_geo.core.transfer_schedule import TransferScheduler
from fl_geo.ps.follower import FollowerError, FollowerShard
from fl_geo.ps.leader_view import RemoteFollower
from fl_geo.runtime.dispatch import Event
from fl_geo.strategies.asynchronous import AsyncOuterLoop
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
                       step_tokens: int | None = None) -> tuple[TrainReply, int]:
    """A train reply of the gRPC transport: metrics only (the update went to the followers),
    checked like every train reply (`read_reply_metrics`). Returns the reply and the model version
    the client pulled: never older than the job's, never newer than ``latest_version`` (a claim
    from the future would make the staleness negative)."""
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
    return TrainReply([], checked.tokens, checked.loss, checked.step_time_s, pushed, checked.steps,
                      checked.noisy_steps), pulled


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
        self._bound_key = -1
        self.supervisor: Any = None
        self._ca_pem = ""  # the data path's CA certificate, sent to clients (TLS)
        self._resume_version = 0
        self.voided = 0
        self.scheduler = TransferScheduler(list(range(ps.followers)), ps.followers)
        send = "params" if self._send == "params" else "pseudo_grad"
        if ps.transport == "local":
            # Views into the leader's buffer: evaluation and the final model need no gather.
            self.followers: list[Any] = [
                FollowerShard(self.plan, s.index, outer_optimizer_from_config(cfg, s.numel),
                              params=self.global_params[s.begin:s.end], wire=cfg.wire.up, send=send,
                              max_pending=ps.max_pending)
                for s in self.plan.shards]
        else:
            from fl_geo.ps.channel import TlsFiles
            from fl_geo.ps.supervisor import FollowerSupervisor

            workdir = Path(ps.workdir) if ps.workdir else Path(self.logger.run_dir) / "ps"
            opt = outer_optimizer_from_config(cfg, 1)
            kwargs = {k: v for k, v in opt.state_dict().items() if k not in ("numel", "steps")}
            tls = None
            if ps.tls_certs_dir:
                certs = Path(ps.tls_certs_dir)
                tls = TlsFiles(certs / "ca.crt", certs / "server.crt", certs / "server.key")
            self._ca_pem = tls.ca_pem().decode() if tls is not None else ""
            self.supervisor = FollowerSupervisor(
                self.plan, workdir, optimizer_name=opt.name, optimizer_kwargs=kwargs, wire=cfg.wire.up,
                send=send, keep=ps.checkpoint_keep, heartbeat_s=ps.heartbeat_s, max_pending=ps.max_pending,
                torch_threads=cfg.run.server_threads, host=ps.host, tls=tls, key=_data_path_key(ps.key_file),
                allow_plaintext_remote=ps.allow_insecure_remote)
            self.followers = []  # connected when the run starts (`_start_followers`)
        log.info("sharded parameter server: %d follower(s) (%s), shards of %s elements", ps.followers,
                 ps.transport, ", ".join(str(s.numel) for s in self.plan.shards))

    # ---- checkpoint and resume of the leader -------------------------------------------------------
    def model_state(self) -> dict[str, Any]:
        """In process: θ (views of the followers' shards) and each shard's outer state. Follower
        processes: only the version they must resume from; θ and the outer state are in their
        own checkpoints, written after every step (Di-PS §4.3: the leader saves metadata)."""
        if self.supervisor is None:
            return {"params": self.global_params,
                    "optimizer": {"shards": [f.optimizer.state_dict() for f in self.followers]}}
        return {"params": torch.empty(0), "optimizer": {"followers_version": self.version}}

    def prepare_model_state(self, state: dict[str, Any]) -> Any:
        opt = dict(state["optimizer"])
        version = int(state["counters"]["version"])
        if self.supervisor is not None:
            if "followers_version" not in opt or int(opt["followers_version"]) != version:
                raise ValueError("checkpoint was not written by a leader of follower processes (ps.transport=grpc)")

            def resume_followers() -> None:
                self._resume_version = version

            return resume_followers
        shards = opt.get("shards")
        if not isinstance(shards, list) or len(shards) != self.plan.num_shards:
            raise ValueError(f"checkpoint does not hold the outer state of {self.plan.num_shards} in-process "
                             "followers (written with another ps.followers or transport?)")
        params = state["params"]
        if not torch.is_tensor(params) or params.shape != self.global_params.shape or params.dtype != torch.float32:
            raise ValueError(f"checkpoint params are not an fp32 tensor of {self.spec.numel} elements")
        states = [{"format": 1, "index": s.index, "begin": s.begin, "end": s.end, "version": version,
                   "params": params[s.begin:s.end], "optimizer": dict(st)} for s, st in zip(self.plan.shards, shards, strict=True)]
        for f, st in zip(self.followers, states, strict=True):  # validate on scratch copies first
            scratch = FollowerShard(self.plan, f.index, copy.copy(f.optimizer), params=f.params.clone(),
                                    wire=f.wire, send=f.send)
            scratch.load_state_dict(st)

        def install() -> None:
            for f, st in zip(self.followers, states, strict=True):
                f.load_state_dict(st)

        return install

    def _start_followers(self) -> None:
        """Launch the follower processes: fresh from this run's model, or, for a resumed
        leader, from their checkpoints of the leader's step."""
        ps = self.cfg.ps
        if self.resumed:
            self.supervisor.start(self.global_params, resume_version=self._resume_version)
        else:
            _clear_followers(self.supervisor.workdir)  # a new run starts from this run's model
            self.supervisor.start(self.global_params)
        self.followers = [self._connect(i) for i in range(ps.followers)]

    # ---- follower failures (gRPC transport) -------------------------------------------------------
    def _connect(self, i: int) -> RemoteFollower:
        """A control client for follower i, pinned to its current incarnation: a call that reaches
        a restarted process fails instead of running on its reloaded state. The leader retries
        briefly (the supervisor restarts dead followers); clients retry for ``ps.retry_s``."""

        client = self.supervisor.client(i, retry_s=max(3 * self.cfg.ps.heartbeat_s, 5.0))
        client.incarnation = client.health()["incarnation"]
        return RemoteFollower(client)

    def _followers_ok(self) -> bool:
        """Restart dead followers (heartbeats missed or process gone); False when this window
        was voided because one of them lost what it held."""
        if self.supervisor is None or not self.supervisor.check():
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
        from fl_geo.ps.frames import DataPathError

        restarted = self.supervisor.ensure_alive()
        for i in range(len(self.followers)):
            try:
                self.followers[i].client.health()
                if i in restarted or self.followers[i].client.address != self.supervisor.addresses[i]:
                    raise DataPathError("health", self.followers[i].client.address, "restarted")
            except DataPathError:
                self.followers[i].client.close()
                self.followers[i] = self._connect(i)
        versions = [int(f.client.health()["version"]) for f in self.followers]
        if set(versions) != {self.version}:
            raise RuntimeError(
                f"after restarting follower(s) {restarted} the followers hold versions {versions} and the leader "
                f"{self.version}: a follower failed during the step itself; their checkpoints are under "
                f"{self.supervisor.workdir}")
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

    # ---- dispatch: with the gRPC transport a train message carries control only ------------------
    def dispatch(self, nodes: list[int]) -> None:
        super().dispatch(nodes)
        if nodes and self.supervisor is not None:
            self.dispatcher.poll()  # let clients start (and pull) at the version they were sent

    def model_records(self) -> tuple[dict[str, Any], int]:
        if self.supervisor is None:
            return super().model_records()
        return {}, self.cost.sent_bytes(self.cfg.wire.down)

    def job_config(self, node: int, job: str) -> dict[str, Any]:
        if self.supervisor is None:
            return {}
        ps = self.cfg.ps
        return {
            "ps_job": job,
            "ps_addresses": json.dumps(self.supervisor.addresses),
            "ps_shards": json.dumps([[s.begin, s.end] for s in self.plan.shards]),
            "ps_push_order": json.dumps(self.push_order(job)),
            "ps_chunk_bytes": ps.chunk_mib << 20,
            "ps_retry_s": ps.retry_s,
            "ps_tls_ca": self._ca_pem,  # the CA's public certificate: clients verify the followers with it
            # this job may push to and pull from every shard, from the version it is sent, until
            # its update is folded or dropped (fl_geo.ps.auth); the key itself never leaves the leader
            "ps_token": self.supervisor.auth.mint_job(job, range(self.plan.num_shards), self.version,
                                                      ttl_s=ps.token_ttl_s),
        }

    def push_order(self, job: str) -> list[int]:
        """The order this job sends its shards in, planned with Di-PS Appendix A's scheduler
        among the jobs in flight: it starts on the first follower that no planned transfer uses
        in the plan's first step, then goes round, and joins the plan without moving anyone
        else's transfers (`TransferScheduler.add_worker`). A job leaves the plan when its reply
        (or failure) is handled."""
        f = self.plan.num_shards
        steps = self.scheduler.steps
        busy = {t.follower for t in steps[0]} if steps else set()
        start = next((i for i in range(f) if i not in busy), 0)
        order = [(start + i) % f for i in range(f)]
        self.scheduler.add_worker(job, order)
        return order

    # ---- replies ---------------------------------------------------------------------------------
    def read_reply(self, ev: Event) -> TrainReply:
        if self.supervisor is None:
            return super().read_reply(ev)
        node = ev.job.node
        r, pulled = read_control_reply(ev, int(ev.job.meta["version"]), self.version,
                                       max_steps=self.job_steps(node), step_tokens=self.step_tokens(node))
        ev.job.meta["version"] = pulled  # staleness counts from the model the client really pulled
        return r

    def handle(self, ev: Event) -> None:
        self.scheduler.remove_worker(str(ev.job.meta.get("job", "")))
        self._followers_ok()
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
        except _data_path_errors() as exc:
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
        except _data_path_errors() as exc:
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
        except _data_path_errors() as exc:
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

    # ---- kernel hooks: the follower processes live as long as the run -----------------------------
    def open(self) -> None:
        if self.supervisor is not None:
            self._start_followers()

    def finish(self) -> None:
        super().finish()
        self.sync_model()

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


def _data_path_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean a follower could not be reached (none without the data path)."""
    try:
        from fl_geo.ps.frames import DataPathError
    except ImportError:  # pragma: no cover - grpcio is a dependency
        return ()
    return (DataPathError,)


def _data_path_key(key_file: str) -> bytes:
    """The leader/follower shared key: from ``ps.key_file`` (followers started separately read
    the same file), else a fresh random one for this run (`fl_geo.ps.auth.new_key`)."""
    from fl_geo.ps.auth import new_key, read_key_file

    if not key_file:
        return new_key()
    try:
        return read_key_file(key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"ps.key_file: {exc}") from None


def _clear_followers(workdir: Path) -> None:
    """Remove the follower files a previous run left in ``workdir`` (only those: it may be a
    directory the user chose). Leader resume is not supported, so none of them is wanted."""
    import shutil

    for path in [*workdir.glob("follower-*"), workdir / "plan.json"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
