"""Where the sharded Di-PS leader's followers live: the one interface the leader calls.

The leader (`fl_geo.strategies.sharded.ShardedDiPSLoop`) decides: it scores and folds updates,
steps, voids a window and keeps the penalty. A backend holds the followers it decides for and
the transport to them, so the leader never asks which transport it runs on:

- `InProcessBackend` (``ps.transport=local``): `FollowerShard` views into the leader's θ buffer;
  the model goes out, and updates come back, in Flower messages.
- `ProcessBackend` (``grpc``): follower processes run by a `FollowerSupervisor` and driven
  through `RemoteFollower` control clients; clients pull and push shards on the data path with
  a per-job token (over TLS with ``ps.tls_certs_dir``). Dead followers restart from their
  checkpoints (Di-PS §4.3).

`follower_backend` builds the one a ``ps`` section asks for.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from fl_geo.core.compress import CompressSettings
from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.core.transfer_schedule import TransferScheduler
from fl_geo.errors import ConfigError
from fl_geo.ps.auth import new_key, read_key_file
from fl_geo.ps.channel import TlsFiles
from fl_geo.ps.follower import FollowerShard
from fl_geo.ps.frames import DataPathError
from fl_geo.ps.leader_view import RemoteFollower
from fl_geo.ps.settings import PsSection
from fl_geo.ps.supervisor import FollowerSupervisor

__all__ = ["FollowerBackend", "InProcessBackend", "ProcessBackend", "follower_backend"]

Pieces = list[tuple[int, torch.Tensor]]


class FollowerBackend(Protocol):
    """The followers of a `ShardPlan` and their transport, as the leader drives them.

    ``params`` (given at construction) is the leader's θ buffer: written in place, never
    replaced. ``followers`` are the `Follower` views, in shard order, that the leader's policy
    calls (has, norms, fold, drop, step, reset_window, ...); a recovery may replace them.
    """

    # True: clients pull and push shards on the data path and Flower messages carry control
    # only; False: the model and the updates travel in Flower messages.
    data_path: ClassVar[bool]
    # What a call to a follower raises when the follower cannot be reached (then `recover`).
    unreachable: ClassVar[tuple[type[BaseException], ...]]
    followers: list[Any]

    def start(self, resume_version: int | None) -> None:
        """Make the followers reachable: fresh from ``params``, or (``resume_version``: a resumed
        leader's step) from their own state of that step."""

    def stop(self) -> None:
        """Stop what `start` started; safe after a failed or missing `start`."""

    def model_state(self, version: int) -> dict[str, Any]:
        """The ``params`` and ``optimizer`` of the leader's checkpoint at ``version``."""

    def prepare_model_state(self, state: dict[str, Any]) -> Callable[[], None]:
        """Validate a checkpoint's model part (ValueError, nothing changed); return its installer."""

    def push(self, job: str, pieces: Pieces) -> None:
        """Hand a reply's update pieces (flat offset, values) to the followers."""

    def job_config(self, job: str, version: int) -> dict[str, Any]:
        """The config scalars a train message of ``job``, sent at ``version``, carries."""

    def release(self, job: str) -> None:
        """``job``'s reply (or failure) is handled: forget what was planned for it."""

    def healthy(self) -> bool:
        """False when a follower is dead and the leader must `recover`."""

    def recover(self, version: int) -> list[int]:
        """Restart dead followers at the leader's ``version`` and reconnect; the restarted indices."""

    def sync_model(self, version: int) -> None:
        """Make ``params`` hold the followers' θ of ``version`` (evaluation, the final model)."""


class InProcessBackend:
    """``ps.transport=local``: followers are `FollowerShard` views into the leader's θ buffer, so
    evaluation and the final model need no gather and the leader's checkpoint holds θ and each
    shard's outer state. Nothing runs outside this process, so nothing can die on its own."""

    data_path: ClassVar[bool] = False
    unreachable: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, plan: ShardPlan, params: torch.Tensor, make_optimizer: Callable[[int], OuterOptimizer], *,
                 wire: str, send: str, max_pending: int) -> None:
        self.plan = plan
        self.params = params
        self.followers: list[Any] = [
            FollowerShard(plan, s.index, make_optimizer(s.numel), params=params[s.begin:s.end], wire=wire, send=send,
                          max_pending=max_pending)
            for s in plan.shards]

    def start(self, resume_version: int | None) -> None:
        """Nothing to start: the followers were built with the backend."""

    def stop(self) -> None:
        """Nothing to stop."""

    def model_state(self, version: int) -> dict[str, Any]:
        """θ (the buffer the shards view) and each shard's outer state."""
        return {"params": self.params, "optimizer": {"shards": [f.optimizer.state_dict() for f in self.followers]}}

    def prepare_model_state(self, state: dict[str, Any]) -> Callable[[], None]:
        """Every shard's state is loaded into a scratch follower first, so a checkpoint that does
        not fit raises before any shard changes."""
        opt = dict(state["optimizer"])
        version = int(state["counters"]["version"])
        shards = opt.get("shards")
        if not isinstance(shards, list) or len(shards) != self.plan.num_shards:
            raise ValueError(f"checkpoint does not hold the outer state of {self.plan.num_shards} in-process "
                             "followers (written with another ps.followers or transport?)")
        params = state["params"]
        if not torch.is_tensor(params) or params.shape != self.params.shape or params.dtype != torch.float32:
            raise ValueError(f"checkpoint params are not an fp32 tensor of {self.plan.spec.numel} elements")
        states = [{"format": 1, "index": s.index, "begin": s.begin, "end": s.end, "version": version,
                   "params": params[s.begin:s.end], "optimizer": dict(st)}
                  for s, st in zip(self.plan.shards, shards, strict=True)]
        for f, st in zip(self.followers, states, strict=True):
            scratch = FollowerShard(self.plan, f.index, copy.copy(f.optimizer), params=f.params.clone(),
                                    wire=f.wire, send=f.send)
            scratch.load_state_dict(st)

        def install() -> None:
            for f, st in zip(self.followers, states, strict=True):
                f.load_state_dict(st)

        return install

    def push(self, job: str, pieces: Pieces) -> None:
        """The pieces (spec order) stream into each shard's push buffer; a piece that spans
        shards (a compressed reply's whole Δ̂) is cut at their bounds."""
        pieces = sorted(pieces, key=lambda p: p[0])
        for f, s in zip(self.followers, self.plan.shards, strict=True):
            buf = f.open_push(job)
            for offset, piece in pieces:
                flat = piece.reshape(-1)
                b, e = max(offset, s.begin), min(offset + flat.numel(), s.end)
                if b < e:
                    buf.write(b - s.begin, flat[b - offset:e - offset])
            f.close_push(job)

    def job_config(self, job: str, version: int) -> dict[str, Any]:
        """None: the job's model and update travel in its Flower messages."""
        return {}

    def release(self, job: str) -> None:
        """Nothing is planned per job."""

    def healthy(self) -> bool:
        """Always: the followers live and die with the leader."""
        return True

    def recover(self, version: int) -> list[int]:
        """Never needed (`healthy` is always True): nothing to restart."""
        return []

    def sync_model(self, version: int) -> None:
        """Nothing to gather: the followers step ``params`` itself."""


