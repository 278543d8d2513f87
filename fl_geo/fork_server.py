"""Where a site's rank processes come from: a fork server that has imported torch once.

A rank is a fresh process (one per device) that needs torch, ``torch.distributed`` and, as soon
as it builds its optimizer, ``torch._dynamo`` (``torch.optim`` imports it on first use). With the
``spawn`` start method every rank imports all of that itself: about 5 CPU-seconds per rank on a
2-core CPU machine (torch 2.9 s, ``torch._dynamo`` 2.2 s), paid again by every rank of every job.
The ``forkserver`` start method imports them once, in a server process started at the first job,
and forks each rank from it: a rank then starts with everything imported, and a process that
starts several ranks, or ranks for several jobs (a SuperNode's ClientApp with ``client.devices``,
the site-group daemon, a multi-node agent, a test session), pays the imports once.

Why not ``fork``: the parent may be threaded (a SuperNode, a Ray actor, gRPC) and may have touched
CUDA; a forked copy of such a process can deadlock, and CUDA refuses to run in it. The fork
server is a clean, single-threaded process that never touches a device: importing torch does not
initialise CUDA, so its children may. Python 3.14 made ``forkserver`` the default on Linux for the
same reasons.

Contract: :func:`rank_context` returns a multiprocessing context whose ``Process`` objects behave
as ``spawn``'s (the target and its arguments are pickled; nothing else of the parent is copied).
One difference matters: the server's environment and ``sys.path`` are the parent's *when the
server started* (the first job), not when a later rank starts. The ranks read no environment
variable that changes between jobs; their settings travel in the pickled job. A rank's parent
process is the fork server, which exits as soon as the process that started it exits (its pipe
to that process closes, also on SIGKILL), so a rank that asks to die with its parent
(``PR_SET_PDEATHSIG``, `fl_geo.inner.site_rank`) still dies with the process that owns it
(``tests/test_site_nodes.py`` checks it for a node's agent). Where the platform has no fork
server (Windows), it is ``spawn``. ``FL_GEO_RANK_START=spawn`` forces ``spawn``. Importable
without torch: only the server imports what ``PRELOAD`` lists.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "RANK_START_ENV", "rank_context", "start_method"]

# Imported once by the fork server. Each name is imported by the server itself, never by the
# parent, and a name that fails to import is skipped there (multiprocessing's rule), so a rank
# still imports what it needs. None of them initialises CUDA at import (torch keeps it lazy);
# `make gpu-check` runs CUDA ranks forked this way, which no GPU has run yet (2026-11-29).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # torch.optim imports it at the first optimizer: ~2 CPU-s per process
    "fl_geo.inner.distributed_rank",
    "fl_geo.inner.site_rank",
)

RANK_START_ENV = "FL_GEO_RANK_START"  # "spawn" or "forkserver": overrides the platform's choice


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``; ``FL_GEO_RANK_START`` overrides."""
    wanted = os.environ.get(RANK_START_ENV, "").strip()
    if wanted:
        if wanted not in ("forkserver", "spawn"):
            raise ValueError(f"{RANK_START_ENV}={wanted!r}: expected 'forkserver' or 'spawn'")
        return wanted
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def rank_context() -> BaseContext:
    """The multiprocessing context to start rank processes with (see the module docstring).

    The preload list is set on this process's fork server before it starts; where the server is
    already running (started by this process earlier, or by the user's own code) it is reused as
    it is, and ranks import whatever it lacks themselves.
    """
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
