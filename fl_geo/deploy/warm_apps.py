"""Flower's per-message app processes, forked from a server that has imported torch and Flower once.

Flower 1.42 runs every ClientApp message, and every ServerApp run, in a fresh process: the
SuperNode's (or SuperLink's) SuperExec starts ``flwr-clientapp`` (``flwr-serverapp``) by name
from ``PATH`` and the process exits after one message. Before it trains, such a process imports
torch (~3 CPU-s on a 2-core machine), ``torch._dynamo`` (~2-3 CPU-s: ``torch.optim`` imports it at
the first optimizer step) and Flower's runtime (~3 CPU-s). A site whose round takes a few
seconds pays more to start the process than to train. The SuperExecs (started by name too), the
``flwr`` CLI calls of ``fl-geo deploy`` and the SuperLink and SuperNodes it starts pay Flower's
imports the same way.

With ``warm_apps`` on (the topology key, default on Linux), :func:`fl_geo.deploy.lifecycle.up`
starts one **app server** per topology (``python -m fl_geo.deploy.warm_apps``, recorded like the
SuperLink) and puts a folder of **shims** first on the Flower processes' ``PATH``. The SuperExec
then starts our shim under Flower's command name; the shim, a stdlib-only interpreter started
with ``-IS`` (~20 ms), hands its argument list, working directory, environment and its standard
input, output and error (the file descriptors themselves) to the server over a Unix socket. The
server forks a child that takes all of them over and runs the Flower entry point the installed
package declares for that command, with torch, ``torch._dynamo``, numpy, Flower's runtime and
fl-geo's own apps (`APP_MODULES`) already imported, and fl-geo's config schema built (`WARM_CALLS`). Flower's code is unchanged; only the imports
are shared.

Contract, so that Flower sees the same process as before:

- **Exit status**: the shim exits with the child's status (a signal death is re-raised on the
  shim itself).
- **Signals**: SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to the shim are forwarded to the child.
- **Death**: the child watches the shim (a pidfd); when the shim dies, also by SIGKILL (a killed
  SuperNode's process group, a test's kill), the child kills itself with SIGKILL at once. The
  child is in the app server's process group, so ``down`` stops it with the server too.
- **Fallback**: when the server is not there (stopped, crashed, not yet bound) or declines (it is
  not single-threaded, the command is unknown), the shim ``exec``\\ s Flower's own command: the
  message runs cold, never fails for this reason.
- **Who may ask**: the socket is in Linux's abstract namespace under a random name, and the
  server serves only a peer with its own user id (``SO_PEERCRED``); any other request is refused
  and logged.
- **Fresh code**: the server notes the size and modification time of every source file it
  imported from outside the installed environment (fl-geo's checkout, an app folder). Once one has
  changed (the user edited fl-geo while the federation is up), every later ClientApp and ServerApp
  runs cold, importing the code as it is now, and the server's log says so once; stopping and
  starting the federation forks them warm again.
- **What differs from a fresh process**: ``sys.modules`` already holds the preloaded modules, and
  the server's import-time environment was the topology's Flower environment (`flower_env`), the
  same the child receives apart from what Flower adds per process. numpy's global generator and
  Python's ``random`` are reseeded in each child, as a fresh process would seed them.

Why fork is safe here: the server imports modules only, never starts a thread, touches no device
and opens no gRPC channel, and it checks that it is still single-threaded before every fork (else
it declines and the shim runs cold).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import importlib
import logging
import os
import secrets
import select
import signal
import socket
import stat
import struct
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from fl_geo.fork_server import die_with

# The server's own log: a handler of its own, nothing on the root logger, so that a forked app
# process logs exactly as a fresh one would (the child drops this handler, see AppServer._child).
log = logging.getLogger("fl_geo.app_server")

__all__ = [
    "APP_COMMANDS",
    "APP_MODULES",
    "PRELOAD",
    "WARM_CALLS",
    "AppServer",
    "entry_points",
    "listening",
    "new_socket_name",
    "server_command",
    "supported",
    "write_shims",
]

# The Flower commands whose processes the server forks: what a SuperExec starts per message / run,
# the SuperExec itself (a SuperLink or SuperNode starts one by name), the `flwr` CLI that
# `fl-geo deploy` calls to submit, list and stop runs, and the SuperLink and SuperNodes that
# `fl-geo deploy up` starts (through their shims: `fl_geo.deploy.lifecycle.up`).
APP_COMMANDS = ("flwr-clientapp", "flwr-serverapp", "flower-superexec", "flwr", "flower-superlink", "flower-supernode")
# Imported by the server before it serves (a name that fails to import is skipped). None of them
# starts a thread or initialises a device at import.
PRELOAD = ("numpy", "torch", "torch._dynamo")
# fl-geo's own Flower apps (fl-geo's app, the HALoS tiers' apps), imported after PRELOAD: ~0.3 CPU-s
# less per app process. This is source the user may edit while the federation is up, so the server
# watches every module it imported from outside the installed environment (`_SourceWatch`): once
# one has changed, app processes run cold, from the new code, instead of forked from the old import.
APP_MODULES = ("fl_geo.server_app", "fl_geo.clients.datacenter", "fl_geo.halos.apps", "fl_geo.halos.bridge")
# Pure calls whose results the app processes reuse (functools caches), made once by the server after
# its imports: fl-geo's config schema, which every ClientApp and ServerApp builds to read its run
# config (~55 of the ~110 ms that reading takes on a 2-core machine).
WARM_CALLS = ("fl_geo.config_files:schema",)
# The commands that load an app (and may import fl-geo): declined while the import is stale.
_APP_PROCESSES = frozenset({"flwr-clientapp", "flwr-serverapp"})
# What a shim forwards to its child (the same set is written into the shim's text).
_FORWARDED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
MAX_REQUEST = 1 << 20  # one request packet: argv + cwd + environment, as JSON
SHIM_MARK = "# fl-geo warm app shim"


def supported() -> bool:
    """Abstract Unix sockets, ``SO_PEERCRED`` and fd passing: Linux only."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "send_fds")


