"""The SuperLink and SuperNode processes of a topology, and the ``flwr`` CLI calls about them.

Processes are started in their own process groups and recorded (pid, process group, start time)
in ``<state_dir>/pids.json``, so that ``down`` (or a test fixture) stops exactly what ``up``
started, including the ``flower-superexec`` and app processes they spawn, and never a process
that merely reused a recorded pid. Flower must run in this interpreter's environment with its
runtime dependency installation off (`NO_DEPS_ENV`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_geo.deploy.topology import NO_DEPS_ENV, DeployError, NodeSpec, SiteNodeSpec, Topology
from fl_geo.fork_server import pid_exists

log = logging.getLogger("fl_geo")

__all__ = [
    "ProcRecord",
    "flower_env",
    "flower_exe",
    "flwr_cli",
    "free_ports",
    "health_ok",
    "start_process",
    "list_nodes",
    "load_records",
    "register_node",
    "site_node_command",
    "superlink_command",
    "supernode_command",
]


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@dataclass
class ProcRecord:
    """One process started by :func:`up`; ``start_ticks`` guards against pid reuse."""

    role: str  # superlink | supernode
    name: str
    pid: int
    pgid: int
    start_ticks: int | None
    log: str
    cmd: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return _alive(self.pid, self.start_ticks)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], start time [19])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None


def _reap(pid: int) -> None:
    """Collect a child we started ourselves (a test calling :func:`up` in-process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int, start_ticks: int | None = None) -> bool:
    """Is ``pid`` running (not a zombie) and still the process that was recorded?"""
    _reap(pid)
    if Path("/proc").is_dir() and Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        if stat is None or stat[0] == "Z":
            return False
        return start_ticks is None or int(stat[19]) == start_ticks
    return pid_exists(pid)


def _descendants(pids: Iterable[int]) -> set[int]:
    """All live descendants of ``pids`` (Linux /proc scan; empty elsewhere).

    Flower starts ``flower-superexec`` and the app processes in new sessions in places, so killing
    a process group alone can leave them behind (and a superexec whose parent is a zombie never
    notices it is gone).
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _proc_stat(int(entry.name))
        if stat and stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def load_records(topo: Topology) -> list[ProcRecord]:
    if not topo.pids_path.is_file():
        return []
    try:
        raw = json.loads(topo.pids_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DeployError(f"{topo.pids_path}: corrupt ({exc}); stop the processes by hand and delete it") from None
    return [ProcRecord(**r) for r in raw.get("processes", [])]


def _save_records(topo: Topology, records: list[ProcRecord]) -> None:
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = topo.pids_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"topology": topo.source, "processes": [r.__dict__ for r in records]}, indent=2),
                   encoding="utf-8")
    tmp.replace(topo.pids_path)


def flower_env(topo: Topology) -> dict[str, str]:
    """Environment for every Flower process and CLI call of this topology.

    PATH starts with this interpreter's bin folder: the SuperLink and SuperNode spawn
    ``flower-superexec`` by name and must find the one of this venv. With ``warm_apps`` the app
    shims' folder comes first, so the SuperExecs start ``flwr-clientapp`` / ``flwr-serverapp``
    through the app server (`fl_geo.deploy.warm_apps`).
    """
    env = dict(os.environ)
    env.update(NO_DEPS_ENV)
    env["FLWR_HOME"] = str(topo.flwr_home)
    first = [str(topo.app_shims_dir)] if topo.warm_apps else []
    env["PATH"] = os.pathsep.join([*first, str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def flower_exe(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if exe.is_file():
        return str(exe)
    found = shutil.which(name)
    if not found:
        raise DeployError(f"{name} not found next to {sys.executable} or on PATH (is flwr installed in this venv?)")
    return found


def superlink_command(topo: Topology) -> list[str]:
    cmd = [flower_exe("flower-superlink"), "--host", topo.bind, "--port", str(topo.port),
           "--disable-runtime-dependency-installation"]
    if topo.security.tls:
        c = topo.certs
        cmd += ["--ssl-certfile", str(c.server_cert), "--ssl-keyfile", str(c.server_key),
                "--ssl-ca-certfile", str(c.ca_cert)]
    else:
        cmd.append("--insecure")
    if topo.security.auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def supernode_command(topo: Topology, node: NodeSpec, private_key: Path | None = None) -> list[str]:
    """The ``flower-supernode`` command of one node (``private_key`` overrides its own key)."""
    cmd = [flower_exe("flower-supernode"), "--superlink", topo.address, "--port", str(node.port),
           "--node-config", node.node_config_arg()]
    if topo.security.tls:
        cmd += ["--root-certificates", str(topo.certs.ca_cert)]
    else:
        cmd.append("--insecure")
    if topo.security.auth:
        cmd += ["--auth-supernode-private-key", str(private_key or topo.certs.node_private_key(node.name))]
    return cmd


def site_node_command(node: NodeSpec, site_node: SiteNodeSpec) -> list[str]:
    """The ``fl-geo site-node`` agent of node ``site_node.node_rank`` of ``node``'s site."""
    return [sys.executable, "-m", "fl_geo.clients.site_node", "--rendezvous", str(node.node_config["site-rendezvous"]),
            "--node-rank", str(site_node.node_rank), "--devices", site_node.devices]