class ProcessBackend:
    """``ps.transport=grpc``: one follower process per shard, started, watched and restarted by a
    `FollowerSupervisor` under ``workdir``, holding the data path's shared key; the leader keeps
    a `RemoteFollower` per follower, pinned to its current incarnation.

    The followers checkpoint θ and their outer state after every step, so the leader's own
    checkpoint holds only the version they must resume from (Di-PS §4.3: the leader saves
    metadata). ``params`` holds their θ only after `sync_model`."""

    data_path: ClassVar[bool] = True
    unreachable: ClassVar[tuple[type[BaseException], ...]] = (DataPathError,)

    def __init__(self, plan: ShardPlan, params: torch.Tensor, make_optimizer: Callable[[int], OuterOptimizer],
                 ps: PsSection, *, wire: str, send: str, torch_threads: int, run_dir: Callable[[], Path],
                 compress: CompressSettings | None = None, compress_down: CompressSettings | None = None,
                 wire_down: str = "fp32") -> None:
        self.plan = plan
        self.params = params
        self.ps = ps
        workdir = Path(ps.workdir) if ps.workdir else run_dir() / "ps"
        opt = make_optimizer(1)
        kwargs = {k: v for k, v in opt.state_dict().items() if k not in ("numel", "steps")}
        tls = None
        if ps.tls_certs_dir:
            certs = Path(ps.tls_certs_dir)
            tls = TlsFiles(certs / "ca.crt", certs / "server.crt", certs / "server.key")
        self._ca_pem = tls.ca_pem().decode() if tls is not None else ""  # sent to clients: they verify followers
        self.supervisor = FollowerSupervisor(
            plan, workdir, optimizer_name=opt.name, optimizer_kwargs=kwargs, wire=wire, send=send,
            keep=ps.checkpoint_keep, heartbeat_s=ps.heartbeat_s, max_pending=ps.max_pending,
            torch_threads=torch_threads, host=ps.host, tls=tls, key=data_path_key(ps.key_file),
            allow_plaintext_remote=ps.allow_insecure_remote, compress=compress, compress_down=compress_down,
            wire_down=wire_down)
        self.scheduler = TransferScheduler(list(range(ps.followers)), ps.followers)
        self.followers: list[Any] = []  # connected by `start`

    @property
    def workdir(self) -> Path:
        """The followers' plan, checkpoints, logs and address files."""
        return self.supervisor.workdir

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self, resume_version: int | None) -> None:
        """Launch the follower processes: fresh from ``params`` (files a previous run left in
        ``workdir`` removed first), or from their checkpoints of ``resume_version``; connect."""
        if resume_version is None:
            clear_followers(self.workdir)
            self.supervisor.start(self.params)
        else:
            self.supervisor.start(self.params, resume_version=resume_version)
        self.followers = [self._connect(i) for i in range(self.ps.followers)]

    def stop(self) -> None:
        """Stop the follower processes (and the heartbeat service the supervisor serves)."""
        self.supervisor.stop()

    def _connect(self, i: int) -> RemoteFollower:
        """A control client for follower i, pinned to its current incarnation: a call that reaches
        a restarted process fails instead of running on its reloaded state. The leader retries
        briefly (the supervisor restarts dead followers); clients retry for ``ps.retry_s``."""
        client = self.supervisor.client(i, retry_s=max(3 * self.ps.heartbeat_s, 5.0))
        client.incarnation = client.health()["incarnation"]
        return RemoteFollower(client)

    # ---- the leader's checkpoint ---------------------------------------------------------------
    def model_state(self, version: int) -> dict[str, Any]:
        """Only the version the followers resume from; θ and the outer state are in theirs."""
        return {"params": torch.empty(0), "optimizer": {"followers_version": version}}

    def prepare_model_state(self, state: dict[str, Any]) -> Callable[[], None]:
        """Accept only a checkpoint of a leader of follower processes at its own version; nothing
        to install here: `start` rewinds the followers to the resumed leader's step."""
        opt = dict(state["optimizer"])
        version = int(state["counters"]["version"])
        if "followers_version" not in opt or int(opt["followers_version"]) != version:
            raise ValueError("checkpoint was not written by a leader of follower processes (ps.transport=grpc)")
        return _installed_by_start

    # ---- jobs ----------------------------------------------------------------------------------
    def push(self, job: str, pieces: Pieces) -> None:
        """Nothing to hand over: the client pushed its shards on the data path itself."""

    def job_config(self, job: str, version: int) -> dict[str, Any]:
        """Where and how the job pulls and pushes, and its token: it may push to and pull from
        every shard, from ``version``, until its update is folded or dropped (`fl_geo.ps.auth`);
        the key itself never leaves the leader."""
        ps = self.ps
        return {
            "ps_job": job,
            "ps_addresses": json.dumps(self.supervisor.addresses),
            "ps_shards": json.dumps([[s.begin, s.end] for s in self.plan.shards]),
            "ps_push_order": json.dumps(self.push_order(job)),
            "ps_chunk_bytes": ps.chunk_mib << 20,
            "ps_retry_s": ps.retry_s,
            "ps_tls_ca": self._ca_pem,
            "ps_token": self.supervisor.auth.mint_job(job, range(self.plan.num_shards), version, ttl_s=ps.token_ttl_s),
        }

    def push_order(self, job: str) -> list[int]:
        """The order this job sends its shards in, planned with Di-PS Appendix A's scheduler
        among the jobs in flight: it starts on the first follower that no planned transfer uses
        in the plan's first step, then goes round, and joins the plan without moving anyone
        else's transfers (`TransferScheduler.add_worker`). It leaves the plan at `release`."""
        f = self.plan.num_shards
        steps = self.scheduler.steps
        busy = {t.follower for t in steps[0]} if steps else set()
        start = next((i for i in range(f) if i not in busy), 0)
        order = [(start + i) % f for i in range(f)]
        self.scheduler.add_worker(job, order)
        return order

    def release(self, job: str) -> None:
        """The job leaves the transfer plan (`push_order`)."""
        self.scheduler.remove_worker(job)

    # ---- faults (Di-PS §4.3) -------------------------------------------------------------------
    def healthy(self) -> bool:
        """No follower's process exited or missed its heartbeats."""
        return not self.supervisor.check()

    def recover(self, version: int) -> list[int]:
        """Restart dead followers from their newest checkpoint and reconnect to every follower
        that restarted or moved. RuntimeError when they then disagree with the leader's
        ``version``: one failed during the step itself, which is not recoverable."""
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
        if set(versions) != {version}:
            raise RuntimeError(
                f"after restarting follower(s) {restarted} the followers hold versions {versions} and the leader "
                f"{version}: a follower failed during the step itself; their checkpoints are under "
                f"{self.workdir}")
        return restarted

    def sync_model(self, version: int) -> None:
        """Gather θ from the followers into ``params``; each must hold the leader's ``version``."""
        for f, s in zip(self.followers, self.plan.shards, strict=True):
            held, theta = f.pull_params(s.numel)
            if held != version:
                raise RuntimeError(f"follower {s.index} holds version {held}, the leader {version}")
            self.params[s.begin:s.end].copy_(theta)


