"""The suite's own scheduling helper (tests/cpu_share.py): while another worker holds the share,
the sessions this worker's tests started yield; they stop yielding when it is released, and a
worker never lowers its own pytest session or what it starts while it holds the share itself."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import CPU_SHARE
from tests.cpu_share import CpuShare, autogroup_nice, descendants


@pytest.mark.skipif(not CpuShare.available(), reason="this kernel does not group CPU time by session")
def test_sessions_yield_only_while_another_worker_holds_the_share(tmp_path, request):
    suite_share = request.config.stash.get(CPU_SHARE, None)
    own = autogroup_nice(os.getpid())
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    # The suite's own share is paused before the processes start: were another worker running a
    # Ray test, it would otherwise lower the new session before this test's share looks at it.
    with suite_share.paused() if suite_share is not None else contextlib.nullcontext():
        leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # stays in our session
        try:
            for _ in range(100):  # the grandchild appears once the leader's interpreter has started
                found = descendants(os.getpid())
                if sum(sid == leader.pid for sid in found.values()) == 2:
                    break
                time.sleep(0.1)
            assert found[leader.pid] == leader.pid and found[same.pid] == os.getsid(0)
            if autogroup_nice(leader.pid) is None:  # CI's containers: sessions get no group of their own
                pytest.skip("new sessions get no autogroup here (the kernel leaves them in the default one)")

            share = CpuShare(tmp_path)
            share.folder.mkdir(exist_ok=True)
            share.sweep()
            assert autogroup_nice(leader.pid) == 0 and share.set_to == {leader.pid: 0}  # nobody holds it

            other = tmp_path / "holder-1"  # another worker's Ray test
            other.touch()
            share.sweep()
            assert autogroup_nice(leader.pid) == share.nice and autogroup_nice(os.getpid()) == own
            with share.hold():  # this worker's own Ray test: what it starts never yields
                assert autogroup_nice(leader.pid) == 0
            share.sweep()
            assert autogroup_nice(leader.pid) == share.nice
            other.unlink()
            share.sweep()
            assert autogroup_nice(leader.pid) == 0 and autogroup_nice(os.getpid()) == own
        finally:
            for proc in (leader, same):
                proc.kill()
                proc.wait()
