"""How long the server waits for a job's reply before it counts the node as late.

A node can stay connected (its heartbeats keep it in the grid) and never answer. Without a bound
a synchronous round waits for it forever, and an asynchronous run never gets through its final
drain. A fixed timeout has to be guessed per deployment: too short and a slow but healthy site is
cut off every round, too long and a hung one costs the whole budget. So the default bound is
derived from what the run has seen:

    deadline = max(floor_s, factor × median of the recent durations of comparable jobs)

where a job's duration is the wall time from sending it to receiving its reply, and comparable
means the same kind of job (message type) with the same number of inner steps (an EDiT warm-up
round of one step says nothing about a round of 500). Before any comparable job has replied the
deadline is ``first_s`` (start-up, data loading and the first compiled step all fall in the first
jobs); ``first_s = 0`` waits without limit until one has. An explicit ``explicit_s > 0`` (the
operator's ``strategy.round_timeout_s``) replaces the rule for every job. ``factor = 0`` turns the
rule off: jobs wait as long as it takes (the behaviour before this module).

The bound concerns wall time, what a real hang costs, never the modelled (virtual) time of a
scenario. Nothing here knows about Flower: the dispatcher feeds it durations and asks it for
deadlines (``fl_geo.runtime.dispatch``); `LateLog` keeps who was late for the run summary.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

# How many recent durations of one kind of job the median is taken over: enough that one odd
# job does not move it, few enough that it follows a federation that slows down as a whole.
WINDOW = 64


class ReplyDeadline:
    """Wall seconds a job may take before it is given up, derived from observed job durations.

    ``key`` identifies comparable jobs (the dispatcher uses ``(message type, inner steps)``).
    `seconds` returns ``math.inf`` for "no deadline".
    """

    def __init__(self, factor: float = 10.0, floor_s: float = 300.0, first_s: float = 3600.0,
                 explicit_s: float = 0.0, window: int = WINDOW) -> None:
        if not all(math.isfinite(x) and x >= 0 for x in (factor, floor_s, first_s, explicit_s)):
            raise ValueError(f"deadline settings must be finite and >= 0, got factor={factor}, floor_s={floor_s}, "
                             f"first_s={first_s}, explicit_s={explicit_s}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.factor = float(factor)
        self.floor_s = float(floor_s)
        self.first_s = float(first_s)
        self.explicit_s = float(explicit_s)
        self.window = int(window)
        self._seen: dict[Hashable, deque[float]] = {}
        self._median: dict[Hashable, float] = {}  # cached: asked at every poll, changed at every reply

    @property
    def active(self) -> bool:
        """Whether any job can ever be given up under this rule."""
        return self.explicit_s > 0 or self.factor > 0

    def observe(self, key: Hashable, seconds: float) -> None:
        """Record that a job of ``key`` replied after ``seconds`` of wall time (ignored if not finite
        or negative: a clock step must not poison the median)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        seen = self._seen.setdefault(key, deque(maxlen=self.window))
        seen.append(float(seconds))
        self._median[key] = statistics.median(seen)

    def median(self, key: Hashable) -> float | None:
        """The median duration of the recent replied jobs of ``key``; None before the first one."""
        return self._median.get(key)

    def seconds(self, key: Hashable) -> float:
        """How long a job of ``key`` may take: the explicit bound, else the derived one."""
        if self.explicit_s > 0:
            return self.explicit_s
        if self.factor <= 0:
            return math.inf
        median = self._median.get(key)
        if median is None:
            return self.first_s if self.first_s > 0 else math.inf
        return max(self.floor_s, self.factor * median)


@dataclass
class LateNode:
    """One node's record of lateness: jobs given up at their deadline, and late replies seen."""

    node: int
    late_jobs: int = 0
    late_replies: int = 0  # replies that came after their job was given up (discarded)
    waited_s: list[float] = field(default_factory=list)  # the deadline each given-up job had


class LateLog:
    """Who was late over a run, in the order they were first late (for summary.json)."""

    def __init__(self) -> None:
        self._nodes: dict[int, LateNode] = {}

    def gave_up(self, node: int, waited_s: float) -> LateNode:
        """A job of ``node`` was given up after ``waited_s`` wall seconds without a reply."""
        rec = self._nodes.setdefault(node, LateNode(node))
        rec.late_jobs += 1
        rec.waited_s.append(float(waited_s))
        return rec

    def replied_late(self, node: int) -> None:
        """A reply of ``node`` came for a job already given up (it is discarded)."""
        self._nodes.setdefault(node, LateNode(node)).late_replies += 1

    def nodes(self) -> list[LateNode]:
        """The late nodes, first-late first."""
        return list(self._nodes.values())

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)
