"""Clocks: what decides the order in which replies are handed to a strategy, and what "time" is.

Two implementations of one interface (the ``Clock`` protocol of :mod:`fl_geo.runtime.jobs`):

- :class:`WallClock` (deployment, plain simulation): time is real elapsed time and replies are
  handed over as they arrive; the clock cannot predict anything, so ``due()`` is ``None`` and
  ``finish_time`` is NaN.
- :class:`VirtualClock` (comparisons on a laptop): each job's finish time is computed *when it is
  dispatched* from a :class:`~fl_geo.timing.scenario.Scenario` (downlink + steps × step time + uplink),
  and the dispatcher hands a reply over only when its job is :meth:`VirtualClock.due`, i.e. every
  job that finishes earlier in virtual time has been handed over already. The event order, and
  hence the trained model, then depends only on the seed and the scenario, never on which real
  process happened to finish first; "time-to-loss" is modelled WAN time (docs/algorithms.md §8).

Both keep ``now()`` monotone and can be checkpointed (``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fl_geo.timing.failures import FailureTimeline
from fl_geo.timing.scenario import JobTime, Scenario

__all__ = ["VirtualClock", "WallClock"]


class WallClock:
    """Real elapsed seconds; replies are handed over in arrival order.

    Jobs are tracked only so that ``pending()`` and double completions are honest; their
    finish times are unknown until they arrive.
    """

    is_virtual = False
    failures: FailureTimeline | None = None  # a failure trace lives on the virtual time axis only

    def __init__(self, time_fn: Callable[[], float] = time.monotonic) -> None:
        self._time_fn = time_fn
        self._t0 = time_fn()
        self._jobs: dict[str, int] = {}

    def now(self) -> float:
        """Seconds since the clock was created (or since the checkpointed run started)."""
        return self._time_fn() - self._t0

    def schedule(
        self, job_id: str, node: int, start: float | None = None, *,
        steps: int = 0, bytes_down: int = 0, bytes_up: int = 0, peer_region: str | int | None = None,
        traced: bool = True,
    ) -> float:
        """Record a dispatched job; returns NaN (a real job's finish time is not known in advance)."""
        if job_id in self._jobs:
            raise ValueError(f"job '{job_id}' is already pending")
        self._jobs[job_id] = node
        return math.nan

    def due(self) -> str | None:
        """No prediction: any reply that has arrived may be handed over (see :meth:`is_due`)."""
        return None

    def is_due(self, job_id: str) -> bool:
        """With wall time a pending job's reply may be handed over as soon as it arrives."""
        return job_id in self._jobs

    def finish_time(self, job_id: str) -> float:
        if job_id not in self._jobs:
            raise KeyError(f"job '{job_id}' is not pending")
        return math.nan

    def complete(self, job_id: str) -> float:
        """The reply arrived: forget the job and return the arrival time."""
        if self._jobs.pop(job_id, None) is None:
            raise KeyError(f"job '{job_id}' is not pending (never scheduled, completed or cancelled)")
        return self.now()

    def cancel(self, job_id: str) -> None:
        """The node vanished or the job was abandoned; unknown ids are ignored (idempotent)."""
        self._jobs.pop(job_id, None)

    def lost(self, job_id: str) -> bool:
        """Wall time has no failure trace: real faults arrive as error replies or vanished nodes."""
        return False

    def pending(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def advance_to(self, t: float) -> None:
        """Real time cannot be advanced; server-side costs are simply spent. A no-op."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Elapsed time only: jobs in flight do not survive a restart."""
        return {"kind": "wall", "now": self.now()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the time axis of a checkpointed run (``now()`` resumes at the saved value)."""
        if state.get("kind") != "wall":
            raise ValueError(f"not a WallClock state (kind={state.get('kind')!r})")
        self._t0 = self._time_fn() - float(state["now"])
        self._jobs.clear()


@dataclass(frozen=True)
class _Job:
    node: int
    seq: int
    start: float
    finish: float
    lost: bool = False  # its node fails at ``finish``: the job ends there without a result


def _key(finish: float) -> int:
    """Ordering key: the finish time on a 1 ns grid, so that times that differ only by rounding
    noise (0.1 + 0.2 vs 0.3) count as ties and fall to the node-index rule."""
    return round(finish * 1e9)


class VirtualClock:
    """Modelled time from a scenario; jobs are handed over in virtual-finish order.

    Order: smallest finish time (1 ns grid) first, ties by node index (server-side events
    scheduled with :meth:`schedule_at` and ``node=-1`` first), then by dispatch sequence. A heap
    with lazy deletion: O(log n) per schedule / complete / cancel.

    What a job costs in bytes and seconds is the cost model's answer
    (:class:`fl_geo.timing.cost.CostModel`); the clock only orders the finish times.

    Failures (``fl_geo.timing.failures``): when the scenario models a failure trace, a job whose
    node goes down before its modelled finish is *lost*: its finish time becomes the failure time
    and :meth:`lost` says so, so the dispatcher hands it over at that moment as a failed job,
    never as a reply. :meth:`is_down` and :meth:`next_up` tell who is live in virtual time.
    """

    is_virtual = True

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self._now = 0.0
        self._seq = 0
        self._jobs: dict[str, _Job] = {}
        self._heap: list[tuple[int, int, int, str]] = []
        self._stale = 0
        self.failures: FailureTimeline | None = FailureTimeline.from_scenario(scenario)

    # ---- time ----
    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Move time forward to ``t`` (e.g. after a modelled outer step); never backwards."""
        if not math.isfinite(t):
            raise ValueError(f"cannot advance a virtual clock to {t}")
        self._now = max(self._now, float(t))

    # ---- jobs ----
    def schedule(
        self, job_id: str, node: int, start: float | None = None, *,
        steps: int, bytes_down: int, bytes_up: int, peer_region: str | int | None = None,
        traced: bool = True,
    ) -> float:
        """Fix a job's finish time at dispatch and return it.

        ``finish = start + transfer(server -> node) + steps * step_time(node) + transfer(node ->
        server)``, ``start`` defaulting to ``now()``. ``peer_region`` is the region of the server
        the node talks to (default the scenario's ``server_region``; a HALoS local server sits in
        the node's own region). ``traced=False`` exempts the job from the failure trace (a control
        message such as the profile query, which is not work a failure can lose).
        """
        t0 = self._now if start is None else float(start)
        if not math.isfinite(t0):
            raise ValueError(f"job '{job_id}': start must be finite, got {start}")
        if bytes_down < 0 or bytes_up < 0:
            raise ValueError(f"job '{job_id}': byte counts must be >= 0")
        jt: JobTime = self.scenario.job_time(node, steps, bytes_down, bytes_up, peer_region, start=t0)
        finish = t0 + jt.total
        if self.failures is not None and traced:
            down = self.failures.first_down(node, t0, finish)
            if down is not None:  # the node fails first: the job ends there, without a result
                return self._push(job_id, node, t0, down, lost=True)
        return self._push(job_id, node, t0, finish)

    def schedule_at(self, job_id: str, finish: float, *, node: int = -1) -> float:
        """Schedule an event with a known finish time, e.g. a HALoS local->global server
        transfer (``now() + scenario.transfer_time(...)``). ``node=-1`` (server side) wins ties
        against nodes' jobs."""
        if not math.isfinite(finish):
            raise ValueError(f"job '{job_id}': finish must be finite, got {finish}")
        return self._push(job_id, node, self._now, float(finish))

    def _push(self, job_id: str, node: int, start: float, finish: float, lost: bool = False) -> float:
        if job_id in self._jobs:
            raise ValueError(f"job '{job_id}' is already pending")
        seq = self._seq
        self._seq += 1
        self._jobs[job_id] = _Job(node, seq, start, finish, lost)
        heapq.heappush(self._heap, (_key(finish), node, seq, job_id))
        return finish

    def _top(self) -> tuple[int, int, int, str] | None:
        heap = self._heap
        while heap:
            _, _, seq, job_id = heap[0]
            job = self._jobs.get(job_id)
            if job is not None and job.seq == seq:
                return heap[0]
            heapq.heappop(heap)  # completed or cancelled out of order
            self._stale -= 1
        return None

    def due(self) -> str | None:
        """The unfinished job that finishes first, or None when nothing is pending."""
        top = self._top()
        return None if top is None else top[3]

    def is_due(self, job_id: str) -> bool:
        return job_id == self.due()

    def finish_time(self, job_id: str) -> float:
        return self._get(job_id).finish

    def start_time(self, job_id: str) -> float:
        return self._get(job_id).start

    def lost(self, job_id: str) -> bool:
        """True when the job's node fails before the job finishes (its finish time is the failure)."""
        return self._get(job_id).lost

    # ---- failures ----
    def is_down(self, node: int, t: float | None = None) -> bool:
        """Whether scenario node ``node`` is down at ``t`` (default: now) under the failure trace."""
        if self.failures is None or not 0 <= node < self.failures.num_nodes:
            return False
        return self.failures.is_down(node, self._now if t is None else t)

    def next_up(self, nodes: list[int]) -> float | None:
        """The earliest time one of ``nodes`` that is down now comes back; None when none will."""
        if self.failures is None:
            return None
        times = [self.failures.up_at(n, self._now) for n in nodes if self.is_down(n)]
        finite = [t for t in times if math.isfinite(t)]
        return min(finite) if finite else None

    def complete(self, job_id: str) -> float:
        """Hand a job over: ``now`` moves to its finish time (never backwards); returns ``now``.

        Completing a job that is not :meth:`due` is allowed (a synchronous round may collect
        all of its replies at once); time still only moves forward.
        """
        job = self._get(job_id)
        top = self._top()
        del self._jobs[job_id]
        if top is not None and top[3] == job_id:
            heapq.heappop(self._heap)
        else:
            self._drop_later()
        self._now = max(self._now, job.finish)
        return self._now

    def cancel(self, job_id: str) -> None:
        """Forget a job whose node vanished (or that was abandoned); unknown ids are ignored."""
        if self._jobs.pop(job_id, None) is not None:
            self._drop_later()

    def _drop_later(self) -> None:
        """Account for a heap entry left behind; rebuild when stale entries dominate."""
        self._stale += 1
        if self._stale > 32 and self._stale > len(self._jobs):
            self._heap = [(_key(j.finish), j.node, j.seq, jid) for jid, j in self._jobs.items()]
            heapq.heapify(self._heap)
            self._stale = 0

    def _get(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"job '{job_id}' is not pending (never scheduled, completed or cancelled)")
        return job

    def pending(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: time, sequence counter and the pending jobs."""
        jobs = sorted(self._jobs.items(), key=lambda kv: kv[1].seq)
        return {
            "kind": "virtual",
            "scenario": self.scenario.name,
            "now": self._now,
            "seq": self._seq,
            "jobs": [
                {"id": jid, "node": j.node, "seq": j.seq, "start": j.start, "finish": j.finish,
                 **({"lost": True} if j.lost else {})}
                for jid, j in jobs
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint taken under the same scenario (finish times were modelled by it)."""
        if state.get("kind") != "virtual":
            raise ValueError(f"not a VirtualClock state (kind={state.get('kind')!r})")
        if state.get("scenario") != self.scenario.name:
            raise ValueError(
                f"clock state was saved under scenario '{state.get('scenario')}', "
                f"this clock models '{self.scenario.name}'"
            )
        self._now = float(state["now"])
        self._seq = int(state["seq"])
        self._jobs = {
            str(j["id"]): _Job(int(j["node"]), int(j["seq"]), float(j["start"]), float(j["finish"]),
                               bool(j.get("lost", False)))
            for j in state["jobs"]
        }
        self._heap = [(_key(j.finish), j.node, j.seq, jid) for jid, j in self._jobs.items()]
        heapq.heapify(self._heap)
        self._stale = 0
