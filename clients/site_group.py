"""A site's persistent inner-training group, seen from the coordinator (issue 29; docs/multidevice.md).

The spawned data-parallel job (`fl_geo.inner.distributed`) starts ``devices`` rank processes for
every train message and tears them down after it: each round pays process start, imports,
process-group set-up and model construction (on accelerators also CUDA/NCCL initialisation).
With a node config ``site-group="unix:///path/site.sock"`` the ranks instead live in a daemon
(`fl_geo.clients.site_daemon`) that outlives the ClientApp process, which under a SuperNode is a
new process per message. The ClientApp process is then the coordinator of one message:

1. take the node's group lock (``<socket>.lock``, ``flock``: one job per group at a time; the
   kernel releases it if the coordinator dies);
2. ``hello`` the daemon; start one if none answers, or stop and replace one whose identity (run,
   model, devices, backend, threads, fl-geo version) is not this job's: a daemon left by a
   previous run or started for another model is never reused;
3. write the received model and the AdamW state from ``context.state`` into the daemon's shared
   files (`SharedTrainState.map_files`, on ``/dev/shm``), send the job (a small pickle: the
   model factory, the inner settings, the data factory, the step range), wait for the reply;
4. read the trained parameters and AdamW state from the same files, reply, release the lock.

The numbers are those of the spawned job: every rank loads the parameters and the optimizer
state from the files for every job, so ``context.state`` (and its copy on disk, a rewound
round) stays the single source of truth. A failed job raises `DistributedTrainingError` with
the daemon's account (which rank, its traceback or how it died); the daemon has then ended the
group and starts a new one for the next job. Importable without Flower.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fl_geo import __version__
from fl_geo.core.state import ParamSpec
from fl_geo.errors import ConfigError
from fl_geo.halos.ipc import IpcError, recv_frame, send_frame, unix_path
from fl_geo.inner.distributed import DEFAULT_TIMEOUT_S, DistributedTrainingError
from fl_geo.inner.distributed_state import ModelFactory, SharedStateTrainer, SharedTrainState
from fl_geo.inner.site_rank import GroupJob
from fl_geo.inner.training import (
    BatchSource,
    InnerConfig,
    LossFn,
    ScheduleFn,
    TokensFn,
    TrainResult,
    check_train_args,
    lr_at,
)

__all__ = ["DEFAULT_IDLE_S", "SiteGroup", "SiteGroupTrainer"]

DEFAULT_IDLE_S = 1800.0  # a daemon with no request for this long exits (node config site-group-idle-s)
START_TIMEOUT_S = 120.0  # a new daemon must answer hello within this
_HELLO_TIMEOUT_S = 30.0


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (reaping it when it is our child; a zombie counts as ended)."""
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return status.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _end(pid: int, wait_s: float = 10.0) -> None:
    """Wait up to ``wait_s`` for ``pid`` to exit, then SIGKILL it (its ranks die with it)."""
    deadline = time.monotonic() + wait_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while not _gone(pid) and time.monotonic() - killed < 5.0:
                time.sleep(0.05)
            return
        time.sleep(0.05)


