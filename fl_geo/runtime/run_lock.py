"""One writer per run directory: an exclusive ``flock`` on ``<run dir>/run.lock``, held for the run.

Two runs pointed at one directory (the same ``--out`` and ``run.name`` typed in two terminals, a
sweep started twice) would otherwise interleave their metrics, and each would report success
over the other's summary. The lock is taken before anything in the directory is read or
written and released when the run's session closes; the kernel drops it when the process dies
(even by SIGKILL), so a crashed run never leaves a stale lock behind. The file holds the holder's
pid and host only so the refusal can name it; the lock itself is the ``flock``, not the file's
existence, and the file is left in place on release (unlinking it would let a waiting opener lock
an orphaned inode while a third process locks a new file).

``flock`` is advisory and per open file: it stops fl-geo's own writers, including a second run
in the same process, which is all it is for. On NFS, Linux emulates it with POSIX locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from fl_geo.errors import OutputError

__all__ = ["LOCK_FILE", "RunLock"]

LOCK_FILE = "run.lock"


class RunLock:
    """The exclusive lock of one run directory; `acquire` raises `OutputError` naming the holder
    at once (never waits) when another run holds it."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Create the directory if needed and take the lock (idempotent while held)."""
        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot create {self.path}: {exc.strerror or exc} (make the run directory "
                              "writable or choose another run.out_dir / --out)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputError(f"{self.path.parent} is in use by another run ({holder}, lock {self.path}); "
                              "wait for it to finish or give this run another run.name / --out") from None
        except OSError as exc:
            os.close(fd)
            raise OutputError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
        with contextlib.suppress(OSError):  # the holder's name is for messages only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays, see the module docstring); a no-op when not held."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"
