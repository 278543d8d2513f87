"""Rank processes start from a fork server that imported torch once (`fl_geo.fork_server`)."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest

from fl_geo import fork_server
from fl_geo.fork_server import PRELOAD, process_context, start_method


def _report_modules(conn) -> None:
    """In the rank: which of the preloaded modules were there before this function ran."""
    conn.send(sorted(m for m in PRELOAD if m in sys.modules))
    conn.close()


@pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="no fork server on this platform")
def test_a_rank_starts_with_torch_and_the_rank_modules_already_imported(monkeypatch):
    """The saving this module exists for: a rank finds torch, torch._dynamo and the rank code
    imported (by the server, once) instead of importing them itself (~5 CPU-s per rank)."""
    monkeypatch.delenv("FL_GEO_RANK_START", raising=False)
    ctx = process_context()
    assert ctx.get_start_method() == "forkserver"
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report_modules, args=(child,))
    proc.start()
    child.close()
    try:
        assert parent.poll(120), "the rank did not answer"
        assert parent.recv() == sorted(PRELOAD)
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_the_start_method_can_be_forced_and_a_wrong_one_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("FL_GEO_RANK_START", "spawn")
    assert start_method() == "spawn" and process_context().get_start_method() == "spawn"
    monkeypatch.setenv("FL_GEO_RANK_START", "fork")
    with pytest.raises(ValueError, match="FL_GEO_RANK_START='fork': expected 'forkserver' or 'spawn'"):
        start_method()
    monkeypatch.delenv("FL_GEO_RANK_START")
    monkeypatch.setattr(fork_server.mp, "get_all_start_methods", lambda: ["spawn"])  # e.g. Windows
    assert start_method() == "spawn"


def test_die_with_leaves_signals_to_the_main_thread():
    """The watch thread blocks every signal, so a SIGTERM sent to the process reaches the main
    thread, whose handler then interrupts what that thread is blocked in; the caller's own mask
    is as it was. Read from the kernel's view of each thread (/proc/<pid>/task/<tid>/status)."""
    import signal
    import subprocess

    code = (
        "import os, signal, threading\n"
        "from fl_geo.fork_server import die_with\n"
        "die_with(os.getppid(), name='watch')\n"
        "watch = next(t for t in threading.enumerate() if t.name == 'watch')\n"
        "def blocked(tid):\n"
        "    status = open(f'/proc/self/task/{tid}/status').read()\n"
        "    return int(next(l for l in status.splitlines() if l.startswith('SigBlk:')).split()[1], 16)\n"
        "print(blocked(watch.native_id), blocked(threading.main_thread().native_id))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    watch, main = (int(v) for v in out.stdout.split())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGCHLD):
        assert watch >> (sig - 1) & 1, sig
    assert main == 0


def test_die_with_kills_the_watcher_when_its_owner_ends_however_it_ends():
    """`die_with(pid)`: the watching process is SIGKILLed once ``pid`` ends (here by SIGKILL, which
    no parent-death signal of a forked child would see), and at once when ``pid`` is gone already."""
    import signal
    import subprocess
    import time

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = "import sys, time; from fl_geo.fork_server import die_with; die_with(int(sys.argv[1])); time.sleep(120)"
    watcher = subprocess.Popen([sys.executable, "-c", code, str(owner.pid)])
    try:
        time.sleep(1.0)
        assert watcher.poll() is None  # the owner lives: so does the watcher
        owner.kill()
        owner.wait(10)
        assert watcher.wait(10) == -signal.SIGKILL
        late = subprocess.run([sys.executable, "-c", code, str(owner.pid)], timeout=30)
        assert late.returncode == -signal.SIGKILL
    finally:
        for proc in (owner, watcher):
            if proc.poll() is None:
                proc.kill()
