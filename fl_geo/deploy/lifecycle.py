"""Bringing a topology up, down, and asking its state (``fl-geo deploy up | down | status``).

:func:`up` starts the SuperLink, waits for it to be healthy, registers the SuperNodes' public keys
when authentication is on, starts the SuperNodes and waits until they are online; :func:`down`
stops exactly the recorded processes and their children (TERM, then KILL after a grace period);
:func:`status` reports both. ``examples/deploy/*.sh`` are the per-host wrappers for real sites.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_geo.deploy import warm_apps
from fl_geo.deploy.certificates import ensure_certs
from fl_geo.deploy.flower_config import write_flwr_config
from fl_geo.deploy.processes import (
    ProcRecord,
    _alive,
    _descendants,
    _port_free,
    _reap,
    _signal,
    _tail,
    flower_exe,
    health_ok,
    list_nodes,
    load_records,
    register_node,
    site_node_command,
    start_process,
    superlink_command,
    supernode_command,
)
from fl_geo.deploy.topology import DEFAULT_GRACE_S, DeployError, Topology

__all__ = ["DownResult", "UpResult", "down", "status", "up"]

APP_SERVER = "app-server"  # the role of the warm app server's record (fl_geo/deploy/warm_apps.py)
# How long up waits for the app server to bind its socket before it starts the SuperLink through
# its shim (the interpreter takes ~0.1 s to get there; after this the SuperLink starts cold).
APP_SERVER_BIND_S = 10.0
KILL_EXIT_S = 10.0  # how long a SIGKILLed process may take to exit before down calls it a survivor


@dataclass
class UpResult:
    """What :func:`up` started and how long each phase took (the numbers in docs/deploy.md)."""

    records: list[ProcRecord]
    healthy_s: float
    nodes_online_s: float
    node_ids: dict[str, int] = field(default_factory=dict)


def _fail_if_exited(procs: Sequence[tuple[subprocess.Popen[bytes], ProcRecord]]) -> None:
    for proc, rec in procs:
        code = proc.poll()
        if code is not None:
            raise DeployError(f"{rec.role} {rec.name} exited with code {code} while starting; "
                              f"see {rec.log}:\n{_tail(rec.log)}")


# What a SuperNode logs once the SuperLink has accepted it (Flower 1.41 and 1.42).
NODE_ACTIVATED = "SuperNode ID:"
NODE_LIST_EVERY_S = 3.0


def _logged_since_start(log: str | Path, needle: str) -> bool:
    """Has the process logged ``needle`` since its last start (``start_process`` appends a
    ``==== <time> <command>`` header to the log at every start)?"""
    try:
        text = Path(log).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return needle in text[max(0, text.rfind("\n==== ")):]


def _forked(topo: Topology, cmd: list[str], command: str) -> list[str]:
    """``cmd`` through the app server's shim for ``command`` when it runs Flower's own ``command``
    (a wrapper around it, as a test's, stays what it is): the SuperLink or SuperNode is then forked
    with Flower's modules imported (~2.3 CPU-s less each on a 2-core machine) instead of starting
    an interpreter that imports them. When the server is not there, the shim runs it cold."""
    shim = topo.app_shims_dir / command
    if cmd and cmd[0] == flower_exe(command) and shim.is_file():
        return [str(shim), *cmd[1:]]
    return cmd


def up(topo: Topology, timeout_s: float = 120.0, echo: bool = False, *, app_socket: str | None = None,
       own_app_server: bool = True, fork_daemons: bool = True) -> UpResult:
    """Start the SuperLink, then every SuperNode, and wait until all nodes are online.

    On any failure the processes started so far are stopped again (the error names the log
    file to read), so a failed ``up`` never leaves a half-started federation behind.

    With ``warm_apps`` on, the topology's app processes are forked by an app server
    (`fl_geo.deploy.warm_apps`) listening on ``app_socket`` (None: a fresh name). ``own_app_server``
    False: another topology on this host started that server and stops it (the tiers of a HALoS
    deployment share the global tier's: one import of torch and Flower instead of one per tier);
    this one only points its shims at it, and until it answers they start Flower's commands cold.
    The SuperLink and SuperNodes are forked by that server too, unless ``fork_daemons`` is False
    (a measurement that needs their own processes' memory: `fl_geo.bench.flower_path`).
    """
    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    records = load_records(topo)
    if records:
        live = [r for r in records if r.alive()]
        if live and len(live) == len(records):
            raise DeployError(f"{topo.name} is already up ({len(live)} processes in {topo.pids_path}); "
                              f"run `fl-geo deploy down {topo.source}` first")
        if live:
            raise DeployError(f"{topo.name} is partly up ({len(live)} of {len(records)} recorded processes alive); "
                              f"run `fl-geo deploy down {topo.source}` first")
        topo.pids_path.unlink()  # stale: every recorded process is gone
    busy = [f"{topo.bind}:{topo.port} (superlink)"] if not _port_free(topo.bind, topo.port) else []
    busy += [f"127.0.0.1:{n.port} ({n.name})" for n in topo.nodes if not _port_free("127.0.0.1", n.port)]
    if busy:
        raise DeployError(f"port(s) already in use: {', '.join(busy)}; pick free ports in {topo.source}")
    if topo.security.tls:
        ensure_certs(topo)
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    write_flwr_config(topo)

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    started: list[tuple[subprocess.Popen[bytes], ProcRecord]] = []
    try:
        if topo.warm_apps:
            # Before the SuperLink, so its first ServerApp is already forked warm: the server binds
            # its socket at once and imports while the SuperLink starts (shims wait in its backlog).
            socket_name = app_socket or warm_apps.new_socket_name()
            warm_apps.write_shims(topo.app_shims_dir, socket_name)
            if own_app_server:
                started.append(start_process(topo, APP_SERVER, topo.name, warm_apps.server_command(socket_name)))
                say(f"app server (pid {started[-1][1].pid}), log {started[-1][1].log}")
            if fork_daemons:  # a shim that finds no socket runs cold: let the server bind first
                bound_by = time.monotonic() + APP_SERVER_BIND_S
                while not warm_apps.listening(socket_name) and time.monotonic() < bound_by:
                    _fail_if_exited(started)
                    time.sleep(0.02)
        forked = topo.warm_apps and fork_daemons
        link_cmd = superlink_command(topo)
        link = start_process(topo, "superlink", topo.name,
                             _forked(topo, link_cmd, "flower-superlink") if forked else link_cmd)
        started.append(link)
        say(f"superlink {topo.address} (pid {link[1].pid}), log {link[1].log}")
        while not health_ok(topo):
            _fail_if_exited(started)
            if time.monotonic() > deadline:
                raise DeployError(f"SuperLink at {topo.address} not healthy after {timeout_s:.0f} s; "
                                  f"see {link[1].log}:\n{_tail(link[1].log)}")
            time.sleep(0.2)
        healthy_s = time.monotonic() - t0
        say(f"superlink healthy after {healthy_s:.1f} s")

        node_ids: dict[str, int] = {}
        if topo.security.auth:
            for node in topo.nodes:
                node_ids[node.name] = register_node(topo, topo.certs.node_public_key(node.name), node.name)
            say(f"registered {len(node_ids)} SuperNode public keys")
        for node in topo.nodes:
            node_cmd = supernode_command(topo, node)
            started.append(start_process(topo, "supernode", node.name,
                                         _forked(topo, node_cmd, "flower-supernode") if forked else node_cmd))
            say(f"supernode {node.name} port {node.port} node_config {node.node_config_arg()}, log {started[-1][1].log}")

        want = len(topo.nodes)
        online: list[dict[str, Any]] = []
        asked = time.monotonic()
        while True:
            _fail_if_exited(started)
            # Asking the SuperLink is a `flwr supernode ls` process (~1.5 s of CPU, competing with
            # the SuperNodes starting): ask once every node has logged its activation, and
            # otherwise every NODE_LIST_EVERY_S in case a Flower version words its log differently.
            activated = all(_logged_since_start(r.log, NODE_ACTIVATED) for _, r in started if r.role == "supernode")
            if activated or time.monotonic() - asked >= NODE_LIST_EVERY_S:
                online = [n for n in list_nodes(topo) if n.get("status") == "online"]
                asked = time.monotonic()
                if len(online) >= want:
                    break
            if time.monotonic() > deadline:
                logs = ", ".join(r.log for _, r in started if r.role == "supernode")
                raise DeployError(f"only {len(online)} of {want} SuperNodes online after {timeout_s:.0f} s; "
                                  f"see the node logs: {logs}")
            time.sleep(0.1 if not activated else 0.5)
        nodes_s = time.monotonic() - t0
        say(f"{want} SuperNodes online after {nodes_s:.1f} s")
        for node in topo.nodes:  # a site's other nodes: their agents wait for node 0's first job
            for site_node in node.site_nodes:
                started.append(start_process(topo, "site-node", f"{node.name}-{site_node.node_rank}",
                                             site_node_command(node, site_node)))
                say(f"site node {site_node.node_rank} of {node.name} ({site_node.devices}), log {started[-1][1].log}")
        _fail_if_exited(started)
        return UpResult(records=[r for _, r in started], healthy_s=healthy_s, nodes_online_s=nodes_s,
                        node_ids=node_ids)
    except BaseException:
        down(topo)
        raise


@dataclass
class DownResult:
    """Which recorded processes (and their descendants) were signalled, and which needed SIGKILL."""

    signalled: list[int]
    killed: list[int]
    survivors: list[int]


def down(topo: Topology, grace_s: float = DEFAULT_GRACE_S) -> DownResult:
    """Stop every recorded process: SIGTERM to its group and descendants, SIGKILL after ``grace_s``.

    SuperNodes go first so they can deregister while the SuperLink still answers, and the app
    server last: the app processes it forked stop with their shims (SuperExec children), and the
    server's process group holds whatever is left. Safe to call twice: without ``pids.json`` it
    does nothing.
    """
    records = load_records(topo)
    if not records:
        topo.pids_path.unlink(missing_ok=True)
        return DownResult([], [], [])
    signalled: list[int] = []
    killed: list[int] = []

    def stop(batch: list[ProcRecord]) -> None:
        mine = [r for r in batch if r.alive()]
        pids = {r.pid for r in mine} | _descendants(r.pid for r in mine)
        for r in mine:
            _signal(r.pgid, signal.SIGTERM, group=True)
        for pid in pids:
            _signal(pid, signal.SIGTERM, group=False)
        signalled.extend(sorted(pids))
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(_alive(p) for p in pids):
            pids |= _descendants(p for p in pids if _alive(p))  # processes spawned while stopping
            time.sleep(0.1)
        for pid in sorted(p for p in pids if _alive(p)):
            _signal(pid, signal.SIGKILL, group=False)
            killed.append(pid)
        for r in mine:
            _signal(r.pgid, signal.SIGKILL, group=True)  # anything left in the group
        # A killed process still has to exit: unmapping a few GiB of a torch process runs at that
        # process's priority and took over 50 ms on a loaded 2-core machine, which down once
        # reported as a survivor. Only what outlives KILL_EXIT_S is one.
        end = time.monotonic() + KILL_EXIT_S
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        for pid in pids:
            _reap(pid)

    stop([r for r in records if r.role not in ("superlink", APP_SERVER)])
    stop([r for r in records if r.role == "superlink"])
    stop([r for r in records if r.role == APP_SERVER])
    survivors = sorted(p for p in signalled if _alive(p))
    if not survivors:
        topo.pids_path.unlink(missing_ok=True)
    return DownResult(signalled=signalled, killed=killed, survivors=survivors)


def status(topo: Topology) -> dict[str, Any]:
    """Recorded processes with their liveness, SuperLink health and the node table."""
    records = load_records(topo)
    procs = [{"role": r.role, "name": r.name, "pid": r.pid, "alive": r.alive(), "log": r.log} for r in records]
    superlink_up = any(p["alive"] for p in procs if p["role"] == "superlink")
    healthy = health_ok(topo) if superlink_up else False
    return {"topology": topo.source, "address": topo.address, "tls": topo.security.tls, "auth": topo.security.auth,
            "processes": procs, "healthy": healthy, "nodes": list_nodes(topo) if healthy else []}
