"""Supervision of follower processes (Di-PS §4.3) and the data path's throughput probe.

`FollowerSupervisor` runs the followers of a `ShardPlan` as processes on this host, writes their
version-0 checkpoints, watches their heartbeats and exits, and restarts a dead one from its
newest checkpoint on the same port; a resumed leader rewinds them to its own step.
`data_path_throughput` measures one follower's push and pull rates (`fl-geo bench ps` uses the
full benchmark in `fl_geo.bench.ps`). The transport itself is `fl_geo.ps.client` / `fl_geo.ps.server`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fl_geo.atomic import write_text_atomic
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.compress import CompressSettings
from fl_geo.core.compress import settings_to_json as settings_json
from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan, tensor_sq_sums
from fl_geo.core.state import ParamSpec
from fl_geo.fork_server import process_context
from fl_geo.hosts import is_loopback
from fl_geo.ps.auth import KEY_ENV, DataPathAuth, new_key
from fl_geo.ps.channel import TlsFiles
from fl_geo.ps.client import FollowerClient
from fl_geo.ps.follower import WIRE_DTYPES, FollowerShard, check_wire_and_send
from fl_geo.ps.follower_main import run_forked
from fl_geo.ps.frames import BIT_VIEWS, DEFAULT_CHUNK_BYTES
from fl_geo.ps.heartbeat import LeaderHeartbeatService

__all__ = ["FollowerSupervisor", "data_path_throughput"]

log = logging.getLogger("fl_geo")


# ---- supervision (Di-PS §4.3) -------------------------------------------------------------------

class _ForkedProcess:
    """A follower forked from the fork server (`fl_geo.fork_server`), seen as the supervisor sees a
    `subprocess.Popen`: ``pid``, ``returncode`` (negative: the signal that ended it), ``poll``,
    ``wait`` (raises `subprocess.TimeoutExpired`)."""

    def __init__(self, process: Any, argv: list[str]) -> None:  # a started multiprocessing Process
        self._process = process
        self.pid: int = process.pid
        self.args = ["fl_geo.ps.follower_main", *argv]  # what it runs (its command line is the server's)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode


@dataclass
class _Proc:
    index: int
    process: subprocess.Popen[bytes] | _ForkedProcess
    port: int
    incarnation: str
    since: float  # monotonic time of the (re)start: the heartbeat grace period starts here


def _signal_group(pid: int, sig: int) -> None:
    """Signal the group a follower leads; the process alone if it has not made its group yet (a
    forked follower calls ``setsid`` as its first step). Gone already: nothing to do."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage holds exactly its elements (torch.save writes whole storages,
    so saving a slice of a model-sized buffer would write the whole buffer)."""
    t = t.detach()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


class FollowerSupervisor:
    """Runs the followers of a `ShardPlan` as processes and restarts dead ones from their
    checkpoints (Di-PS §4.3: followers heartbeat to the leader, which restarts failed ones from
    the latest checkpoint).

    Layout under ``workdir``: ``plan.json``, ``follower-i/`` (its `CheckpointStore`),
    ``follower-i.log`` (stdout/stderr, appended across restarts), ``follower-i.addr``.

    A restarted follower binds the port of the one it replaces, so clients that are retrying
    against the old address reach it without being told (a fresh port is used only if the old
    one cannot be bound). Heartbeats go to a `LeaderHeartbeatService`: pass the leader's own as
    ``heartbeats`` (served on ``leader_port``), or let the supervisor serve one on
    ``leader_port`` (0: any free port). Followers exit when the process that started them dies
    (``--parent-pid``), so a crashed test or leader leaves no orphans behind.

    Followers are forked from this process's fork server (`fl_geo.fork_server`: torch imported
    once, a follower or a restart is up in a fraction of a second) where the platform has one and
    ``python`` is this interpreter; else each is a fresh ``python -m fl_geo.ps.follower_main``
    (``FL_GEO_RANK_START=spawn`` forces that, as do another ``python`` and ``fork=False``: the
    memory benchmarks use it, since a forked process's RSS counts the pages it shares with the fork
    server). Both run the same `main`.

    ``num`` (the number of followers) may be left out for a `ShardPlan`; it cuts a `ParamSpec`.
    ``FollowerSupervisor(plan, workdir, ...)`` is accepted too (a path as the second argument).

    ``key``: the data path's shared secret (`fl_geo.ps.auth`; a fresh one when None). Followers
    get it in their environment (``FLGEO_PS_KEY``), never on their command line; a restarted
    follower gets the same key, so job tokens issued before the restart still verify. `client`
    gives leader clients (they sign control requests); `auth` mints job tokens for clients.
    """

    def __init__(self, plan: ShardPlan | ParamSpec, num: int | str | os.PathLike[str] | None = None,
                 workdir: str | os.PathLike[str] | None = None, leader_port: int = 0,
                 optimizer_name: str = "nesterov", optimizer_kwargs: dict[str, Any] | None = None,
                 wire: str = "bf16", send: str = "pseudo_grad", keep: int = 3,
                 heartbeat_s: float = 1.0, miss: int = 3, python: str = sys.executable, *,
                 max_pending: int = 64, torch_threads: int = 1, tls: TlsFiles | None = None,
                 heartbeats: LeaderHeartbeatService | None = None,
                 start_timeout_s: float = 120.0, host: str = "127.0.0.1", key: bytes | None = None,
                 allow_plaintext_remote: bool = False, compress: CompressSettings | None = None,
                 compress_down: CompressSettings | None = None, wire_down: str = "fp32",
                 fork: bool = True) -> None:
        if isinstance(num, str | os.PathLike):  # FollowerSupervisor(plan, workdir, ...)
            if workdir is not None:
                raise ValueError("workdir given twice (second positional argument and workdir=)")
            num, workdir = None, num
        if workdir is None:
            raise ValueError("FollowerSupervisor needs a workdir")
        if isinstance(plan, ParamSpec):
            if num is None:
                raise ValueError("give the number of followers to cut a ParamSpec into")
            plan = ShardPlan.build(plan, num)
        elif num is not None and num != plan.num_shards:
            raise ValueError(f"num={num} but the plan has {plan.num_shards} shards")
        check_wire_and_send(wire, send)
        self.plan = plan
        self.num = plan.num_shards
        self.workdir = Path(workdir)
        self.optimizer_name = optimizer_name
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        build_outer_optimizer(optimizer_name, 1, **self.optimizer_kwargs)  # validate names early
        self.wire = wire
        self.send = send
        self.compress = compress  # wire.compress: followers decode their shard's payloads
        self.compress_down = compress_down  # wire.compress_down: followers keep their shard of x̂
        self.wire_down = wire_down
        self.keep = keep
        self.max_pending = max_pending
        # Reductions (the norms) are summed in a thread-count-dependent order: followers use the
        # leader's thread count so in-process and follower-process runs give the same bits.
        self.torch_threads = torch_threads
        self.tls = tls  # followers serve TLS with it; the heartbeat service too
        self.heartbeat_s = heartbeat_s
        self.miss = miss
        self.python = python
        self.fork = fork
        self.start_timeout_s = start_timeout_s
        if tls is None and not is_loopback(host) and not allow_plaintext_remote:
            raise ValueError(f"followers on {host} without TLS: give tls=, or allow_plaintext_remote=True "
                             "for a trusted network (ps.allow_insecure_remote)")
        self.host = host
        self.allow_plaintext_remote = allow_plaintext_remote
        self._key = key if key is not None else new_key()
        self.auth = DataPathAuth(self._key)
        self._own_heartbeats = heartbeats is None
        self.heartbeats = heartbeats or LeaderHeartbeatService()
        self.leader_port = leader_port
        self._procs: dict[int, _Proc] = {}

    # -- paths -----------------------------------------------------------------------------------
    def checkpoint_dir(self, i: int) -> Path:
        return self.workdir / f"follower-{i}"

    def log_path(self, i: int) -> Path:
        return self.workdir / f"follower-{i}.log"

    def addr_path(self, i: int) -> Path:
        return self.workdir / f"follower-{i}.addr"

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of each follower, in shard order."""
        return [f"{self.host}:{self._procs[i].port}" for i in range(self.num)]

    def client(self, i: int, **kwargs: Any) -> FollowerClient:
        """A leader client of follower i over this supervisor's transport (TLS when configured),
        holding the shared key: it may send control requests and pull without a job token."""
        return FollowerClient(f"{self.host}:{self._procs[i].port}", leader_key=self._key,
                              root_certificates=self.tls.ca_pem() if self.tls else None, **kwargs)

    def pid(self, i: int) -> int:
        return self._procs[i].process.pid

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, initial_params: torch.Tensor, resume_version: int | None = None) -> FollowerSupervisor:
        """Write each shard's version-0 checkpoint unless it has one (then it resumes), launch
        every follower, and wait until all answer ``health``.

        ``resume_version``: a restarted leader resumes from its own checkpoint of that outer
        step; every follower must hold a verified checkpoint of it, and the newer ones (steps the
        leader never recorded) are removed so each follower starts exactly there."""
        flat = initial_params.detach().reshape(-1)
        if flat.numel() != self.plan.spec.numel:
            raise ValueError(f"initial params have {flat.numel()} elements, the plan {self.plan.spec.numel}")
        if flat.dtype != torch.float32:
            flat = flat.float()
        self.workdir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.workdir / "plan.json", self.plan.to_json())
        if self._own_heartbeats and self.heartbeats.port is None:
            self.leader_port = self.heartbeats.serve(self.leader_port, self.host,
                                                     self.tls.server_credentials() if self.tls else None)
        try:
            if resume_version is not None:
                self._rewind(resume_version)
            for i, shard in enumerate(self.plan.shards):
                store = CheckpointStore(self.checkpoint_dir(i), self.keep)
                if store.steps():
                    log.info("follower %d resumes from checkpoint step %d", i, store.steps()[-1])
                    continue
                optimizer = build_outer_optimizer(self.optimizer_name, shard.numel, **self.optimizer_kwargs)
                params = _compact(flat[shard.begin:shard.end])
                follower = FollowerShard(self.plan, i, optimizer, params=params, wire=self.wire, send=self.send,
                                         max_pending=self.max_pending)
                store.save(0, follower.state_dict())
                del follower, params
            for i in range(self.num):
                self._launch(i, 0)
            for i in range(self.num):
                self._await_start(i)
        except BaseException:
            self.stop()
            raise
        return self

    def _rewind(self, version: int) -> None:
        """Check every follower holds a verified checkpoint of ``version``, then drop newer ones."""
        stores = [CheckpointStore(self.checkpoint_dir(i), self.keep) for i in range(self.num)]
        for i, store in enumerate(stores):
            if version not in store.steps():
                raise RuntimeError(
                    f"follower {i} holds no checkpoint of outer step {version} (it has {store.steps()[-5:]}) "
                    f"in {store.directory}: keep more of them (ps.checkpoint_keep) than the leader's "
                    "run.checkpoint_every")
            store.load(version)  # raises CheckpointError when it does not verify
        for i, store in enumerate(stores):
            newer = [s for s in store.steps() if s > version]
            for step in newer:
                store.path_for(step).unlink()
            if newer:
                log.warning("follower %d: dropped checkpoints %s newer than the leader's step %d", i, newer, version)

    def _launch(self, i: int, port: int) -> None:
        addr = self.addr_path(i)
        addr.unlink(missing_ok=True)
        argv = [
            "--plan", str(self.workdir / "plan.json"), "--index", str(i), "--port", str(port),
            "--host", self.host, "--checkpoint-dir", str(self.checkpoint_dir(i)), "--keep", str(self.keep),
            "--leader", f"{self.host}:{self.leader_port}", "--optimizer", self.optimizer_name,
            "--optimizer-kwargs", json.dumps(self.optimizer_kwargs), "--wire", self.wire, "--send", self.send,
            "--heartbeat-s", str(self.heartbeat_s), "--addr-file", str(addr), "--parent-pid", str(os.getpid()),
            "--max-pending", str(self.max_pending), "--torch-threads", str(self.torch_threads),
            *(["--compress", settings_json(self.compress) or ""] if self.compress is not None else []),
            *(["--compress-down", settings_json(self.compress_down) or "", "--wire-down", self.wire_down]
              if self.compress_down is not None else []),
            *(["--tls-ca", str(self.tls.ca), "--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
              if self.tls is not None else []),
            *(["--allow-plaintext-host", self.host]
              if self.tls is None and self.allow_plaintext_remote and not is_loopback(self.host) else []),
        ]
        ctx = process_context() if self.fork and self.python == sys.executable else None
        forked = ctx is not None and ctx.get_start_method() == "forkserver"
        with self.log_path(i).open("ab") as logf:
            logf.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} launching follower {i} on port {port}"
                       f"{' (forked)' if forked else ''}\n".encode())
        process: subprocess.Popen[bytes] | _ForkedProcess
        if forked:
            # the key in the pickled arguments (the fork server's pipe), not argv: `ps` shows every argument
            # daemon: a leader that exits without stop() ends its followers (multiprocessing sends
            # them SIGTERM at exit) instead of waiting for them, as it would for a non-daemon child
            child = ctx.Process(target=run_forked, args=(argv, str(self.log_path(i)), {KEY_ENV: self._key.hex()}),
                                name=f"follower-{i}", daemon=True)
            child.start()
            process = _ForkedProcess(child, argv)
        else:
            env = dict(os.environ)
            root = str(Path(__file__).resolve().parent.parent)  # fl_geo importable without installing
            env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            env[KEY_ENV] = self._key.hex()  # the environment, not argv: `ps` shows every argument
            cmd = [self.python, "-m", "fl_geo.ps.follower_main", *argv]
            with self.log_path(i).open("ab") as logf:
                process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
        self._procs[i] = _Proc(i, process, port, "", time.monotonic())

    def _await_start(self, i: int) -> None:
        """Wait for the addr file, then for ``health``; records port and incarnation."""
        proc = self._procs[i]
        addr, deadline = self.addr_path(i), time.monotonic() + self.start_timeout_s
        while not addr.exists():
            if proc.process.poll() is not None:
                raise RuntimeError(f"follower {i} exited with code {proc.process.returncode} during start; "
                                   f"log {self.log_path(i)}:\n{_log_tail(self.log_path(i))}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"follower {i} did not start within {self.start_timeout_s:g} s; "
                                   f"log {self.log_path(i)}:\n{_log_tail(self.log_path(i))}")
            time.sleep(0.02)
        proc.port = int(addr.read_text().strip().rsplit(":", 1)[1])
        with self.client(i, retry_s=max(1.0, deadline - time.monotonic())) as c:
            health = c.health()
        if health["index"] != i:
            raise RuntimeError(f"follower at {self.host}:{proc.port} says it is {health['index']}, expected {i}")
        proc.incarnation = health["incarnation"]
        proc.since = time.monotonic()
        log.info("follower %d up at %s:%d (version %d, pid %d)", i, self.host, proc.port,
                 health["version"], proc.process.pid)

    def check(self) -> list[int]:
        """Indices of dead followers: process exited, or no heartbeat from its current
        incarnation for ``miss × heartbeat_s`` (counted from its start)."""
        now, dead = time.monotonic(), []
        for i in range(self.num):
            proc = self._procs.get(i)
            if proc is None or proc.process.poll() is not None:
                dead.append(i)
                continue
            last = self.heartbeats.last_seen(i, proc.incarnation) or proc.since
            if now - max(last, proc.since) > self.miss * self.heartbeat_s:
                dead.append(i)
        return dead

    def ensure_alive(self) -> list[int]:
        """Restart every dead follower from its latest checkpoint, on its old port; returns the
        restarted indices once each answers ``health``."""
        dead = self.check()
        for i in dead:
            old = self._procs.get(i)
            port = old.port if old is not None else 0
            if old is not None:
                log.warning("follower %d (pid %d) is dead; restarting it from its checkpoint", i, old.process.pid)
                self._terminate(old.process, sig=signal.SIGKILL)
            self._launch(i, port)
        for i in dead:
            try:
                self._await_start(i)
            except RuntimeError:
                if self._procs[i].port == 0:
                    raise
                log.warning("follower %d could not rebind port %d; restarting it on a free port",
                            i, self._procs[i].port)
                self._terminate(self._procs[i].process, sig=signal.SIGKILL)
                self._launch(i, 0)
                self._await_start(i)
        return dead

    def kill(self, i: int) -> None:
        """SIGKILL follower ``i``'s process group (fault-injection tests)."""
        self._terminate(self._procs[i].process, sig=signal.SIGKILL)

    @staticmethod
    def _terminate(process: subprocess.Popen[bytes] | _ForkedProcess, sig: int = signal.SIGTERM,
                   wait_s: float = 5.0) -> None:
        """Signal the process group, escalate to SIGKILL after ``wait_s``, reap."""
        if process.poll() is None:
            _signal_group(process.pid, sig)
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()

    def stop(self) -> None:
        """Stop every follower (SIGTERM, then SIGKILL), remove the addr files, stop the
        heartbeat server if the supervisor started it."""
        for proc in self._procs.values():
            self._terminate(proc.process)
        for i in range(self.num):
            self.addr_path(i).unlink(missing_ok=True)
        self._procs.clear()
        if self._own_heartbeats:
            self.heartbeats.stop()

    def __enter__(self) -> FollowerSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- throughput -----------------------------------------------------------------------------------

