"""The link-level pieces of the timing model: time-varying link windows and the all-reduce ring.

Two computations over the scenario's region-by-region bandwidth and latency matrices that need
nothing else from a scenario: how long bits take to flow through links whose bandwidth changes
at window boundaries (:func:`_flow`, with :class:`_Window` selecting the transfers a
``link_windows`` entry slows), and which region order an all-reduce ring should take
(:func:`_best_region_ring`). :class:`fl_geo.timing.scenario.Scenario` owns the matrices and the
per-scenario ring cache and calls these; keeping them here leaves the scenario module to the
node, compute and job model. Region arguments are indices into the scenario's ``regions``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from fl_geo.timing.scenario_spec import LinkWindowSpec

__all__ = ["EXACT_RING_MAX_REGIONS", "Ring"]

# Up to this many distinct regions the best all-reduce ring is found by enumerating every ring
# ((R-1)! orders: 5,040 at R = 8); beyond it a greedy heuristic picks one (see Scenario.best_ring).
EXACT_RING_MAX_REGIONS = 8


class Ring(NamedTuple):
    """The all-reduce ring chosen for a set of nodes: its bottleneck bandwidth and latency."""

    regions: tuple[str, ...]  # inter-region visiting order (the ring closes back to the first)
    bandwidth_gbps: float  # slowest link of the ring (intra-region links included)
    latency_s: float  # largest latency of the ring's links
    exact: bool  # False when found by the greedy heuristic (> EXACT_RING_MAX_REGIONS regions)


@dataclass(frozen=True)
class _Window:
    """A validated link window with its selector resolved to indices."""

    node: int  # -1: not a node window
    region: int  # -1: not a region window
    link: tuple[int, int] | None  # region indices, unordered
    at: float
    until: float
    factor: float
    extra_latency_s: float

    @classmethod
    def from_spec(cls, w: LinkWindowSpec, region_index: dict[str, int]) -> _Window:
        link = tuple(sorted(region_index[r] for r in w.link)) if w.link else None
        return cls(w.node, region_index[w.region] if w.region else -1, link,  # type: ignore[arg-type]
                   float(w.at_time), float(w.until_time), float(w.bandwidth_factor), float(w.extra_latency_s))

    def is_open(self, t: float) -> bool:
        return self.at <= t < self.until

    def matches(self, src: int, dst: int, node: int | None) -> bool:
        """Whether a transfer ``src -> dst`` (region indices) of ``node`` is selected."""
        if self.node >= 0:
            return node == self.node
        if self.region >= 0:
            return self.region in (src, dst)
        return self.link == tuple(sorted((src, dst)))

    def matches_ring_link(self, a: int, b: int, nodes: list[int], node_region: list[int]) -> bool:
        """Whether the all-reduce ring's link ``a - b`` (region indices) is selected."""
        if self.node >= 0:
            return self.node in nodes and node_region[self.node] in (a, b)
        return self.matches(a, b, None)


def _flow(t: float, bits: float, rate: Any, windows: list[_Window]) -> float:
    """When ``bits`` that start flowing at ``t`` are through, at ``rate(x)`` bits/s (piecewise
    constant, changing only at the ``windows``' boundaries)."""
    bounds = sorted({b for w in windows for b in (w.at, w.until) if math.isfinite(b)})
    while True:
        r = rate(t)
        if bits <= 0 or math.isinf(r):
            return t
        nxt = next((b for b in bounds if b > t), math.inf)
        if bits <= r * (nxt - t):
            return t + bits / r
        bits -= r * (nxt - t)
        t = nxt


def _best_region_ring(
    regions: tuple[int, ...], bw: list[list[float]], lat: list[list[float]]
) -> tuple[tuple[int, ...], float, float, bool]:
    """Best inter-region ring over ``regions``: (order, min bandwidth, max latency, exact)."""
    if len(regions) == 1:
        return (regions, math.inf, 0.0, True)
    if len(regions) <= EXACT_RING_MAX_REGIONS:
        first, rest = regions[0], regions[1:]
        best: tuple[tuple[int, ...], float, float] | None = None
        for perm in itertools.permutations(rest):
            order = (first, *perm)
            ring_bw, ring_lat = _ring_links(order, bw, lat)
            if best is None or (ring_bw, -ring_lat) > (best[1], -best[2]):
                best = (order, ring_bw, ring_lat)
        assert best is not None
        return (*best, True)
    best = None
    for start in regions:
        order_l = [start]
        left = set(regions) - {start}
        while left:
            cur = order_l[-1]
            nxt = max(sorted(left), key=lambda r, c=cur: (bw[c][r], -lat[c][r]))
            order_l.append(nxt)
            left.discard(nxt)
        ring_bw, ring_lat = _ring_links(tuple(order_l), bw, lat)
        if best is None or (ring_bw, -ring_lat) > (best[1], -best[2]):
            best = (tuple(order_l), ring_bw, ring_lat)
    assert best is not None
    return (*best, False)


def _ring_links(order: tuple[int, ...], bw: list[list[float]], lat: list[list[float]]) -> tuple[float, float]:
    """The slowest bandwidth and the largest latency of the closed ring ``order``."""
    links = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
    return min(bw[a][b] for a, b in links), max(lat[a][b] for a, b in links)
