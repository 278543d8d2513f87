"""Failure traces: when each node of a scenario is down, on the virtual time axis.

A scenario's failure fields (``failures``: explicit node or whole-region outages;
``failure_process``: a seeded per-node process of exponential up-times of mean ``mtbf_s`` and
repairs of ``repair_s``) expand into one deterministic timeline of down intervals
``[down_at, up_at)`` per node. The timeline depends only on the scenario (its seed included),
never on the run, so a trace replays identically; the virtual clock asks it whether a job
outlives its node (``first_down``), whether a node is live (``is_down``) and when it is back
(``up_at``). A node is down at ``down_at`` and up again at ``up_at``; ``up_at = inf`` is for good.

The process is drawn lazily (it has no end) from one ``random.Random`` per node seeded with
``(seed, node)``: node k's failures do not depend on how many nodes a run keeps, nor on the
order in which the clock asks about nodes or times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from fl_geo.timing.scenario import Scenario
from fl_geo.timing.scenario_spec import FailureProcessSpec

__all__ = ["FailureTimeline", "merge_intervals"]

Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted union of half-open intervals; touching ones (``[a, b)``, ``[b, c)``) are joined."""
    out: list[Interval] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class _Process:
    """One node's lazily drawn failure process: ``(down, up)`` pairs in time order."""

    def __init__(self, spec: FailureProcessSpec, node: int) -> None:
        self._spec = spec
        self._rng = random.Random(f"fl-geo-failures/{spec.seed}/{node}")  # str seeds are stable
        self.intervals: list[Interval] = []
        self._t = 0.0  # end of the last repair

    def extend_past(self, t: float) -> None:
        """Draw until the last failure starts after ``t``."""
        while not self.intervals or self.intervals[-1][0] <= t:
            down = self._t + self._rng.expovariate(1.0 / self._spec.mtbf_s)
            repair = self._spec.repair_s
            if self._spec.repair == "exponential":
                repair = self._rng.expovariate(1.0 / repair)
            self.intervals.append((down, down + repair))
            self._t = down + repair


class FailureTimeline:
    """Down intervals per node slot (partition id); answers the virtual clock's questions."""

    def __init__(
        self, num_nodes: int, fixed: dict[int, list[Interval]] | None = None,
        process: FailureProcessSpec | None = None,
    ) -> None:
        self.num_nodes = num_nodes
        self._fixed = {n: merge_intervals(iv) for n, iv in (fixed or {}).items() if iv}
        self._process: dict[int, _Process] = {}
        if process is not None and process.mtbf_s > 0:
            for n in process.nodes or range(num_nodes):
                self._process[n] = _Process(process, n)
        self._merged: dict[int, tuple[float, list[Interval]]] = {}  # node -> (valid below, union)

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> FailureTimeline | None:
        """The scenario's trace, or None when it models no failure (the clock then skips every check)."""
        fixed: dict[int, list[Interval]] = {}
        for f in scenario.failures:
            end = math.inf if f.duration is None else f.at_time + f.duration
            nodes = [f.node] if not f.region else [
                n for n in range(scenario.num_nodes) if scenario.node_region(n) == f.region]
            for n in nodes:
                fixed.setdefault(n, []).append((f.at_time, end))
        process = scenario.failure_process
        if not fixed and process.mtbf_s == 0:
            return None
        return cls(scenario.num_nodes, fixed, process)

    # ---- the union of explicit and process outages -------------------------------------------------
    def _union(self, node: int, t: float) -> list[Interval]:
        """The node's merged down intervals, exact for every interval that starts at or before ``t``."""
        cached = self._merged.get(node)
        if cached is not None and t < cached[0]:
            return cached[1]
        horizon = max(2.0 * t, t + 1.0, cached[0] * 2.0 if cached else 0.0)
        fixed = self._fixed.get(node, [])
        proc = self._process.get(node)
        if proc is None:
            merged = fixed
        else:
            proc.extend_past(horizon)
            merged = merge_intervals([*fixed, *proc.intervals])
            # a merged outage can swallow process failures drawn beyond the horizon: draw on until
            # the outage that reaches furthest ends before the last drawn failure starts
            while True:
                reach = max((hi for lo, hi in merged if lo <= horizon), default=0.0)
                if math.isinf(reach) or reach < proc.intervals[-1][0]:
                    break
                proc.extend_past(reach)
                merged = merge_intervals([*fixed, *proc.intervals])
        self._merged[node] = (horizon, merged)
        return merged

    def intervals(self, node: int, until: float) -> list[Interval]:
        """The node's down intervals that start before ``until``, merged, in time order."""
        return [iv for iv in self._union(node, until) if iv[0] < until]

    def is_down(self, node: int, t: float) -> bool:
        return any(lo <= t < hi for lo, hi in self._union(node, t))

    def up_at(self, node: int, t: float) -> float:
        """When a node down at ``t`` is back (inf: for good); ``t`` itself when it is up."""
        for lo, hi in self._union(node, t):
            if lo <= t < hi:
                return hi
        return t

    def first_down(self, node: int, start: float, finish: float) -> float | None:
        """The failure that ends a job running over ``[start, finish)`` on ``node``: ``start`` when
        the node is already down, the first ``down_at`` in ``(start, finish)``, else None (a node
        failing exactly at ``finish`` has delivered)."""
        for lo, hi in self._union(node, finish):
            if lo <= start < hi:
                return start
            if start < lo < finish:
                return lo
        return None

    def uptime(self, node: int, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1)`` during which the node is up."""
        if t1 <= t0:
            return 0.0
        down = sum(max(0.0, min(hi, t1) - max(lo, t0)) for lo, hi in self._union(node, t1) if lo < t1)
        return (t1 - t0) - down

    def events(self, until: float) -> list[tuple[float, int, str]]:
        """Every ``(time, node, 'down'|'up')`` before ``until``, in time order (ties by node)."""
        out = []
        for n in range(self.num_nodes):
            for lo, hi in self.intervals(n, until):
                out.append((lo, n, "down"))
                if hi < until:
                    out.append((hi, n, "up"))
        return sorted(out)