class SiteGroup:
    """The handle of one node's site group: its address, what it must be, how to start it.

    ``identity``: JSON-able; a daemon answering at ``address`` with another identity is
    replaced (the coordinator adds devices, backend, threads and the fl-geo version itself).
    ``timeout_s`` bounds every collective in the ranks (a peer that hangs without dying);
    ``idle_s`` ends a daemon nobody used for that long. ``nodes`` > 1: the site spans that many
    nodes, this one node 0; the daemon serves the site's store at ``rendezvous`` (host:port) and
    every other node runs `fl_geo.clients.site_node` with the same number of ``devices``.
    """

    def __init__(self, address: str, identity: Mapping[str, Any], devices: Sequence[torch.device], backend: str,
                 *, threads: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S, idle_s: float = DEFAULT_IDLE_S,
                 nodes: int = 1, rendezvous: str = "") -> None:
        try:
            self.path = unix_path(address)
        except IpcError as exc:
            raise ConfigError(f"node config site-group: {exc}") from None
        self.address = address
        self.devices = [str(d) for d in devices]
        self.backend = backend
        self.threads = int(threads)
        self.timeout_s = float(timeout_s)
        self.idle_s = float(idle_s)
        self.nodes, self.rendezvous = int(nodes), str(rendezvous)
        if self.nodes < 1:
            raise ConfigError(f"client.nodes (node config nodes) must be >= 1, got {nodes}")
        if self.nodes > 1:
            from fl_geo.inner.site_store import parse_rendezvous

            try:
                parse_rendezvous(self.rendezvous)
            except ValueError as exc:
                raise ConfigError(f"a site of {self.nodes} nodes needs node config site-rendezvous: {exc}") from None
        several = {"nodes": self.nodes, "rendezvous": self.rendezvous} if self.nodes > 1 else {}
        self.identity = json.loads(json.dumps({**identity, "devices": self.devices, "backend": backend,
                                               "threads": self.threads, "fl_geo": __version__, **several},
                                              sort_keys=True))
        self._lock_fd: int | None = None

    # ------------------------------------------------------------ requests

    def request(self, header: dict[str, Any], record: ArrayRecord | None = None,
                timeout_s: float = _HELLO_TIMEOUT_S) -> dict[str, Any] | None:
        """One request to the daemon; None when nobody listens at the address."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_HELLO_TIMEOUT_S)
            try:
                sock.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                return None
            send_frame(sock, header, record)
            sock.settimeout(timeout_s)
            reply, _ = recv_frame(sock, timeout_s=timeout_s)
            return reply
        except (OSError, IpcError) as exc:
            raise DistributedTrainingError(f"the site group at {self.address} failed to answer "
                                           f"{header.get('op')!r}: {exc}") from None
        finally:
            sock.close()

    def hello(self) -> dict[str, Any] | None:
        """The daemon's account of itself (identity, pid, rank pids, state_dir, jobs), or None."""
        return self.request({"op": "hello"})

    # ------------------------------------------------------------ life cycle

    def ensure(self) -> dict[str, Any]:
        """A daemon of this identity at the address: the one there, or a new one (replacing a stale one)."""
        try:
            info = self.hello()
        except DistributedTrainingError:  # a daemon that does not answer: end it by its pid file
            info = None
            self._kill_by_pid_file()
        if info is not None and info.get("identity") == self.identity:
            return info
        if info is not None:
            self.stop()
        return self._start()

    def stop(self) -> None:
        """Stop the daemon at the address (whatever its identity) and wait until it and its ranks are gone."""
        try:
            info = self.request({"op": "stop"})
        except DistributedTrainingError:
            self._kill_by_pid_file()
            return
        if info is None:
            return
        _end(int(info["pid"]))
        for pid in info.get("ranks", []):
            _end(int(pid), wait_s=5.0)

    def _kill_by_pid_file(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            _end(int(Path(self.path + ".pid").read_text().strip()), wait_s=0.0)

    def _start(self) -> dict[str, Any]:
        log_path = self.path + ".log"
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # The daemon (and its ranks) must unpickle the user's model and data factories: it gets
        # this process's import path (a ClientApp's FAB directory, a test's rootdir).
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, "-m", "fl_geo.clients.site_daemon", "--address", self.address,
               "--identity", json.dumps(self.identity), "--devices", ",".join(self.devices),
               "--backend", self.backend, "--threads", str(self.threads), "--timeout-s", str(self.timeout_s),
               "--idle-s", str(self.idle_s)]
        if self.nodes > 1:
            cmd += ["--nodes", str(self.nodes), "--rendezvous", self.rendezvous]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)  # outlives this process and its signals
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-2000:]
                raise DistributedTrainingError(f"the site-group daemon at {self.address} exited at start "
                                               f"(status {proc.returncode}); its log {log_path} ends:\n{tail}")
            with contextlib.suppress(DistributedTrainingError):
                info = self.hello()
                if info is not None and int(info.get("pid", -1)) == proc.pid:
                    return info
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        raise DistributedTrainingError(f"the site-group daemon at {self.address} did not answer within "
                                       f"{START_TIMEOUT_S:g} s (log: {log_path})")

    # ------------------------------------------------------------ one job at a time

    def acquire(self) -> None:
        """Take the node's group lock (blocking); held until `release` or this process ends."""
        if self._lock_fd is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def run(self, job: GroupJob, join_timeout_s: float | None = None) -> dict[str, Any]:
        """Send one job and wait for it; `DistributedTrainingError` with the daemon's account if it failed."""
        payload = pickle.dumps(job)  # small: no model, no partition (see GroupJob)
        record = ArrayRecord({"job": Array(dtype="uint8", shape=(len(payload),), stype="pickle", data=payload)})
        wait = (join_timeout_s if join_timeout_s is not None else 7 * 24 * 3600.0) + _HELLO_TIMEOUT_S
        reply = self.request({"op": "train", "join_timeout_s": join_timeout_s}, record, timeout_s=wait)
        if reply is None:
            raise DistributedTrainingError(f"the site group at {self.address} is gone")
        if reply.get("op") != "result":
            raise DistributedTrainingError(f"site group at {self.address}: {reply.get('error', reply)}")
        return reply