def start_process(topo: Topology, role: str, name: str, cmd: list[str]) -> tuple[subprocess.Popen[bytes], ProcRecord]:
    """Start ``cmd`` in its own process group, log to ``<state_dir>/logs/<role>-<name>.log``, record it.

    The record is written before anything waits on the process, so ``down`` can always stop it.
    """
    topo.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = topo.logs_dir / f"{role}-{name}.log"
    with log_path.open("ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=flower_env(topo), cwd=topo.state_dir, start_new_session=True)
    rec = ProcRecord(role=role, name=name, pid=proc.pid, pgid=proc.pid, start_ticks=_start_ticks(proc.pid),
                     log=str(log_path), cmd=cmd)
    _save_records(topo, [*load_records(topo), rec])
    return proc, rec


def _tail(path: str | Path, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("0.0.0.0", "::") else "", port))
        except OSError:
            return False
    return True


def health_ok(topo: Topology, timeout_s: float = 2.0) -> bool:
    """GET /health on the SuperLink's HTTP(S) port (verifying its certificate under TLS)."""
    scheme = "https" if topo.security.tls else "http"
    ctx = ssl.create_default_context(cafile=str(topo.certs.ca_cert)) if topo.security.tls else None
    try:
        with urllib.request.urlopen(f"{scheme}://{topo.address}/health", timeout=timeout_s, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def flwr_cli(topo: Topology, args: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the ``flwr`` CLI of this venv against the topology's FLWR_HOME (through the app
    server's shim with ``warm_apps``: it falls back to the plain command when the server is down)."""
    shim = topo.app_shims_dir / "flwr"
    exe = str(shim) if topo.warm_apps and shim.is_file() else flower_exe("flwr")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=flower_env(topo),
                          cwd=topo.app_dir, timeout=timeout_s, check=False)


def _json_out(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a ``flwr ... --format json`` call printed (stdout may carry a banner)."""
    text = proc.stdout
    start = text.find("{")
    if start < 0:
        return {"success": False, "error-message": (proc.stderr or text).strip()}
    try:
        out = json.loads(text[start:])
    except json.JSONDecodeError:
        return {"success": False, "error-message": text.strip()}
    return out if isinstance(out, dict) else {"success": False, "error-message": text.strip()}


def list_nodes(topo: Topology) -> list[dict[str, Any]]:
    """The SuperLink's node table (as ``flwr supernode ls`` lists it); empty when it cannot be
    read. Asked in this process through the Control API (`fl_geo.deploy.control`), else by the
    CLI."""
    from fl_geo.deploy.control import ControlUnavailable, query_nodes

    try:
        return query_nodes(topo)
    except ControlUnavailable as exc:
        log.debug("node table through the flwr CLI: %s", exc)
    out = _json_out(flwr_cli(topo, ["supernode", "ls", topo.name, "--format", "json"]))
    return list(out.get("nodes", [])) if out.get("success") else []


def register_node(topo: Topology, public_key: Path, name: str) -> int:
    """Register one SuperNode public key with an auth-enabled SuperLink; returns its node id."""
    out = _json_out(flwr_cli(topo, ["supernode", "register", str(public_key), topo.name, "--name", name,
                                    "--format", "json"]))
    if not out.get("success"):
        raise DeployError(f"registering {name} ({public_key}) failed: {out.get('error-message', out)}")
    return int(out["node-id"])


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held until chosen, so they cannot repeat): for
    loopback topologies built on the fly (tests, `fl-geo bench flower-path`)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
