"""Ctrl-C: one SIGINT stops a run within seconds under either backend, writes the summary so far,
leaves no process behind and prints one line instead of tracebacks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_geo.runtime import interrupt
from tests.conftest import TINY

# Starts Ray (and checks that none of its processes outlive a run): one at a time across `make test`'s workers.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture
def default_sigint():
    """SIGINT as an interactive Python has it (a CI job or a background shell may start us with it ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_first_ctrl_c_requests_a_stop_and_the_block_restores_everything(default_sigint) -> None:
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with interrupt.stop_on_ctrl_c():
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # children inherit it blocked
        interrupt.check()  # nothing requested yet
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not interrupt.stop_requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert interrupt.stop_requested()
        with pytest.raises(interrupt.RunInterrupted, match="interrupted by the user"):
            interrupt.check()
    assert not interrupt.stop_requested()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask_before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_not_installed_where_sigint_is_ignored() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt.stop_on_ctrl_c():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _group_alive(pgid: int) -> list[str]:
    """Command lines of the processes still in the group (Ray's take a moment to exit after shutdown)."""
    pids = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return [subprocess.run(["ps", "-o", "pid=,args=", "-p", pid], capture_output=True, text=True).stdout.strip()
            for pid in pids]


@pytest.mark.parametrize("backend", ["inline", pytest.param("ray", marks=pytest.mark.slow(seconds=22))])
def test_ctrl_c_stops_a_run_cleanly(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "runs"
    args = [a for a in TINY if not a.startswith(("run.rounds=", "run.backend="))]
    cmd = [sys.executable, "-m", "fl_geo.cli", "run", *args, "run.rounds=100000", f"run.backend={backend}",
           "run.sim_cpus=1", "run.num_clients=2", "run.name=ctrl-c", "--out", str(out)]
    # Our own process group, as a terminal's foreground job has: Ctrl-C signals the whole group.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = out / "ctrl-c" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:  # training is under way
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{backend}: still running 10 s after Ctrl-C:\n{proc.communicate()[1][-3000:]}")
    took = time.monotonic() - t0
    assert proc.returncode == 130, err[-3000:]
    assert took < 10
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "fl-geo: Ctrl-C: stopping at the next step" in err
    assert "fl-geo: run ctrl-c interrupted after" in err
    summary = json.loads((out / "ctrl-c" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["outer_steps"] >= 1
    assert summary["failure"].startswith("interrupted by the user (Ctrl-C)")
    assert (out / "ctrl-c" / "final_model.pt").is_file()
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in _group_alive(proc.pid) if p] == []