class SiteGroupTrainer(SharedStateTrainer):
    """``InnerTrainer``'s interface (load state, train, export state) for a job of a site group.

    The ClientApp's ``train`` handler uses it as it uses `DataParallelTrainer`: fill
    :attr:`params` with the global model, load the stored optimizer state, :meth:`train`, read
    :attr:`params` and :meth:`optimizer_state`. The buffers are the daemon's shared files, so the
    trainer holds the node's group lock from construction to :meth:`release` (call it once the
    reply is built: no other job may touch the files meanwhile).
    """

    def __init__(self, group: SiteGroup, model_factory: ModelFactory, cfg: InnerConfig, spec: ParamSpec, *,
                 batches: Callable[[], BatchSource] | None = None, loss_fn: LossFn | None = None,
                 lr_schedule: ScheduleFn | None = lr_at, tokens_fn: TokensFn | None = None,
                 join_timeout_s: float | None = None, parallel: str = "ddp",
                 rank_setup: Callable[[int, int], None] | None = None) -> None:
        self.group, self.model_factory, self.cfg, self.spec = group, model_factory, cfg, spec
        self.batches, self.loss_fn, self.lr_schedule, self.tokens_fn = batches, loss_fn, lr_schedule, tokens_fn
        self.join_timeout_s, self.rank_setup, self.parallel = join_timeout_s, rank_setup, parallel
        self.optimizer_kind = cfg.optimizer  # AdamW: the ClientApp refuses another (fl_geo.clients.parallel)
        group.acquire()
        try:
            self.info = group.ensure()
            self.shared = SharedTrainState.map_files(spec, str(self.info["state_dir"]))
        except BaseException:
            group.release()
            raise


    def train(self, sampler: BatchSource | None, steps: int, start_step: int,
              time_budget_s: float = 0.0) -> TrainResult:
        """One job of the group. The ranks draw from ``batches()`` when the trainer has that
        factory (``sampler`` is then the coordinator's own copy of the same source, not sent),
        else from ``sampler`` pickled into the job (a small source: tests, benchmarks)."""
        check_train_args(steps, start_step, time_budget_s)
        self.shared.result.zero_()  # so a job whose rank 0 never wrote cannot pass for a result
        job = GroupJob(model_factory=self.model_factory, inner=self.cfg, spec=self.spec,
                       state_dir=str(self.info["state_dir"]), steps=int(steps), start_step=int(start_step),
                       time_budget_s=float(time_budget_s), threads=self.group.threads,
                       sampler=None if self.batches is not None else sampler, batches=self.batches,
                       rank_setup=self.rank_setup, loss_fn=self.loss_fn, lr_schedule=self.lr_schedule,
                       tokens_fn=self.tokens_fn, parallel=self.parallel)
        self.info = self.group.run(job, self.join_timeout_s)
        values = self.shared.result.tolist()
        if int(values[0]) < 1:
            raise DistributedTrainingError("the site group answered but rank 0 wrote no result")
        return TrainResult(steps=int(values[0]), tokens=int(values[1]), mean_loss=values[2],
                           step_time_s=values[3], final_loss=values[4])

    def release(self) -> None:
        """Let the node's next job use the group (idempotent)."""
        self.group.release()
