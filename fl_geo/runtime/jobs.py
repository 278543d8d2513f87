"""What the dispatcher and the strategies say to each other about work: a `Job` in flight, the
`JobTiming` a virtual clock needs to place it, the `Event` that resolves it, the two errors the
dispatcher itself gives a job (`NODE_DOWN`, `TIMED_OUT`), and the `Clock` that orders events.

These types live apart from `fl_geo.runtime.dispatch` so that code which only reads jobs and
events (the synchronous-round helper ``fl_geo.runtime.rounds``, a strategy's reply handling) does
not need the dispatcher's push/pull machinery; ``fl_geo.runtime.dispatch`` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from flwr.app import Message

from fl_geo.runtime.wall_faults import Fault

__all__ = ["NODE_DOWN", "TIMED_OUT", "Clock", "Event", "Job", "JobTiming"]

# The error of a job lost because its node failed under the scenario's failure trace.
NODE_DOWN = "node down (failure trace)"
# The error of a job given up at its deadline (no reply in time; the node is alive but late).
TIMED_OUT = "no reply within the deadline"


class Clock(Protocol):
    """What the dispatcher needs from ``fl_geo.timing.clock.WallClock`` / ``VirtualClock``."""

    is_virtual: bool

    def now(self) -> float: ...
    def schedule(self, job_id: str, node: int, start: float | None = None, *, steps: int,
                 bytes_down: int, bytes_up: int, peer_region: str | int | None = None,
                 traced: bool = True) -> float: ...
    def due(self) -> str | None: ...
    def finish_time(self, job_id: str) -> float: ...
    def complete(self, job_id: str) -> float: ...
    def cancel(self, job_id: str) -> None: ...
    def advance_to(self, t: float) -> None: ...
    def lost(self, job_id: str) -> bool: ...


@dataclass(frozen=True)
class JobTiming:
    """What a virtual clock needs to know about a job when it is dispatched."""

    slot: int  # the node's index in the scenario (its partition id)
    steps: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    peer_region: str | None = None  # where the server it talks to sits (None: the scenario's server)
    # a measurement (evaluation) that costs no modelled time: on a virtual clock it finishes at
    # dispatch, so asking for a figure does not move the time axis the figure is plotted against
    free: bool = False


@dataclass
class Job:
    """One message in flight to one node."""

    id: str
    node: int
    kind: str
    seq: int
    submitted_at: float
    meta: dict[str, Any] = field(default_factory=dict)
    slot: int = -1  # the scenario node it runs on (JobTiming.slot)
    compute_s: float = 0.0  # its modelled compute time (virtual clock; for goodput)
    fault: Fault | None = None  # a wall fault ends it (run.wall_faults)
    steps: int = 0  # inner steps (JobTiming.steps): jobs are compared with those of the same kind and steps
    sent_wall: float = 0.0  # time.monotonic() when it was pushed: its deadline runs from here
    timeout_s: float | None = None  # its own wall deadline (run_jobs(timeout_s=...)); None: the dispatcher's rule


@dataclass
class Event:
    """A job resolved: a reply, an error reply, or its node vanished (``reply`` is then None)."""

    job: Job
    reply: Message | None
    error: str | None
    time: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.reply is not None