def new_socket_name() -> str:
    """A fresh abstract-namespace socket name (leading NUL: nothing on disk to clean up)."""
    return "\0fl-geo-apps-" + secrets.token_hex(12)


def listening(socket_name: str) -> bool:
    """Whether a server listens on the abstract socket ``socket_name`` yet (``/proc/net/unix``:
    the name with a leading ``@``, and the accepting-connections flag). True where it cannot tell."""
    name = "@" + socket_name.lstrip("\0")
    try:
        lines = Path("/proc/net/unix").read_text(encoding="utf-8", errors="replace").splitlines()[1:]
    except OSError:
        return True
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[7] == name and int(parts[3], 16) & 0x10000:  # __SO_ACCEPTCON
            return True
    return False


def entry_points(commands: Sequence[str] = APP_COMMANDS) -> dict[str, str]:
    """``{command: "module:function"}`` for the console scripts the installed Flower declares."""
    found: dict[str, str] = {}
    for ep in metadata.entry_points(group="console_scripts"):
        if ep.name in commands:
            found[ep.name] = ep.value
    missing = [c for c in commands if c not in found]
    if missing:
        raise RuntimeError(f"no console script {', '.join(missing)} in this environment (is flwr installed?)")
    return found


def server_command(socket_name: str) -> list[str]:
    """The command that runs the app server for ``socket_name`` (from :func:`new_socket_name`)."""
    return [sys.executable, "-m", "fl_geo.deploy.warm_apps", "--socket", socket_name.lstrip("\0")]


