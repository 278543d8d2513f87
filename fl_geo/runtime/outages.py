"""The dispatcher's side of the run's failure trace: which nodes are down now, and how a loop
waits for, or is woken by, the next repair.

Two sources give the same answers. On a virtual clock the scenario's trace
(``fl_geo.timing.failures``) is replayed by the clock itself: a down node is not live, and when
every live node is down or busy, virtual time moves on to the next repair. On a wall clock with
``run.wall_faults`` the trace makes real faults (``fl_geo.runtime.wall_faults``): a node is down
from its failed job to its repair, and the loop sleeps until then. Without either, no node is
ever down here.

`OutagesMixin` is a base class of `fl_geo.runtime.dispatch.Dispatcher`, apart from it because
none of this touches a message: it reads the clock, the grid's node list, the slot each node
holds in the scenario and whether work is in flight, all of which the dispatcher sets up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from flwr.serverapp import Grid

from fl_geo.runtime import interrupt
from fl_geo.runtime.jobs import Clock, Job
from fl_geo.runtime.wall_faults import WallFaults

__all__ = ["OutagesMixin"]

log = logging.getLogger("fl_geo")


class OutagesMixin:
    """Failure-trace handling for `fl_geo.runtime.dispatch.Dispatcher`, which sets every
    attribute declared here in its ``__init__`` (``slot_of`` and ``wall_faults`` are then set by
    the strategy's loop, ``wake_on_rejoin`` by an asynchronous one)."""

    clock: Clock
    grid: Grid
    slot_of: Callable[[int], int] | None  # the scenario slot a node holds; None: no node has one
    wall_faults: WallFaults | None  # the trace as real faults (wall clock, run.wall_faults)
    _jobs: dict[str, Job]  # in flight
    _rejoined: bool  # a repaired node is back and `take_rejoined` has not said so yet

    def _trace(self) -> bool:
        return self.clock.is_virtual and getattr(self.clock, "failures", None) is not None

    def _slot(self, node: int) -> int:
        return self.slot_of(node) if self.slot_of is not None else -1

    def is_down(self, node: int) -> bool:
        """Whether ``node`` is down now under the failure trace (with a wall clock: only under
        ``run.wall_faults``, between a failed job and the node's repair)."""
        if self.wall_faults is not None:
            return self.wall_faults.is_down(node)
        if not self._trace():
            return False
        slot = self._slot(node)
        return slot >= 0 and self.clock.is_down(slot)  # type: ignore[attr-defined]

    def _next_up(self) -> float | None:
        slots = [s for s in (self._slot(n) for n in self.grid.get_node_ids()) if s >= 0]
        return self.clock.next_up(slots)  # type: ignore[attr-defined]

    def wait_for_repair(self) -> bool:
        """Nothing in flight and nodes down: move virtual time to the next repair (wall faults:
        sleep until it). False when there is no trace, work is still in flight, or no down node
        ever comes back."""
        if self.wall_faults is not None and not self._jobs:
            t_up = self.wall_faults.next_up(sorted(self.grid.get_node_ids()))
            if t_up is None:
                return False
            log.info("every live node is busy or down: waiting %.2f s for a repair (wall faults)",
                     max(0.0, t_up - time.monotonic()))
            while time.monotonic() < t_up:
                interrupt.check()
                time.sleep(min(0.05, max(0.0, t_up - time.monotonic())))
            return True
        if not self._trace() or self._jobs:
            return False
        t_up = self._next_up()
        if t_up is None:
            return False
        log.info("virtual clock moves to %.1f s: a node is repaired", t_up)
        self.clock.advance_to(t_up)
        return True

    def take_rejoined(self) -> bool:
        """True once after `next_event` returned None because a repaired node came back."""
        woke, self._rejoined = self._rejoined, False
        return woke

    def _rejoin_first(self, deadline: float | None) -> bool:
        """Move virtual time to a repair that comes before the next job's finish and ``deadline``."""
        if not self._trace() or (not self._jobs and deadline is None):
            return False
        t_up = self._next_up()
        if t_up is None:
            return False
        due = self.clock.due()
        first = min(self.clock.finish_time(due) if due is not None else math.inf,
                    deadline if deadline is not None else math.inf)
        if not t_up < first:
            return False
        log.info("virtual time %.1f s: a repaired node rejoins", t_up)
        self.clock.advance_to(t_up)
        return True
