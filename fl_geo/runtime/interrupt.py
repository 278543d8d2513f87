"""Ctrl-C that stops a run cleanly: the loop ends at its next wait, the results so far are written.

Without this, a Ctrl-C during a Flower simulation interrupts whatever the main thread happens to
run: under Ray the terminal's SIGINT also reaches every Ray worker (they share the process group),
each prints a traceback, and the ServerApp thread keeps waiting for replies that never come.

`stop_on_ctrl_c` blocks SIGINT in the main thread before anything else starts, so every thread
and process started from it (Flower's ServerApp thread, Ray's raylet and workers, the sharded
parameter server's followers) inherits the blocked signal. A receiver thread takes it with
``sigwait``; it does not need the main thread, which under Ray sits in a ``join`` that a Python
signal handler would never interrupt. A thread that existed before (torch's intra-op pool) may
still take the signal, so the same reaction is also installed as the Python handler.

* The first Ctrl-C prints one line and sets the stop request; the dispatcher raises
  `RunInterrupted` at its next poll (`check`), the strategy ends the loop with the failure
  "interrupted", and the run directory gets its summary, final model and metrics so far.
* A second Ctrl-C ends the process at once with exit code 130 (Ray's processes die with it: they
  are tied to their parent's life).

Only the main thread can change signal handling, and only on POSIX; elsewhere the context manager
does nothing and Ctrl-C behaves as Python's default.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["RunInterrupted", "check", "request_stop", "stop_on_ctrl_c", "stop_requested"]

_STOP = threading.Event()


class RunInterrupted(Exception):  # noqa: N818 - not an error: the user asked the run to stop
    """Raised at a dispatcher wait once a stop was requested (Ctrl-C)."""


def stop_requested() -> bool:
    return _STOP.is_set()


def request_stop() -> None:
    """Ask the running loop to stop at its next wait (what the first Ctrl-C does)."""
    _STOP.set()


def clear_stop() -> None:
    """Forget a stop request, so that the next run in this process starts clean (a test's
    watchdog stops a stalled run with `request_stop`, then clears it)."""
    _STOP.clear()


def check() -> None:
    """Raise `RunInterrupted` if a stop was requested; the dispatcher calls it at every poll."""
    if _STOP.is_set():
        raise RunInterrupted("interrupted by the user (Ctrl-C)")


def _react() -> None:
    if _STOP.is_set():
        print("\nfl-geo: Ctrl-C again: stopping now", file=sys.stderr, flush=True)
        os._exit(130)  # the user insists; nothing below may block
    _STOP.set()
    print("\nfl-geo: Ctrl-C: stopping at the next step and writing the results so far "
          "(Ctrl-C again to force)", file=sys.stderr, flush=True)


def _on_sigint(signum: int, frame: object) -> None:
    _react()


def _receive(done: threading.Event) -> None:
    """Take SIGINT for the whole process (every other thread blocks it) until ``done``."""
    while True:
        signal.sigwait({signal.SIGINT})
        if done.is_set():
            return
        _react()


@contextlib.contextmanager
def stop_on_ctrl_c() -> Iterator[None]:
    """Within this block, Ctrl-C requests a clean stop (see the module docstring)."""
    usable = (hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwait")
              and threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if not usable:  # not POSIX, not the main thread, or someone else handles (or ignores) SIGINT
        yield
        return
    _STOP.clear()
    done = threading.Event()
    previous_handler = signal.signal(signal.SIGINT, _on_sigint)
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    receiver = threading.Thread(target=_receive, args=(done,), name="fl-geo-ctrl-c", daemon=True)
    receiver.start()
    try:
        yield
    finally:
        done.set()
        signal.pthread_kill(receiver.ident, signal.SIGINT)  # wakes sigwait, which sees done
        receiver.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        signal.signal(signal.SIGINT, previous_handler)
        _STOP.clear()
