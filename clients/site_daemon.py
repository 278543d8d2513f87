"""The site-group daemon: a node's persistent inner-training ranks behind a Unix socket.

Under a SuperNode every message runs in a fresh ClientApp process, so ranks that outlive a round
must belong to a process that outlives the ClientApp. This is that process, one per node
(``python -m fl_geo.clients.site_daemon``, started by the first coordinator that finds none,
`fl_geo.clients.site_group`). It owns:

- the socket at the node's ``site-group`` address, answering one request per connection in
  fl-geo's framed IPC format (`fl_geo.halos.ipc`): ``hello`` (who it is: identity, pid, rank
  pids, the directory of the shared state files), ``train`` (a pickled job, forwarded unread to
  every rank; the reply says done, or why not) and ``stop``;
- a directory on ``/dev/shm`` where the coordinator and the ranks map the model and AdamW state
  (`SharedTrainState.map_files`): nothing model-sized crosses the socket;
- the ranks (`fl_geo.inner.site_rank`), started lazily for the first job and kept until a job
  fails, a rank dies, the daemon is stopped or it has been idle for ``idle_s``.

A job that fails (a rank raised or died, or the job ran past its deadline) ends every rank of
the group and is answered with an error naming the rank and the cause; the next job starts a
new group.

A site of several nodes (``--nodes N --rendezvous host:port``): the daemon runs on node 0 and
hosts the site's TCP store (`fl_geo.inner.site_store`) for its whole life; its own ranks are
global ranks ``0 … local − 1``; every other node runs an agent (`fl_geo.clients.site_node`) that
starts that node's ranks for each generation the daemon announces. A job goes to them through
the store, their answers come back through it, and a node whose agent has no fresh heartbeat
fails the job at once (instead of a collective waiting for it until its timeout).

The daemon itself never trains and never unpickles a job, so a user's code cannot break it. Its identity (run, model, devices, ...) is fixed at start: a coordinator that needs
another one stops it and starts a new daemon. On one node it never imports torch: it starts its
ranks through `fl_geo.inner.site_setup` from a fork server that imported torch once
(`fl_geo.fork_server`); on several nodes it does, for the site's TCP store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from fl_geo.halos.ipc import IpcError, recv_frame, send_frame, unix_path

__all__ = ["main", "serve"]

REQUEST_TIMEOUT_S = 30.0  # a request frame must arrive within this
_GRACE_S = 1.0  # a failed group's survivors: this long to exit, then SIGTERM, then SIGKILL
_NODE_WAIT_S = 60.0  # several nodes: a job waits this long for the other nodes' agents to be live
_REMOTE_POLL_S = 0.02  # several nodes: the store is polled for the other nodes' answers this often


class JobFailed(RuntimeError):
    """A job did not complete; the message names the rank and the cause."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class _Group:
    """The ranks of one generation of the site's process group, started on demand."""

    def __init__(self, setup: dict[str, Any], state_dir: str) -> None:
        self.setup = setup
        self.state_dir = state_dir
        self.generation = 0
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.memory: list[dict[str, Any]] = []  # each rank's peak memory after the last job
        # Several nodes: the site's store, served from here for the daemon's life (imports torch).
        self.nodes = int(setup.get("nodes", 1))
        self.local = len(setup["devices"])
        self.store: Any = None
        self.token = secrets.token_hex(4)  # generation ids unique to this daemon
        self.gen_id = ""
        self.job_index = 0  # jobs sent in this generation (the store's job keys)
        self.beats: dict[int, tuple[str, float]] = {}  # node -> (its heartbeat counter, when it last moved)
        if self.nodes > 1:
            from fl_geo.inner.site_store import host_store

            self.store = host_store(str(setup["rendezvous"]), float(setup["timeout_s"]))
            self.store.set("generation", "")

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def _start(self) -> None:
        # no torch here: the ranks come from a fork server that imported it (fl_geo.fork_server)
        from fl_geo.fork_server import process_context
        from fl_geo.inner.site_setup import GroupSetup, rank_entry

        self.generation += 1
        store = os.path.join(self.state_dir, f"store-{self.generation}")
        self.job_index = 0
        several = self.store is not None
        if several:
            self.gen_id = f"{self.token}-{self.generation}"
            self.store.set(f"{self.gen_id}/setup", json.dumps({
                "world": self.nodes * self.local, "local": self.local, "nodes": self.nodes,
                "backend": self.setup["backend"], "timeout_s": float(self.setup["timeout_s"]),
                "threads": int(self.setup["threads"])}))
            self.store.set("generation", self.gen_id)  # the other nodes' agents start their ranks
        setup = GroupSetup(devices=tuple(self.setup["devices"]), backend=self.setup["backend"],
                           store_path="" if several else store, timeout_s=float(self.setup["timeout_s"]),
                           threads=int(self.setup["threads"]), world=self.nodes * self.local,
                           rendezvous=str(self.setup.get("rendezvous", "")) if several else "",
                           generation=self.gen_id, owner_pid=os.getpid())
        ctx = process_context()  # a fork server: torch imported once per node, not per rank
        for rank in range(len(setup.devices)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_entry, args=(rank, setup, child), name=f"fl-geo-site-rank-{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def stop(self, graceful: bool = True) -> None:
        """End every rank: ask (graceful), wait briefly, then SIGTERM and SIGKILL; reap them all.
        On several nodes the generation is withdrawn first: the other nodes' agents end their ranks."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # a store that failed cannot be told; agents see it
                self.store.set("generation", "")
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"")
        deadline = time.monotonic() + (5.0 if graceful else _GRACE_S)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        for name in os.listdir(self.state_dir):  # the FileStore of the ended generation
            if name.startswith("store-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.state_dir, name))
        self.procs, self.conns = [], []

    def run(self, job: bytes, timeout_s: float | None) -> None:
        """Hand ``job`` to every rank and wait for all of them; `JobFailed` ends the group."""
        if not self.alive():
            self.stop(graceful=False)  # a rank that died between jobs: a whole new group
            self._start()
        try:
            if self.store is not None:
                self._check_nodes(wait_s=_NODE_WAIT_S)
                self.store.set(f"{self.gen_id}/job/{self.job_index}", job)
            for conn in self.conns:
                conn.send_bytes(job)
            self._wait(timeout_s)
            if self.store is not None:
                self._forget_job()
        except JobFailed:
            self.stop(graceful=False)
            raise
        except OSError as exc:  # a pipe to a rank that is already gone
            self.stop(graceful=False)
            raise JobFailed(f"the site group lost a rank before the job started ({exc})") from None

    def _wait(self, timeout_s: float | None) -> None:
        world = len(self.procs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = set(range(world))
        remote = set(range(world, self.nodes * self.local)) if self.store is not None else set()
        memory: list[dict[str, Any]] = [{} for _ in range(world)]
        by_conn = {id(c): r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending or remote:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remote:  # the other nodes answer through the store: poll it between waits
                left = _REMOTE_POLL_S if left is None else min(left, _REMOTE_POLL_S)
                self._collect_remote(remote)
            if pending:
                ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], left)
            else:
                ready = []
                time.sleep(left or 0.0)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise JobFailed(f"the site group ({self.nodes * self.local} ranks) did not finish the job "
                                f"within {timeout_s:g} s")
            for obj in ready:
                rank = by_sentinel.get(obj) if isinstance(obj, int) else by_conn.get(id(obj))
                if rank is None or rank not in pending:
                    continue
                answer = self._answer(rank)
                if answer is None or "error" in answer:  # a rank failed or ended: the job is lost
                    raise JobFailed(self._account(rank, answer))
                pending.discard(rank)
                memory[rank] = {k: v for k, v in answer.items() if k.startswith("peak_")}
        self.memory = memory

    def _collect_remote(self, remote: set[int]) -> None:
        """Take the other nodes' answers to the current job from the store (``remote``: the
        global ranks still owed); `JobFailed` for a rank's error or a node that went silent."""
        for rank in sorted(remote):
            key = f"{self.gen_id}/answer/{self.job_index}/{rank}"
            if not self.store.check([key]):
                continue
            answer = json.loads(self.store.get(key))
            if not isinstance(answer, dict) or "error" in answer:
                text = answer.get("error") if isinstance(answer, dict) else answer
                raise JobFailed(f"rank {rank} (node {rank // self.local}) of the site group failed:\n{text}")
            remote.discard(rank)
        if remote:
            self._check_nodes(wait_s=0.0, nodes={rank // self.local for rank in remote})

    def _check_nodes(self, wait_s: float, nodes: set[int] | None = None) -> None:
        """`JobFailed` unless every other node's agent (or those in ``nodes``) has a fresh heartbeat
        and no error for this generation; waits up to ``wait_s`` for agents that are starting."""
        from fl_geo.inner.site_store import STALE_S, get_text

        deadline = time.monotonic() + wait_s
        while True:
            problems = []
            for node in sorted(nodes if nodes is not None else range(1, self.nodes)):
                error = self._node_error(node)
                if error is not None:
                    raise JobFailed(f"node {node} of the site: {error}")
                beat = get_text(self.store, f"node/{node}/heartbeat")
                now = time.monotonic()
                if beat and self.beats.get(node, ("", 0.0))[0] != beat:
                    self.beats[node] = (beat, now)  # the counter moved: seen alive now (our clock)
                age = now - self.beats[node][1] if node in self.beats else None
                if age is None or age > STALE_S:
                    problems.append(f"node {node} (" + ("never joined" if age is None else f"silent for {age:.0f} s") + ")")
            if not problems:
                return
            if time.monotonic() >= deadline:
                raise JobFailed(f"the site's nodes {', '.join(problems)} have no live agent at "
                                f"{self.setup.get('rendezvous')}: run `fl-geo site-node "
                                f"--rendezvous {self.setup.get('rendezvous')} --node-rank K --devices ...` on each")
            time.sleep(0.2)

    def _forget_job(self) -> None:
        """Drop the finished job's keys from the store (a long run would otherwise keep them all)."""
        keys = [f"{self.gen_id}/job/{self.job_index}"]
        keys += [f"{self.gen_id}/answer/{self.job_index}/{r}" for r in range(self.local, self.nodes * self.local)]
        for key in keys:
            with contextlib.suppress(Exception):
                self.store.delete_key(key)
        self.job_index += 1

    def _account(self, first: int, answer: dict[str, Any] | None) -> str:
        """Why the job failed. The first rank to report is often a survivor whose collective broke
        when a peer died, so give the others ``_GRACE_S`` to end too, then name the ranks that
        died (the cause) before the errors the others raised."""
        errors = {first: answer["error"]} if answer is not None else {}
        settle = time.monotonic() + _GRACE_S
        while time.monotonic() < settle and any(p.is_alive() for p in self.procs):
            wait([p.sentinel for p in self.procs if p.is_alive()], max(0.0, settle - time.monotonic()))
        for rank in range(len(self.procs)):
            late = self._answer(rank) if rank not in errors else None
            if late is not None and "error" in late:
                errors[rank] = late["error"]
        died = [r for r, p in enumerate(self.procs) if r not in errors and p.exitcode not in (None, 0)]
        died += [first] if answer is None and first not in died else []
        lines = self._remote_deaths()  # another node's rank that died is the cause: name it first
        lines += [f"rank {r} of the site group died during the job: it {_describe_exit(self.procs[r].exitcode)}"
                  for r in died]
        lines += [f"rank {r} of the site group failed:\n{text}" for r, text in sorted(errors.items())]
        return "\n".join(lines)

    def _remote_deaths(self) -> list[str]:
        """Several nodes: what the other nodes' agents reported for this generation (a rank of theirs
        that died), after giving them one heartbeat to notice; empty on one node."""
        if self.store is None:
            return []
        from fl_geo.inner.site_store import HEARTBEAT_S

        deadline = time.monotonic() + 2 * HEARTBEAT_S
        while True:
            reports = [f"node {node}: {error}" for node in range(1, self.nodes)
                       if (error := self._node_error(node)) is not None]
            if reports or time.monotonic() >= deadline:
                return reports
            time.sleep(0.1)

    def _node_error(self, node: int) -> str | None:
        """What node ``node``'s agent reported for the current generation (``node/<k>/error``), if anything."""
        from fl_geo.inner.site_store import get_text

        error = get_text(self.store, f"node/{node}/error")
        return error.split(":", 1)[1].strip() if error.startswith(f"{self.gen_id}:") else None

    def _answer(self, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s answer if one is waiting in its pipe, else None (also at end of file)."""
        conn = self.conns[rank]
        try:
            if conn.poll():
                answer = json.loads(conn.recv_bytes())
                return answer if isinstance(answer, dict) else None
        except (EOFError, OSError, ValueError):
            pass
        return None


class _Daemon:
    """The socket loop around one `_Group`."""

    def __init__(self, address: str, identity: dict[str, Any], setup: dict[str, Any], idle_s: float) -> None:
        self.path = unix_path(address)
        self.identity = identity
        self.idle_s = idle_s
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.state_dir = tempfile.mkdtemp(prefix="fl-geo-site-", dir=root)
        self.group = _Group(setup, self.state_dir)
        self.jobs = 0
        self.stopping = False

    def info(self) -> dict[str, Any]:
        return {"op": "result", "identity": self.identity, "pid": os.getpid(), "ranks": self.group.pids(),
                "nodes": self.group.nodes,
                "generation": self.group.generation, "jobs": self.jobs, "state_dir": self.state_dir,
                "memory": self.group.memory}

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        header, record = recv_frame(conn, timeout_s=REQUEST_TIMEOUT_S)
        op = header.get("op")
        if op == "hello":
            reply = self.info()
        elif op == "stop":
            self.stopping = True
            reply = self.info()
        elif op == "train":
            if record is None or "job" not in record:
                raise IpcError("a train request carries its job as the array 'job'")
            timeout = header.get("join_timeout_s")
            try:
                self.group.run(bytes(record["job"].data), None if timeout is None else float(timeout))
                self.jobs += 1
                reply = self.info()
            except JobFailed as exc:
                reply = {"op": "error", "error": str(exc), "ranks": self.group.pids()}
        else:
            reply = {"op": "error", "error": f"unknown site-group request {op!r}"}
        conn.settimeout(REQUEST_TIMEOUT_S)
        send_frame(conn, reply)

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # the coordinator found nobody answering there before starting us
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(8)
        pid_file = self.path + ".pid"
        with open(pid_file, "w") as fh:
            fh.write(str(os.getpid()))
        last = time.monotonic()
        try:
            while not self.stopping:
                listener.settimeout(min(5.0, self.idle_s))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    if time.monotonic() - last > self.idle_s:
                        print(f"site group idle for {self.idle_s:g} s: exiting", flush=True)
                        break
                    if self.group.procs and not self.group.alive():  # a rank died between jobs
                        self.group.stop(graceful=False)
                    continue
                with conn:
                    try:
                        self.handle(conn)
                    except (IpcError, OSError, ValueError) as exc:
                        print(f"site group: request dropped ({exc})", flush=True)
                last = time.monotonic()
        finally:
            self.group.stop()
            listener.close()
            self._remove_own(self.path, pid_file)
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _remove_own(self, path: str, pid_file: str) -> None:
        """Remove the socket and pid file unless a newer daemon has taken the address over."""
        try:
            with open(pid_file) as fh:
                ours = fh.read().strip() == str(os.getpid())
        except OSError:
            ours = False
        if ours:
            for name in (path, pid_file):
                with contextlib.suppress(OSError):
                    os.unlink(name)


def serve(address: str, identity: dict[str, Any], setup: dict[str, Any], idle_s: float) -> None:
    """Run the daemon at ``address`` until stopped, idle for ``idle_s`` or sent SIGTERM/SIGINT."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    _Daemon(address, identity, setup, idle_s).serve()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_geo.clients.site_daemon",
                                     description="a node's persistent inner-training group (fl_geo.clients.site_group)")
    parser.add_argument("--address", required=True, help="unix:///abs/path.sock")
    parser.add_argument("--identity", required=True, help="JSON: what this group was started for")
    parser.add_argument("--devices", required=True, help="comma-separated rank devices")
    parser.add_argument("--backend", required=True, choices=("gloo", "nccl"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout per collective")
    parser.add_argument("--idle-s", type=float, default=1800.0, help="exit after this long without a request")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the site (this one is node 0)")
    parser.add_argument("--rendezvous", default="", help="several nodes: host:port of the site's store, served here")
    args = parser.parse_args(argv)
    if args.nodes < 1 or (args.nodes > 1 and not args.rendezvous):
        parser.error("--nodes must be >= 1, and a site of several nodes needs --rendezvous host:port")
    setup = {"devices": args.devices.split(","), "backend": args.backend, "threads": args.threads,
             "timeout_s": args.timeout_s, "nodes": args.nodes, "rendezvous": args.rendezvous}
    serve(args.address, json.loads(args.identity), setup, args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