def follower_backend(plan: ShardPlan, ps: PsSection, params: torch.Tensor,
                     make_optimizer: Callable[[int], OuterOptimizer], *, wire: str, send: str, torch_threads: int,
                     run_dir: Callable[[], Path], compress: CompressSettings | None = None,
                     compress_down: CompressSettings | None = None, wire_down: str = "fp32") -> FollowerBackend:
    """The backend ``ps.transport`` names, its followers over ``params`` (the leader's θ buffer)
    with ``make_optimizer(numel)``'s outer optimizer. ``run_dir`` is called only for follower
    processes without ``ps.workdir`` (they work under ``<run dir>/ps``): a run may have none.
    ``compress`` (``wire.compress``): follower processes decode their shard's payloads; in-process
    followers get the update the leader decoded from the Flower reply, so they need no codec.
    ``compress_down`` (``wire.compress_down``, on the ``wire_down`` grid): follower processes keep
    their shard of the public model and send sites its deltas; in process the leader's own
    downlink serves them (its train messages carry the model)."""
    if ps.transport == "local":
        return InProcessBackend(plan, params, make_optimizer, wire=wire, send=send, max_pending=ps.max_pending)
    return ProcessBackend(plan, params, make_optimizer, ps, wire=wire, send=send, torch_threads=torch_threads,
                          run_dir=run_dir, compress=compress, compress_down=compress_down, wire_down=wire_down)


def data_path_key(key_file: str) -> bytes:
    """The leader/follower shared key: from ``ps.key_file`` (followers started separately read
    the same file), else a fresh random one for this run (`fl_geo.ps.auth.new_key`)."""
    if not key_file:
        return new_key()
    try:
        return read_key_file(key_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"ps.key_file: {exc}") from None


def clear_followers(workdir: Path) -> None:
    """Remove the follower files a previous run left in ``workdir`` (only those: it may be a
    directory the user chose). A fresh run starts from its own model, so none of them is wanted."""
    for path in [*workdir.glob("follower-*"), workdir / "plan.json"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _installed_by_start() -> None:
    """A follower-process checkpoint installs nothing in the leader (`ProcessBackend.start`)."""
