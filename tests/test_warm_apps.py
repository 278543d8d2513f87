"""The warm app server (fl_geo/deploy/warm_apps.py): a shim's process is forked from the server with
the shim's arguments, directory, environment and standard streams; its exit status, signals and
death are the shim's; without a server the shim runs the real command; bad requests are refused
and the server goes on serving. The deployment end-to-end tests (test_deploy.py,
test_deploy_faults.py, test_halos_deploy.py) run Flower's real app commands this way."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_geo.deploy import processes, warm_apps
from fl_geo.deploy.topology import DeployError, parse_topology

pytestmark = pytest.mark.skipif(not warm_apps.supported(), reason="warm apps need Linux")

TESTS = Path(__file__).resolve().parent


def _real_command(tmp: Path, names: tuple[str, ...] = ("probe",)) -> Path:
    """What a shim falls back to: the probe run by a fresh interpreter, under each of ``names``."""
    real_dir = tmp / "real"
    real_dir.mkdir(exist_ok=True)
    for name in names:
        real = real_dir / name
        real.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                        "from warm_app_probe import main\nsys.exit(main())\n", encoding="utf-8")
        real.chmod(0o755)
    return real_dir


class _Server:
    """An app server serving the probe under each of ``commands`` (the first one's shim is ``shim``)."""

    def __init__(self, tmp: Path, preload: tuple[str, ...] = ("fractions",), wait: bool = True,
                 commands: tuple[str, ...] = ("probe",)) -> None:
        self.name = warm_apps.new_socket_name()
        self.log = tmp / "server.log"
        path = [str(TESTS), str(tmp), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        cmd = [*warm_apps.server_command(self.name)]
        cmd += [arg for name in commands for arg in ("--command", f"{name}=warm_app_probe:main")]
        cmd += [arg for name in preload for arg in ("--preload", name)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        written = warm_apps.write_shims(tmp / "bin", self.name, list(commands), real_dir=_real_command(tmp, commands))
        self.shims = dict(zip(commands, written, strict=True))
        self.shim = written[0]
        if wait:
            self.wait_serving()

    def wait_bound(self) -> None:
        """Until the server's socket is listening (it binds before it imports)."""
        deadline = time.monotonic() + 30
        while "@" + self.name[1:] not in Path("/proc/net/unix").read_text() and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.02)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + 30
        while "app server: serving " not in self.log.read_text() and time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def server(tmp_path):
    s = _Server(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def _report(out: str) -> dict:
    return json.loads(out.splitlines()[0])


def test_a_shim_runs_its_command_forked_from_the_server_with_its_own_streams_and_environment(server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    res = subprocess.run([str(server.shim), "exit5", "a b"], capture_output=True, text=True, cwd=work,
                         env={**os.environ, "PROBE_X": "hello"}, timeout=60)
    assert res.returncode == 5, res.stderr
    seen = _report(res.stdout)
    assert seen["argv"] == ["exit5", "a b"] and seen["cwd"] == str(work) and seen["x"] == "hello"
    assert seen["ppid"] == server.proc.pid  # forked by the server ...
    assert seen["preloaded"] is True  # ... with what it imported
    assert res.stderr.strip() == "probe stderr"
    # The next one sees its own environment, not the previous request's.
    again = subprocess.run([str(server.shim)], capture_output=True, text=True, cwd=work, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "PROBE_X"})
    assert again.returncode == 0 and _report(again.stdout)["x"] is None
    assert server.log.read_text().count("probe pid ") == 2


def test_signals_reach_the_child_and_its_death_is_the_shims(server):
    # SIGTERM to the shim is forwarded: the probe exits 7 from its handler.
    shim = subprocess.Popen([str(server.shim), "sleep"], stdout=subprocess.PIPE, text=True)
    child = _report(shim.stdout.readline())["pid"]
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == 7
    # A child killed by a signal: the shim dies of the same signal.
    died = subprocess.run([str(server.shim), "signal"], capture_output=True, text=True, timeout=60)
    assert died.returncode == -signal.SIGUSR1
    # SIGKILL on the shim (a killed SuperNode's group): the child kills itself at once.
    shim = subprocess.Popen([str(server.shim), "sleep"], stdout=subprocess.PIPE, text=True)
    child = _report(shim.stdout.readline())["pid"]
    assert processes._alive(child)
    shim.kill()
    shim.wait(10)
    deadline = time.monotonic() + 10
    while processes._alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes._alive(child)
    assert server.proc.poll() is None  # the server serves on


def test_a_signal_sent_while_the_server_still_imports_stops_the_child(tmp_path):
    """A shim that connected while the server imports waits in its backlog; a SIGTERM it gets then
    is delivered to the child as soon as the server names it (not lost, not fatal to the shim)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n", encoding="utf-8")
    server = _Server(tmp_path, preload=("slow_import",), wait=False)
    try:
        server.wait_bound()
        shim = subprocess.Popen([str(server.shim), "sleep"], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # connected, waiting for the server's import to end
        assert "serving probe" not in server.log.read_text()
        shim.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert shim.poll() is None  # the shim holds the signal until the server names its child
        # the probe exits 7 from its handler, or dies of SIGTERM if it came before the handler
        assert shim.wait(30) in (7, -signal.SIGTERM)
        assert "probe pid" in server.log.read_text()  # it was forked, then stopped: not run cold
    finally:
        server.stop()


def test_without_a_server_the_shim_runs_the_real_command(tmp_path):
    (shim,) = warm_apps.write_shims(tmp_path / "bin", warm_apps.new_socket_name(), ["probe"],
                                    real_dir=_real_command(tmp_path))
    res = subprocess.run([str(shim), "exit3", "x"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    seen = _report(res.stdout)
    assert seen["argv"] == ["exit3", "x"] and seen["preloaded"] is False
    assert seen["ppid"] == os.getpid()  # exec'd in place of the shim: our child, not a server's


def test_app_processes_run_cold_once_a_source_the_server_imported_has_changed(tmp_path):
    """The server imports an app's modules once; when one of their files changes afterwards (edited
    while the federation is up), a ClientApp or ServerApp forked from it would run the old code.
    From then on those run cold (the new code, imported by a fresh interpreter), said once in the
    log; a command that loads no app (here the probe under its own name) is still forked."""
    app = tmp_path / "userapp"
    app.mkdir()
    (app / "__init__.py").write_text("", encoding="utf-8")
    (app / "task.py").write_text("VERSION = 1\n", encoding="utf-8")
    server = _Server(tmp_path, preload=("fractions", "userapp.task"), commands=("flwr-clientapp", "probe"))
    try:
        def parent(command: str) -> int:
            res = subprocess.run([str(server.shims[command])], capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            return _report(res.stdout)["ppid"]

        assert parent("flwr-clientapp") == server.proc.pid  # forked while the import is current
        (app / "task.py").write_text("VERSION = 22\n", encoding="utf-8")  # another size: changed at any clock
        assert parent("flwr-clientapp") == os.getpid()  # cold: exec'd in place of the shim, our child
        assert parent("flwr-clientapp") == os.getpid()
        assert parent("probe") == server.proc.pid
        log = server.log.read_text()
        assert log.count("task.py changed since the server imported it; app processes run cold") == 1, log
    finally:
        server.stop()


def test_the_source_watch_sees_a_change_and_an_edit_made_while_the_server_imported(tmp_path, monkeypatch):
    """`_SourceWatch` notes the modules imported from outside the installed environment (not
    torch's files): a change of size or time is a change, and a file modified after the imports
    began counts as changed at once (it may have been imported in its old form)."""
    import importlib

    from fl_geo.deploy.warm_apps import _SourceWatch

    (tmp_path / "watched_mod_x.py").write_text("A = 1\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("watched_mod_x")
    monkeypatch.setitem(sys.modules, "watched_mod_x", module)  # removed again at teardown
    path = module.__file__
    before = os.stat(path).st_mtime_ns
    watch = _SourceWatch(since_ns=before + 1)
    assert path in watch.files and watch.changed() is None
    assert not any("site-packages" in f for f in watch.files)  # torch, numpy, ...: installed, not watched
    assert _SourceWatch(since_ns=before).changed() == path  # written as the imports began
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert watch.changed() == path


def test_the_server_fills_the_config_schema_cache_before_it_forks(caplog):
    """`WARM_CALLS` run once after the imports, so every forked app process finds fl-geo's config
    schema built; a call that fails is logged and the server still serves."""
    import logging

    from fl_geo import config_files

    config_files.schema.cache_clear()
    server = warm_apps.AppServer(warm_apps.new_socket_name(), {}, preload=(),
                                 warm_calls=(*warm_apps.WARM_CALLS, "no_such_module_x:f"))
    try:
        with caplog.at_level(logging.WARNING, logger="fl_geo.app_server"):
            server.preload()
    finally:
        server.listener.close()
    assert config_files.schema.cache_info().currsize == 1
    assert "could not call no_such_module_x:f" in caplog.text


def _ask(name: str, payload: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(name)
        socket.send_fds(s, [payload], fds)
        s.settimeout(20)
        return s.recv(64)


@pytest.mark.parametrize("payload, fds, why", [
    (b"{'command': 'probe'}", 3, "exactly command, argv, cwd, env"),
    (b"not a literal (", 3, "unreadable request"),
    (b"{'command': 'rm', 'argv': ['x'], 'cwd': '/', 'env': {}}", 3, "unknown command 'rm'"),
    (b"{'command': 'probe', 'argv': [], 'cwd': '/', 'env': {}}", 3, "argv must be"),
    (b"{'command': 'probe', 'argv': ['x'], 'cwd': '/', 'env': {'A': 1}}", 3, "env must map"),
    (b"{'command': 'probe', 'argv': ['x'], 'cwd': 7, 'env': {}}", 3, "cwd must be"),
    (b"{'command': 'probe', 'argv': ['x'], 'cwd': '/', 'env': {}}", 1, "expected 3 file descriptors"),
    (b"\xff\xfe", 3, "unreadable request"),
])
def test_a_bad_request_is_refused_and_logged_and_the_server_serves_on(server, payload, fds, why):
    with open(os.devnull, "rb") as null:
        assert _ask(server.name, payload, [null.fileno()] * fds) == b""  # closed: no child
    log = server.log.read_text()
    assert "request refused: " in log and why in log, log
    assert "probe pid" not in log
    ok = subprocess.run([str(server.shim)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and _report(ok.stdout)["ppid"] == server.proc.pid


def test_the_topology_key_and_the_path_the_flower_processes_get(tmp_path):
    base = {"superlink": {"host": "127.0.0.1", "port": 9092}, "state_dir": str(tmp_path / "state"),
            "nodes": [{"name": "dc0", "port": 9094, "node_config": {"partition-id": 0, "num-partitions": 1, "site": "a",
                                                                   "region": "r", "device": "cpu"}}]}
    on = parse_topology(base, tmp_path)
    assert on.warm_apps is True  # the default where it is supported (this module runs only there)
    path = processes.flower_env(on)["PATH"].split(os.pathsep)
    assert path[:2] == [str(on.app_shims_dir), str(Path(sys.executable).parent)]
    off = parse_topology({**base, "warm_apps": False}, tmp_path)
    assert str(off.app_shims_dir) not in processes.flower_env(off)["PATH"].split(os.pathsep)
    with pytest.raises(DeployError, match="warm_apps: must be true or false"):
        parse_topology({**base, "warm_apps": "yes"}, tmp_path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # typer's, at importing Flower's CLI
def test_the_flower_commands_resolve_to_their_installed_entry_points():
    found = warm_apps.entry_points()
    assert set(found) == set(warm_apps.APP_COMMANDS)
    for command, value in found.items():
        assert callable(warm_apps._resolve(value)), command


@pytest.mark.skipif(not warm_apps.supported(), reason="abstract Unix sockets are Linux's")
def test_listening_tells_a_bound_socket_from_a_listening_one():
    """`up` starts the SuperLink through its shim only once the app server listens (a shim that
    finds no listener runs cold): a socket that is only bound, or a name nobody bound, is not."""
    name = warm_apps.new_socket_name()
    assert not warm_apps.listening(name)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(name)
        assert not warm_apps.listening(name)
        s.listen(1)
        assert warm_apps.listening(name) and warm_apps.listening(name.lstrip("\0"))
        assert not warm_apps.listening(warm_apps.new_socket_name())
