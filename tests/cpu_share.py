"""While a Ray test runs, the sessions other tests started yield the CPU to it.

Linux groups CPU time by session when ``kernel.sched_autogroup_enabled`` is 1 (the default on
desktop and many server kernels, and on this project's CI machines): every session is one
scheduling group with the weight of one busy process, whatever it runs. A loopback deployment
starts its SuperLink and each SuperNode with ``start_new_session=True`` (so ``fl-geo deploy down``
can stop each one's whole process group), and the sharded parameter server's followers do the
same. One deployment test therefore held three of the machine's scheduling groups, while every
pytest worker and the Ray runtime they start (a dozen processes passing each message through
several hops) shared one. Measured on the 2-core CI kind (2026-11-28): a Ray simulation test that
takes 20 s idle took 198 s beside one deployment test, and another missed its 120 s node wait.

`CpuShare` runs on each pytest-xdist worker. A worker running a test of the ``ray`` xdist group
*holds* the share (a file in a folder all workers of the run see); while any other worker holds
it, every session this worker's descendants lead gets ``nice 5`` in ``/proc/<pid>/autogroup``
(three such sessions weigh about as much as one at ``nice 0``), and ``nice 0`` again once it is
released. Only scheduling weight changes, never what a test does or checks; an unprivileged user
may move an autogroup between 0 and 19, and where the kernel has no autogroups nothing happens.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from fl_geo.deploy.processes import _descendants, _proc_stat

PROC = Path("/proc")


def autogroup_nice(pid: int) -> int | None:
    """The nice of ``pid``'s session group, or None where it has none.

    The kernel prints nothing for a process of the default group (a session the kernel did not
    group, as in some containers), "/autogroup-<id> nice <n>" otherwise.
    """
    try:
        text = (PROC / str(pid) / "autogroup").read_text()
    except OSError:
        return None
    _, found, nice = text.partition(" nice ")
    return int(nice) if found else None


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> session id (the deployment code's /proc walk)."""
    found: dict[int, int] = {}
    for pid in _descendants([root]):
        if (stat := _proc_stat(pid)) is not None:  # gone since the walk otherwise
            found[pid] = int(stat[3])
    return found


class CpuShare:
    """One worker's side of the share: hold it during a latency-bound test, yield while others do."""

    def __init__(self, folder: Path, nice: int = 5, every_s: float = 0.5) -> None:
        self.folder = folder
        self.nice = nice
        self.every_s = every_s
        self.set_to: dict[int, int] = {}  # session id -> the autogroup nice this worker gave it
        self._flag = folder / f"holder-{os.getpid()}"
        self._own_session = os.getsid(0)
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._sweeping = threading.Lock()  # held by the thread's sweep: `paused` waits for one in flight
        self._thread = threading.Thread(target=self._run, name="cpu-share", daemon=True)

    @staticmethod
    def available() -> bool:
        try:
            return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
        except OSError:
            return False

    def start(self) -> CpuShare:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._flag.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # the last worker out removes the folder

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While inside, the other workers' sessions yield (and this worker's never do)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._flag.touch()
        try:
            self.sweep()
            yield
        finally:
            self._flag.unlink(missing_ok=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No sweeps meanwhile (a test of this module checks its own `CpuShare` undisturbed); a
        sweep already under way is waited for, so nothing is lowered after this returns."""
        self._paused.set()
        with self._sweeping:
            pass
        try:
            yield
        finally:
            self._paused.clear()

    def others_hold(self) -> bool:
        try:
            return any(p.name.startswith("holder-") and p != self._flag for p in self.folder.iterdir())
        except FileNotFoundError:  # every other worker has finished and the last one removed it
            return False

    def sweep(self) -> None:
        """Give every session led by a descendant of this process the nice the share calls for now."""
        want = self.nice if self.others_hold() and not self._flag.exists() else 0
        seen: dict[int, int] = {}
        for pid, sid in descendants(os.getpid()).items():
            if sid == self._own_session or sid in seen:
                continue
            seen[sid] = self.set_to.get(sid, 0)
            if seen[sid] == want:
                continue
            try:
                (PROC / str(pid) / "autogroup").write_text(str(want))
            except OSError:  # gone already, or a kernel without the file: retried with its next process
                continue
            seen[sid] = want
        self.set_to = seen

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            # New sessions start at nice 0, so with nobody else holding and nothing lowered there
            # is nothing to do: skip the walk over /proc (about 1-3 ms of CPU each).
            with self._sweeping:
                if not self._paused.is_set() and (self.others_hold() or any(self.set_to.values())):
                    self.sweep()
