"""Where fl-geo's worker processes come from: a fork server that has imported torch once.

Two kinds of process are started many times by one parent: a site's **rank processes** (one per
device, per job: `fl_geo.inner.distributed`, `clients.site_node`) and the sharded parameter
server's **follower processes** (one per shard, and again after a crash: `fl_geo.ps.supervisor`).
Each needs torch, and a rank also ``torch.distributed`` and, as soon as it builds its optimizer,
``torch._dynamo`` (``torch.optim`` imports it on first use). Started with ``spawn`` (or as a new
interpreter), every one imports all of that itself: about 5 CPU-seconds per rank and 3 per
follower on a 2-core CPU machine (torch 2.9 s, ``torch._dynamo`` 2.2 s), paid again by every
rank of every job and by every restart of a follower. The ``forkserver`` start method imports
them once, in a server process started at the first use, and forks each process from it: it then
starts with everything imported, and a process that starts several ranks or followers (a
SuperNode's ClientApp with ``client.devices``, the site-group daemon, a multi-node agent, a
Di-PS leader, a test session) pays the imports once. A crashed follower is back in a fraction
of a second instead of seconds.

Why not ``fork``: the parent may be threaded (a SuperNode, a Ray actor, gRPC) and may have touched
CUDA; a forked copy of such a process can deadlock, and CUDA refuses to run in it. The fork
server is a clean, single-threaded process that never touches a device and has created no gRPC
channel or server (importing ``grpc`` starts nothing): importing torch does not initialise CUDA,
so its children may. Python 3.14 made ``forkserver`` the default on Linux for the same reasons.

Contract: :func:`process_context` returns a multiprocessing context whose ``Process`` objects
behave as ``spawn``'s (the target and its arguments are pickled; nothing else of the parent is
copied). One difference matters: the server's environment and ``sys.path`` are the parent's *when
the server started* (the first use), not when a later process starts. Ranks and followers read
no environment variable that changes between starts: their settings travel in the pickled
arguments (a follower's data-path key among them). A child's parent process is the fork server,
not the process that asked for it, and the server outlives that process while any child it
forked still runs (each child holds the server's "alive" pipe, multiprocessing's design), so a
child must not judge its owner by its parent: a follower watches the supervisor's own process
through a pidfd (``--parent-pid``, `fl_geo.ps.follower_main`; ``tests/test_dataplane.py`` kills a
leader with SIGKILL and sees its follower end), and a rank the process that started it
(`die_with`; ``tests/test_site_group.py`` kills a site group's daemon mid-job). Where the platform
has no fork server (Windows), it is ``spawn``. ``FL_GEO_RANK_START=spawn`` forces ``spawn`` for
ranks and a fresh interpreter for followers. Importable without torch: only
the server imports what ``PRELOAD`` lists. A leaf module (standard library only), so every layer
may use it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import threading
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "RANK_START_ENV", "die_with", "pid_exists", "process_context", "start_method"]

# Imported once by the fork server. Each name is imported by the server itself, never by the
# parent, and a name that fails to import is skipped there (multiprocessing's rule), so a child
# still imports what it needs. None of them initialises CUDA at import (torch keeps it lazy);
# `make gpu-check` runs CUDA ranks forked this way, which no GPU has run yet (2026-11-29). No
# `fl_geo.ps` module is listed: each follower process must import `fl_geo.ps.frames` itself,
# which draws the process's own incarnation id at import.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # torch.optim imports it at the first optimizer: ~2 CPU-s per process
    "grpc",  # the followers' transport; importing it creates no thread, channel or server
    "fl_geo.inner.distributed_rank",
    "fl_geo.inner.site_rank",
)

# "spawn" or "forkserver": overrides the platform's choice (for ranks and followers alike)
RANK_START_ENV = "FL_GEO_RANK_START"


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``; ``FL_GEO_RANK_START`` overrides."""
    wanted = os.environ.get(RANK_START_ENV, "").strip()
    if wanted:
        if wanted not in ("forkserver", "spawn"):
            raise ValueError(f"{RANK_START_ENV}={wanted!r}: expected 'forkserver' or 'spawn'")
        return wanted
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def process_context() -> BaseContext:
    """The multiprocessing context to start rank and follower processes with (see the module
    docstring).

    The preload list is set on this process's fork server before it starts; where the server is
    already running (started by this process earlier, or by the user's own code) it is reused as
    it is, and children import whatever it lacks themselves.
    """
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def pid_exists(pid: int) -> bool:
    """Whether a process numbered ``pid`` exists (``kill(pid, 0)``; one of another user counts).
    It cannot tell a process from a newer one that reused the number: callers that can prefer a
    pidfd (`fl_geo.ps.follower_main`) or ``/proc`` start times (`fl_geo.deploy.processes`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with(pid: int, name: str = "fl-geo-owner-watch") -> None:
    """SIGKILL this process as soon as process ``pid`` ends, however it ends (a daemon thread).

    For a child whose parent is not its owner: a process forked by this module's fork server (its
    parent is the server, which outlives a SIGKILLed owner while any child holds its pipe, so
    ``PR_SET_PDEATHSIG`` never fires), or one forked by fl-geo's app server for a shim. A pidfd
    (Linux 5.3+) becomes readable when ``pid`` ends and cannot mistake a newer process that reused
    the number for it; without one, the number is probed every 0.2 s. ``pid`` already gone: this
    process is killed before the call returns."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):
        fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_exists(pid):
                threading.Event().wait(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    # The watch thread blocks every signal (it inherits the mask it is started with). A signal sent
    # to the process goes to any one thread that does not block it, and a Python handler runs in
    # the main thread but only interrupts a blocking call (sleep, recv, a gRPC wait) of the thread
    # the kernel chose: a SIGTERM the shim forwarded to a sleeping child was once taken by this
    # thread, and the child slept on (a make test, tests/test_warm_apps.py, 30 s timeout).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=wait, name=name, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