def _proc_status_mib(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    return float("nan")


def _reset_peak_rss(pid: int) -> bool:
    """Reset a process's VmHWM to its current RSS (Linux ≥ 4.0, ``clear_refs`` value 5), so the
    peak of the transfers can be told from the peak of loading the checkpoint."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def data_path_throughput(payload_mib: int, wire: str = "bf16", workdir: str | Path | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES, seed: int = 0) -> dict[str, Any]:
    """Push and pull one ``payload_mib`` MiB shard (in ``wire``) between this process and one
    follower process over loopback; verifies both transfers bit for bit.

    The push is checked through the follower's per-tensor sums of squares (``norms``), which
    must equal `tensor_sq_sums` of the pushed tensor exactly; the pull must equal the initial
    θ written to the follower's checkpoint, converted to the wire dtype. MB is 10⁶ bytes.

    ``follower_peak_rss_mib`` is the follower's lifetime VmHWM, which its start-up (reading and
    verifying the checkpoint: several times the shard's fp32 bytes) dominates;
    ``follower_transfer_peak_rss_mib`` is the peak during push and pull alone (NaN where the
    kernel cannot reset the peak)."""
    dtype = WIRE_DTYPES[wire]
    numel = (payload_mib << 20) // dtype.itemsize
    if numel < 1:
        raise ValueError(f"payload of {payload_mib} MiB holds no {wire} element")
    spec = ParamSpec(names=("blocks.0.w",), shapes=((numel,),), dtypes=("float32",))
    plan = ShardPlan.build(spec, 1)
    gen = torch.Generator().manual_seed(seed)
    initial = torch.empty(numel, dtype=torch.float32).normal_(generator=gen)
    update = torch.empty(numel, dtype=dtype).normal_(generator=gen)
    with tempfile.TemporaryDirectory(prefix="flgeo-dp-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        with FollowerSupervisor(plan, 1, root, optimizer_name="avg", wire=wire,
                                torch_threads=torch.get_num_threads(), fork=False) as sup:  # its own RSS
            sup.start(initial)
            pid = sup.pid(0)
            rss_start = _proc_status_mib(pid, "VmRSS")
            peak_load = _proc_status_mib(pid, "VmHWM")  # the checkpoint load dominates this one
            reset = _reset_peak_rss(pid)
            token = sup.auth.mint_job("throughput", [0], 0, ttl_s=3600.0)
            with sup.client(0) as client:
                t0 = time.perf_counter()
                client.push("throughput", 0, update, chunk_bytes=chunk_bytes, token=token)
                push_s = time.perf_counter() - t0
                got = client.control("norms", job="throughput")["sq_sums"]
                want = tensor_sq_sums(update, plan.tensor_ranges(0))
                if got != want:
                    raise AssertionError(f"pushed data differ: follower norms {got}, local {want}")
                client.control("drop", job="throughput")
                t0 = time.perf_counter()
                version, pulled = client.pull(0, numel, chunk_bytes=chunk_bytes)
                pull_s = time.perf_counter() - t0
            expected = initial.to(dtype)
            if version != 0 or not torch.equal(pulled.view(BIT_VIEWS[dtype][0]), expected.view(BIT_VIEWS[dtype][0])):
                raise AssertionError("pulled parameters differ from the initial ones")
            peak_transfer = _proc_status_mib(pid, "VmHWM") if reset else float("nan")
            peak = max(peak_load, _proc_status_mib(pid, "VmHWM"))
            rss_end = _proc_status_mib(pid, "VmRSS")
    nbytes = numel * dtype.itemsize
    return {
        "payload_bytes": nbytes,
        "push_s": push_s,
        "pull_s": pull_s,
        "push_mb_s": nbytes / push_s / 1e6,
        "pull_mb_s": nbytes / pull_s / 1e6,
        "follower_peak_rss_mib": peak,
        "follower_transfer_peak_rss_mib": peak_transfer,
        "follower_rss_start_mib": rss_start,
        "follower_rss_end_mib": rss_end,
    }