_SHIM = '''#!{python} -IS
{mark}: run {command} forked from fl-geo's app server (fl_geo/deploy/warm_apps.py), or cold.
import os, signal, socket, sys
REAL = {real!r}
NAME = {name!r}
child = None
pending = []
def forward(sig, _frame):
    if child is None:  # before the server named the child: deliver once it has
        pending.append(sig)
        return
    try:
        os.kill(child, sig)
    except OSError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, forward)
def cold():
    if pending:  # asked to stop before anything started: stop as the command would have
        signal.signal(pending[0], signal.SIG_DFL)
        os.kill(os.getpid(), pending[0])
    os.execv(REAL, [REAL, *sys.argv[1:]])
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(NAME)
    req = repr({{"command": {command!r}, "argv": [REAL, *sys.argv[1:]], "cwd": os.getcwd(),
                "env": dict(os.environ)}}).encode()
    socket.send_fds(s, [req], [0, 1, 2])
    first = s.recv(64).split()
except OSError:
    cold()
if first[:1] != [b"pid"]:
    s.close()
    cold()
child = int(first[1])
for sig in pending:
    forward(sig, None)
try:
    last = s.recv(64).split()
except OSError:
    last = []
code = int(last[1]) if last[:1] == [b"exit"] else 1
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''


def write_shims(bin_dir: Path, socket_name: str, commands: Sequence[str] = APP_COMMANDS,
                real_dir: Path | None = None) -> list[Path]:
    """Write one executable shim per command into ``bin_dir`` (put it first on ``PATH``).

    ``real_dir`` holds the real commands a shim falls back to (default: this interpreter's bin
    folder, where ``flwr`` installed them). The request is a Python literal (``repr``), read
    back with ``ast.literal_eval``: the shim imports no ``json``, to start in ~20 ms.
    """
    real_dir = real_dir or Path(sys.executable).parent
    bin_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for command in commands:
        real = real_dir / command
        text = _SHIM.format(python=sys.executable, mark=SHIM_MARK, command=command, real=str(real), name=socket_name)
        path = bin_dir / command
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        tmp.replace(path)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def _resolve(value: str) -> Callable[[], Any]:
    module, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _parse_request(data: bytes, fds: Sequence[int], commands: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one request; raise ``ValueError`` naming what is wrong."""
    if len(fds) != 3:
        raise ValueError(f"expected 3 file descriptors (stdin, stdout, stderr), got {len(fds)}")
    try:
        req = ast.literal_eval(data.decode("utf-8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise ValueError(f"unreadable request ({type(exc).__name__})") from None
    if not isinstance(req, dict) or set(req) != {"command", "argv", "cwd", "env"}:
        raise ValueError("request must be a mapping with exactly command, argv, cwd, env")
    if req["command"] not in commands:
        raise ValueError(f"unknown command {req['command']!r}")
    argv, env, cwd = req["argv"], req["env"], req["cwd"]
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map strings to strings")
    if not isinstance(cwd, str):
        raise ValueError("cwd must be a string")
    return req


def _installed_dirs() -> tuple[str, ...]:
    """The interpreter's own folders: the standard library and site-packages (with a separator)."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


class _SourceWatch:
    """The source files of the modules this process imported from outside the installed
    environment (fl-geo's editable checkout, an app's own folder: the code people edit), as they
    were then (size and modification time): `changed` names the first that differs now. One
    ``stat`` per module (~130 for fl-geo's apps, well under a millisecond) per app process.

    ``since_ns``: when the imports began. A file modified after that may have been imported in its
    old form and noted in its new one, so it counts as changed from the start."""

    def __init__(self, since_ns: int | None = None) -> None:
        installed = _installed_dirs()
        self.files: dict[str, tuple[int, int]] = {}
        self.edited_while_importing: str | None = None
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or os.path.realpath(path).startswith(installed):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(path)
                self.files[path] = (st.st_size, st.st_mtime_ns)
                if since_ns is not None and st.st_mtime_ns >= since_ns and self.edited_while_importing is None:
                    self.edited_while_importing = path

    def changed(self) -> str | None:
        if self.edited_while_importing is not None:
            return self.edited_while_importing
        for path, seen in self.files.items():
            try:
                st = os.stat(path)
            except OSError:
                return path
            if (st.st_size, st.st_mtime_ns) != seen:
                return path
        return None


def _reseed() -> None:
    """What a fresh interpreter seeds from the OS (``random`` reseeds itself after fork)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


class AppServer:
    """Accept shim requests on an abstract Unix socket and fork one app process per request.

    Single-threaded by design: one ``select`` loop over the listening socket, the open shim
    connections and a SIGCHLD wake-up pipe. ``commands`` maps a command name to its entry point
    (``"module:function"``); the modules are imported by :meth:`preload`, before serving.
    """

    def __init__(self, socket_name: str, commands: Mapping[str, str],
                 preload: Sequence[str] = (*PRELOAD, *APP_MODULES), warm_calls: Sequence[str] = WARM_CALLS) -> None:
        self.socket_name = socket_name if socket_name.startswith("\0") else "\0" + socket_name
        self.commands = dict(commands)
        self.preload_names = tuple(preload)
        self.warm_calls = tuple(warm_calls)
        self.sources: _SourceWatch | None = None  # set by `preload`, after the imports it watches
        self.stale: str | None = None  # the first watched source seen changed since the preload
        self.entries: dict[str, Callable[[], Any]] = {}
        self.children: dict[int, socket.socket | None] = {}  # child pid -> its shim's connection
        self.served = 0
        self.declined = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.socket_name)  # bound first: shims that come early wait in the backlog
        self.listener.listen(64)
        self._stop = False

    def preload(self) -> None:
        started_ns = time.time_ns()
        for name in self.preload_names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a missing optional module only makes children slower
                log.warning("app server: could not preload %s (%s)", name, exc)
        for value in self.warm_calls:
            try:
                _resolve(value)()
            except Exception as exc:  # noqa: BLE001 - a cache left cold only makes children slower
                log.warning("app server: could not call %s (%s)", value, exc)
        for command, value in self.commands.items():
            self.entries[command] = _resolve(value)
        self.sources = _SourceWatch(started_ns)  # after every import: what the children would inherit

    def _stale_import(self, command: str) -> bool:
        """True when ``command`` loads an app and a watched source file changed since the server
        imported it: the app process must import the new code itself (logged once)."""
        if command not in _APP_PROCESSES or self.sources is None:
            return False
        if self.stale is None:
            self.stale = self.sources.changed()
            if self.stale is not None:
                log.warning("app server: %s changed since the server imported it; app processes run cold "
                            "from now on (stop and start the federation to fork them warm again)", self.stale)
        return self.stale is not None

    def serve(self) -> None:
        """Serve until SIGTERM / SIGINT; then close the socket (children keep running, see module doc)."""
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        os.set_blocking(rfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)

        def stop(*_: Any) -> None:
            self._stop = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("app server: serving %s (pid %d)", ", ".join(sorted(self.commands)), os.getpid())
        while not self._stop:
            conns = [c for c in self.children.values() if c is not None]
            try:
                ready, _, _ = select.select([self.listener, rfd, *conns], [], [])
            except InterruptedError:
                continue
            if rfd in ready:
                with contextlib.suppress(OSError):
                    os.read(rfd, 4096)
            self._reap()
            if self.listener in ready:
                self._accept()
            for conn in conns:
                if conn in ready:
                    self._shim_gone_if_eof(conn)
        self.listener.close()
        log.info("app server: stopping after %d app process(es), %d declined", self.served, self.declined)

    def _shim_gone_if_eof(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the shim died: its child kills itself (it watches the shim); forget the link
            for pid, c in self.children.items():
                if c is conn:
                    self.children[pid] = None
            conn.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            conn.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))
            if uid != os.getuid():
                raise ValueError(f"peer pid {pid} runs as uid {uid}, not {os.getuid()}")
            conn.settimeout(5.0)  # a shim sends its request right after connecting
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 3)
            req = _parse_request(data, fds, self.entries)
        except (OSError, ValueError) as exc:
            self.declined += 1
            log.warning("app server: request refused: %s", exc)
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        threaded = threading.active_count() != 1  # a forked copy of a threaded process can deadlock
        if threaded or self._stale_import(req["command"]):
            self.declined += 1
            if threaded:
                log.warning("app server: %d threads are running; %s runs cold", threading.active_count(),
                            req["command"])
            with contextlib.suppress(OSError):
                conn.send(b"cold")
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        # Signals stay blocked across the fork until the child has dropped the server's handlers:
        # a SIGTERM the shim forwards at once must stop the child, not run the server's handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        child = os.fork()
        if child == 0:
            self._child(conn, fds, req, shim_pid=pid)  # never returns
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        for fd in fds:
            os.close(fd)
        self.served += 1
        self.children[child] = conn
        with contextlib.suppress(OSError):
            conn.send(f"pid {child}".encode())
        log.info("app server: %s pid %d for shim %d", req["command"], child, pid)

    def _child(self, conn: socket.socket, fds: Sequence[int], req: dict[str, Any], shim_pid: int) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # blocked by the server at fork
            log.handlers.clear()
            log.propagate = True
            log.setLevel(logging.NOTSET)
            self.listener.close()
            conn.close()
            for c in self.children.values():
                if c is not None:
                    c.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            die_with(shim_pid, name="fl-geo-shim-watch")  # the shim's death is this process's
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            sys.argv = list(req["argv"])
            sys.path[0] = str(Path(sys.argv[0]).parent)  # as a console script's own folder
            _reseed()
            try:
                result = self.entries[req["command"]]()
                code = 0 if result is None else int(result) if isinstance(result, int) else 1
            except SystemExit as exc:  # as the interpreter ends on it: an int, None, or a message
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - report as a fresh interpreter would, then exit 1
                import traceback

                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
        finally:
            with contextlib.suppress(OSError):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)




def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_geo.deploy.warm_apps",
                                     description="fl-geo's app server: fork Flower app processes with torch imported.")
    parser.add_argument("--socket", required=True, help="abstract socket name (without the leading NUL)")
    parser.add_argument("--command", action="append", default=[], metavar="NAME=MODULE:FUNCTION",
                        help="serve this command instead of Flower's app commands (repeatable)")
    parser.add_argument("--preload", action="append", default=None, metavar="MODULE",
                        help=f"modules to import before serving (default: {', '.join((*PRELOAD, *APP_MODULES))}, "
                             f"then {', '.join(WARM_CALLS)} is called)")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    commands = dict(c.split("=", 1) for c in args.command) if args.command else entry_points()
    server = (AppServer(args.socket, commands) if args.preload is None
              else AppServer(args.socket, commands, args.preload, warm_calls=()))
    server.preload()
    server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
