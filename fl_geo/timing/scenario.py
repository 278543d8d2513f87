"""Scenarios: the modelled hardware and WAN a virtual-clock run pretends to have.

A laptop simulation trains a small proxy model on one CPU, yet methods must be compared by the
time they would take across real datacenters. A scenario supplies what that time depends on
(docs/algorithms.md §1, §6, §8): the regions and the bandwidth/latency between them, which region the
parameter server sits in, each node's region and relative speed, the Di-PS η speed spread, and
the *modelled* model (parameter count and base step time). Modelling e.g. Pythia-70M's 70 M
parameters and 238 ms steps keeps the communication/compute ratio of the paper even though the
proxy model being trained is a thousand times smaller.

Scenarios are YAML files in ``configs/scenarios/`` that `fl_geo.scenario_files` reads into the
``*Spec`` dataclasses below (this module reads no files and needs no omegaconf), then validated
into a :class:`Scenario`, which answers the timing questions
(``step_time``, ``transfer_time``, ``job_time``, ring all-reduce) that :mod:`fl_geo.timing.clock` and
the strategies ask. Node index = partition id = the Flower node's ``partition-id``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fl_geo.errors import ConfigError

__all__ = [
    "BYTES_PER_PARAM",
    "EXACT_RING_MAX_REGIONS",
    "FailureProcessSpec",
    "FailureSpec",
    "HeterogeneitySpec",
    "JobTime",
    "LinkWindowSpec",
    "LinksSpec",
    "ModelSpec",
    "NodeSpec",
    "Ring",
    "Scenario",
    "ScenarioError",
    "ScenarioSpec",
    "payload_bytes",
    "scenario_for_nodes",
]

# Bytes per parameter of a model-sized payload on the wire (the outer state is always fp32).
BYTES_PER_PARAM: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
SPREADS = ("even", "random")
REPAIRS = ("fixed", "exponential")
# Up to this many distinct regions the best all-reduce ring is found by enumerating every ring
# ((R-1)! orders: 5,040 at R = 8); beyond it a greedy heuristic picks one (see Scenario.best_ring).
EXACT_RING_MAX_REGIONS = 8
# Relative slack when rounding step counts up: 0.3/0.1 is 2.9999999999999996 in floating point
# and 0.7/0.1*... can land a hair above an integer; neither may cost a whole extra step.
_CEIL_SLACK = 1e-9



class ScenarioError(ConfigError):
    """A scenario is invalid or missing; the message names the key (or file) and why."""


# ---- schema (omegaconf structured configs) ------------------------------------------------------


@dataclass
class NodeSpec:
    """One node (datacenter / cluster / worker); its list index is its partition id."""

    region: str = ""
    speed: float = 1.0  # relative throughput; a node at model.reference_speed takes step_time_s
    name: str = ""
    accelerator: str = ""


@dataclass
class LinksSpec:
    """Region-to-region links, rows/columns in ``regions`` order (row = sender, column = receiver).

    Each matrix is either full (R rows of R values, may be asymmetric) or the upper triangle of a
    symmetric one (row i holds the R-i values from the diagonal rightwards). The diagonal is the
    intra-region link, used between nodes (or a node and a server) in the same region.
    """

    bandwidth_gbps: list[list[float]] = field(default_factory=list)  # Gbit/s, > 0 (.inf allowed)
    latency_s: list[list[float]] = field(default_factory=list)  # seconds, empty = all 0


@dataclass
class ModelSpec:
    """The model whose *time* is modelled (not necessarily the proxy that is trained)."""

    name: str = ""
    num_params: int = 0  # 0 = use the real (trained) model's parameter count
    step_time_s: float = 0.0  # seconds per inner step of a node whose speed is reference_speed
    reference_speed: float = 1.0


@dataclass
class HeterogeneitySpec:
    """Di-PS η: an injected per-node slow-down of 0..η % of a step (docs/algorithms.md §8)."""

    eta_percent: float = 0.0
    spread: str = "even"  # even: evenly spaced over the nodes; random: uniform draws in [0, η]
    seed: int = 0  # for spread=random


@dataclass
class FailureSpec:
    """An explicit outage: node ``node`` (or every node of ``region``) is down from ``at_time``
    (virtual s) for ``duration`` s (None = for good). Exactly one of ``node`` and ``region`` is set."""

    node: int = -1  # -1 = not set (a region outage)
    at_time: float = 0.0
    duration: float | None = None
    region: str = ""  # a whole-region outage: every node of this region


@dataclass
class FailureProcessSpec:
    """A seeded failure process per node (fl_geo.timing.failures): up-times drawn from an
    exponential distribution of mean ``mtbf_s``, each followed by a repair of ``repair_s``
    (``repair: fixed``) or of an exponential time of that mean (``repair: exponential``).
    ``mtbf_s = 0`` turns the process off; ``nodes`` empty = every node."""

    mtbf_s: float = 0.0
    repair_s: float = 0.0
    repair: str = "fixed"
    seed: int = 0
    nodes: list[int] = field(default_factory=list)


@dataclass
class LinkWindowSpec:
    """A link slow-down over the virtual-time window ``[at_time, until_time)``.

    The selector is exactly one of ``node`` (the transfers of one node to and from its server),
    ``region`` (every transfer with an end in that region) and ``link`` (``[A, B]``: the
    transfers between regions A and B, both directions; ``[A, A]`` is A's intra-region link).
    While the window is open the matching transfers send their bytes at ``bandwidth_factor`` x
    the link's bandwidth (< 1 slows, > 1 speeds up) and a transfer that *starts* in it pays
    ``extra_latency_s`` more latency. Overlapping windows multiply their factors and add their
    latencies. A transfer that straddles a boundary is timed piecewise (docs/algorithms.md §8)."""

    node: int = -1  # -1 = not set
    region: str = ""
    link: list[str] = field(default_factory=list)
    at_time: float = 0.0
    until_time: float = math.inf
    bandwidth_factor: float = 1.0
    extra_latency_s: float = 0.0


@dataclass
class ScenarioSpec:
    """The whole scenario file."""

    name: str = ""
    description: str = ""
    server_region: str = ""  # where the (global) parameter server sits
    regions: list[str] = field(default_factory=list)
    nodes: list[NodeSpec] = field(default_factory=list)
    links: LinksSpec = field(default_factory=LinksSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    heterogeneity: HeterogeneitySpec = field(default_factory=HeterogeneitySpec)
    failures: list[FailureSpec] = field(default_factory=list)
    failure_process: FailureProcessSpec = field(default_factory=FailureProcessSpec)
    link_windows: list[LinkWindowSpec] = field(default_factory=list)


# ---- small value types ------------------------------------------------------------------------


class JobTime(NamedTuple):
    """Modelled duration of one job, split so metrics can report communication vs compute."""

    down: float  # server -> node transfer (seconds)
    compute: float  # steps * step_time(node)
    up: float  # node -> server transfer

    @property
    def total(self) -> float:
        return self.down + self.compute + self.up


class Ring(NamedTuple):
    """The all-reduce ring chosen for a set of nodes: its bottleneck bandwidth and latency."""

    regions: tuple[str, ...]  # inter-region visiting order (the ring closes back to the first)
    bandwidth_gbps: float  # slowest link of the ring (intra-region links included)
    latency_s: float  # largest latency of the ring's links
    exact: bool  # False when found by the greedy heuristic (> EXACT_RING_MAX_REGIONS regions)


def payload_bytes(precision: str, num_params: int) -> int:
    """Bytes of one model-sized payload (model or pseudo-gradient) at a wire precision."""
    if precision not in BYTES_PER_PARAM:
        raise ScenarioError(
            f"wire precision '{precision}' is unknown; valid: {', '.join(BYTES_PER_PARAM)}"
        )
    if num_params < 0:
        raise ScenarioError(f"num_params must be >= 0, got {num_params}")
    return BYTES_PER_PARAM[precision] * int(num_params)


def _ceil(x: float) -> int:
    return math.ceil(x - _CEIL_SLACK * max(1.0, abs(x)))


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


# ---- the validated scenario ---------------------------------------------------------------------


class Scenario:
    """A validated scenario with the timing model of docs/algorithms.md §1/§6/§8.

    Effective speed: ``speed_i = nodes[i].speed / multiplier_i`` with the η multiplier (1 when
    η = 0); ``step_time(i) = model.step_time_s * model.reference_speed / speed_i``. The η
    multipliers are spread over the nodes this scenario holds, so :func:`scenario_for_nodes`
    re-spreads them over the nodes a run uses (η is defined "among the clusters" that train).
    """

    def __init__(self, spec: ScenarioSpec, source: str = "scenario") -> None:
        self._spec = copy.deepcopy(spec)
        self._source = source
        _validate(self._spec, source)
        s = self._spec
        self._region_index = {r: i for i, r in enumerate(s.regions)}
        r = len(s.regions)
        self._bw = _square(s.links.bandwidth_gbps, r)
        self._lat = _square(s.links.latency_s, r) if s.links.latency_s else [[0.0] * r for _ in range(r)]
        self._node_region = [self._region_index[n.region] for n in s.nodes]
        self._multipliers = _eta_multipliers(s.heterogeneity, len(s.nodes))
        self._speeds = [n.speed / m for n, m in zip(s.nodes, self._multipliers, strict=True)]
        self._max_speed = max(self._speeds)
        self._ring_cache: dict[tuple[int, ...], tuple[tuple[int, ...], float, float, bool]] = {}
        self._windows = [_Window.from_spec(w, self._region_index) for w in s.link_windows]

    # -- description --
    @property
    def spec(self) -> ScenarioSpec:
        """A copy of the (validated) spec, e.g. to write it with the run."""
        return copy.deepcopy(self._spec)

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def regions(self) -> list[str]:
        return list(self._spec.regions)

    @property
    def server_region(self) -> str:
        return self._spec.server_region

    @property
    def num_nodes(self) -> int:
        return len(self._spec.nodes)

    @property
    def failures(self) -> list[FailureSpec]:
        return copy.deepcopy(self._spec.failures)

    @property
    def failure_process(self) -> FailureProcessSpec:
        return copy.deepcopy(self._spec.failure_process)

    def node(self, node: int) -> NodeSpec:
        return copy.deepcopy(self._spec.nodes[self._check_node(node)])

    def node_region(self, node: int) -> str:
        return self._spec.regions[self._node_region[self._check_node(node)]]

    def region_index(self, region: str | int) -> int:
        """Index of a region given by name or index (clear error for an unknown one)."""
        if isinstance(region, int) and not isinstance(region, bool):
            if 0 <= region < len(self._spec.regions):
                return region
            raise ScenarioError(
                f"scenario '{self.name}': region index {region} out of range 0..{len(self._spec.regions) - 1}"
            )
        if region in self._region_index:
            return self._region_index[region]
        raise ScenarioError(
            f"scenario '{self.name}': unknown region '{region}'; regions: {', '.join(self._spec.regions)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (what `fl_geo.scenario_files.scenario_from_dict` reads back)."""
        return dataclasses.asdict(self._spec)

    def __repr__(self) -> str:
        return (
            f"Scenario(name={self.name!r}, regions={len(self._spec.regions)}, nodes={self.num_nodes}, "
            f"server_region={self.server_region!r})"
        )

    # -- compute --
    def multiplier(self, node: int) -> float:
        """The node's η step-time multiplier (1 + injected delay fraction)."""
        return self._multipliers[self._check_node(node)]

    def speed(self, node: int) -> float:
        """Effective relative speed (base speed / η multiplier)."""
        return self._speeds[self._check_node(node)]

    @property
    def max_speed(self) -> float:
        return self._max_speed

    def step_time(self, node: int) -> float:
        """Seconds one inner step takes on ``node``."""
        m = self._spec.model
        return m.step_time_s * m.reference_speed / self.speed(node)

    def compute_time(self, node: int, steps: int) -> float:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        return steps * self.step_time(node)

    def dynupd_steps(self, inner_steps: int, node: int) -> int:
        """DynUpd / DyLU (docs/algorithms.md §1): ``max(1, ceil(H * speed_i / max_speed))``.

        Slower nodes take proportionally fewer steps so that every node's job takes about as
        long as the fastest node's H steps (HALoS ``--rescale_num_local_steps``).
        """
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        return max(1, _ceil(inner_steps * self.speed(node) / self._max_speed))

    def time_budget_steps(self, budget_s: float, node: int) -> int:
        """Steps a time-budgeted inner loop (A-EDiT) takes in virtual time.

        The real loop finishes the step that crosses the budget, hence ``ceil``; at least one
        step so that every job produces an update.
        """
        if not budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s}")
        return max(1, _ceil(budget_s / self.step_time(node)))

    # -- communication --
    def bandwidth_gbps(self, src_region: str | int, dst_region: str | int) -> float:
        return self._bw[self.region_index(src_region)][self.region_index(dst_region)]

    def latency_s(self, src_region: str | int, dst_region: str | int) -> float:
        return self._lat[self.region_index(src_region)][self.region_index(dst_region)]

    @property
    def link_windows(self) -> list[LinkWindowSpec]:
        return copy.deepcopy(self._spec.link_windows)

    def transfer_time(
        self, src_region: str | int, dst_region: str | int, nbytes: int, *,
        start: float | None = None, node: int | None = None,
    ) -> float:
        """Point-to-point time, the α–β model: ``latency + bytes * 8 / bandwidth``.

        Each transfer gets its link's full bandwidth: concurrent transfers sharing a link are not
        modelled (neither does the HALoS simulator). ``start`` (virtual s) applies the scenario's
        ``link_windows`` (``node``: the node end of a node <-> server transfer, for node
        selectors): the latency, plus the extra latency of the windows open at ``start``, is paid
        first, then the bits flow at the bandwidth x the factors of the windows open at each
        instant, piecewise across window boundaries. Without ``start`` (or windows) the static
        formula, bit for bit.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        s, d = self.region_index(src_region), self.region_index(dst_region)
        windows = [] if start is None else [w for w in self._windows if w.matches(s, d, node)]
        if not windows:
            return self._lat[s][d] + nbytes * 8 / (self._bw[s][d] * 1e9)
        assert start is not None
        t = start + self._lat[s][d] + sum(w.extra_latency_s for w in windows if w.is_open(start))
        bw = self._bw[s][d] * 1e9

        def rate(x: float) -> float:
            return bw * math.prod(w.factor for w in windows if w.is_open(x))

        return _flow(t, nbytes * 8.0, rate, windows) - start

    def job_time(
        self, node: int, steps: int, bytes_down: int, bytes_up: int, peer_region: str | int | None = None,
        start: float | None = None,
    ) -> JobTime:
        """Download from the server, ``steps`` inner steps, upload back.

        ``peer_region`` is where the server this job talks to sits: the scenario's
        ``server_region`` by default; a HALoS local server lives in the node's own region.
        ``start``: the job's dispatch time, so that ``link_windows`` slow its transfers (the
        upload starts after the download and the compute).
        """
        peer = self.server_region if peer_region is None else peer_region
        region = self._node_region[self._check_node(node)]
        down = self.transfer_time(peer, region, bytes_down, start=start, node=node)
        compute = self.compute_time(node, steps)
        up_start = None if start is None else start + down + compute
        return JobTime(down, compute, self.transfer_time(region, peer, bytes_up, start=up_start, node=node))

    def modelled_params(self, fallback: int | None = None) -> int:
        """The modelled parameter count: ``model.num_params``, else ``fallback`` (the real model's)."""
        if self._spec.model.num_params > 0:
            return self._spec.model.num_params
        if fallback is None:
            raise ScenarioError(
                f"scenario '{self.name}' does not set model.num_params: pass the trained model's "
                "parameter count"
            )
        return int(fallback)

    def payload_bytes(self, precision: str, num_params: int | None = None) -> int:
        """Bytes of a model-sized payload for the *modelled* model.

        ``num_params`` (the trained model's count) is only used when the scenario does not model
        a parameter count of its own.
        """
        return payload_bytes(precision, self.modelled_params(num_params))

    # -- synchronous rounds --
    def best_ring(self, nodes: list[int]) -> Ring:
        """The ring all-reduce over ``nodes`` would use (HALoS simulator, Appendix A).

        Nodes of one region sit next to each other on the ring (joined by the intra-region link);
        the regions are visited in the order that maximises the ring's slowest link (ties: the
        smaller largest latency, then the first order found). That is exact over region orders
        for up to ``EXACT_RING_MAX_REGIONS`` regions. Above that a greedy ring is used (from every
        start region, always hop to the widest unvisited region), which can only overestimate the
        all-reduce time. Rings that visit a region twice (possible with one node per visit) are
        not considered, as in the HALoS simulator.
        """
        idx = self._check_nodes(nodes)
        counts: dict[int, int] = {}
        for n in idx:
            counts[self._node_region[n]] = counts.get(self._node_region[n], 0) + 1
        regions = tuple(sorted(counts))
        order, bw, lat, exact = self._region_ring(regions)
        for reg, c in counts.items():  # intra-region links of regions holding several nodes
            if c >= 2 or len(regions) == 1:
                bw = min(bw, self._bw[reg][reg])
                lat = max(lat, self._lat[reg][reg])
        return Ring(tuple(self._spec.regions[i] for i in order), bw, lat, exact)

    def allreduce_time(self, nodes: list[int], nbytes: int, start: float | None = None) -> float:
        """Ring all-reduce: ``2(M-1)/M * bytes*8 / slowest link + 2(M-1) * latency`` (M = #nodes).

        The bandwidth term is Thakur et al.'s, as in the HALoS simulator; the ring's 2(M-1)
        steps each wait for the slowest link's latency (0 in the HALoS set-up).

        ``start`` applies ``link_windows`` to the ring (chosen without them): a window acts on
        the ring links it selects (a ``node`` window on the links at that node's region, when
        the node is in the ring); the latency term uses each link's latency plus the extra
        latency open at ``start``, then the bits flow at the slowest link's bandwidth at each
        instant, piecewise.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        m = len(nodes)
        ring = self.best_ring(nodes)
        if m <= 1:
            return 0.0
        static = 2 * (m - 1) * ring.latency_s + 2 * (m - 1) / m * nbytes * 8 / (ring.bandwidth_gbps * 1e9)
        if start is None or not self._windows:
            return static
        links = self._ring_link_list(nodes, ring)
        per_link = [(a, b, [w for w in self._windows if w.matches_ring_link(a, b, nodes, self._node_region)])
                    for a, b in links]
        windows = [w for _, _, ws in per_link for w in ws]
        if not windows:
            return static
        lat = max(self._lat[a][b] + sum(w.extra_latency_s for w in ws if w.is_open(start)) for a, b, ws in per_link)

        def rate(x: float) -> float:
            return min(self._bw[a][b] * 1e9 * math.prod(w.factor for w in ws if w.is_open(x)) for a, b, ws in per_link)

        t = start + 2 * (m - 1) * lat
        return _flow(t, 2 * (m - 1) / m * nbytes * 8.0, rate, windows) - start

    def _ring_link_list(self, nodes: list[int], ring: Ring) -> list[tuple[int, int]]:
        """The region-index links the ring uses (inter-region hops, then intra-region links)."""
        order = [self._region_index[r] for r in ring.regions]
        links = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))] if len(order) > 1 else []
        counts: dict[int, int] = {}
        for n in nodes:
            counts[self._node_region[n]] = counts.get(self._node_region[n], 0) + 1
        links += [(r, r) for r, c in sorted(counts.items()) if c >= 2 or len(order) == 1]
        return links

    def sync_round_time(self, nodes: list[int], steps_per_node: list[int], nbytes: int) -> float:
        """A decentralised synchronous round (DiLoCo as the papers run it, DiLoCo+DynUpd in
        HALoS): the slowest node's compute, then one ring all-reduce of ``nbytes``."""
        self._check_pairs(nodes, steps_per_node)
        compute = max(self.compute_time(n, s) for n, s in zip(nodes, steps_per_node, strict=True))
        return compute + self.allreduce_time(nodes, nbytes)

    def sync_round_time_ps(
        self, nodes: list[int], steps_per_node: list[int], bytes_down: int, bytes_up: int,
        peer_region: str | int | None = None,
    ) -> float:
        """A parameter-server synchronous round (what DiLoCo in Flower is): every node pulls the
        model from the server region, computes, pushes back; the round ends with the last push.
        ``max_i (down_i + compute_i + up_i)``, each node on its own link (no contention)."""
        self._check_pairs(nodes, steps_per_node)
        return max(
            self.job_time(n, s, bytes_down, bytes_up, peer_region).total
            for n, s in zip(nodes, steps_per_node, strict=True)
        )

    # -- internals --
    def _check_node(self, node: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < len(self._spec.nodes):
            raise ScenarioError(
                f"scenario '{self.name}' has nodes 0..{len(self._spec.nodes) - 1}; got node {node!r}"
            )
        return node

    def _check_nodes(self, nodes: list[int]) -> list[int]:
        idx = [self._check_node(n) for n in nodes]
        if not idx:
            raise ValueError("at least one node is needed")
        if len(set(idx)) != len(idx):
            raise ValueError(f"nodes must be distinct, got {list(nodes)}")
        return idx

    def _check_pairs(self, nodes: list[int], steps_per_node: list[int]) -> None:
        self._check_nodes(nodes)
        if len(steps_per_node) != len(nodes):
            raise ValueError(f"{len(nodes)} nodes but {len(steps_per_node)} step counts")

    def _region_ring(self, regions: tuple[int, ...]) -> tuple[tuple[int, ...], float, float, bool]:
        """Best inter-region ring over ``regions``: (order, min bandwidth, max latency, exact)."""
        if regions in self._ring_cache:
            return self._ring_cache[regions]
        if len(regions) == 1:
            result = (regions, math.inf, 0.0, True)
        elif len(regions) <= EXACT_RING_MAX_REGIONS:
            first, rest = regions[0], regions[1:]
            best: tuple[tuple[int, ...], float, float] | None = None
            for perm in itertools.permutations(rest):
                order = (first, *perm)
                bw, lat = self._ring_links(order)
                if best is None or (bw, -lat) > (best[1], -best[2]):
                    best = (order, bw, lat)
            assert best is not None
            result = (*best, True)
        else:
            best = None
            for start in regions:
                order_l = [start]
                left = set(regions) - {start}
                while left:
                    cur = order_l[-1]
                    nxt = max(sorted(left), key=lambda r, c=cur: (self._bw[c][r], -self._lat[c][r]))
                    order_l.append(nxt)
                    left.discard(nxt)
                bw, lat = self._ring_links(tuple(order_l))
                if best is None or (bw, -lat) > (best[1], -best[2]):
                    best = (tuple(order_l), bw, lat)
            assert best is not None
            result = (*best, False)
        self._ring_cache[regions] = result
        return result

    def _ring_links(self, order: tuple[int, ...]) -> tuple[float, float]:
        links = [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
        return min(self._bw[a][b] for a, b in links), max(self._lat[a][b] for a, b in links)


# ---- validation -----------------------------------------------------------------------------------


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ScenarioError(msg)


def _square(rows: list[list[float]], r: int) -> list[list[float]]:
    """Full R×R matrix from a full or upper-triangular (symmetric) one (already validated)."""
    if all(len(row) == r for row in rows):
        return [list(map(float, row)) for row in rows]
    out = [[0.0] * r for _ in range(r)]
    for i, row in enumerate(rows):
        for k, v in enumerate(row):
            out[i][i + k] = out[i + k][i] = float(v)
    return out


def _check_matrix(rows: list[list[float]], r: int, key: str, where: str, positive: bool) -> None:
    full = len(rows) == r and all(len(row) == r for row in rows)
    tri = len(rows) == r and all(len(row) == r - i for i, row in enumerate(rows))
    _require(
        full or tri,
        f"{where}: links.{key} must be a {r}x{r} matrix in regions order (row = from, column = to) "
        f"or its upper triangle (row i holding {r}-i values from the diagonal on); got rows of "
        f"lengths {[len(row) for row in rows]}",
    )
    for i, row in enumerate(rows):
        for k, v in enumerate(row):
            j = k if full else i + k
            if positive:
                _require(v > 0, f"{where}: links.{key}[{i}][{k}] (region {i} -> {j}) must be > 0 Gbit/s, got {v}")
            else:
                _require(
                    0 <= v < math.inf,
                    f"{where}: links.{key}[{i}][{k}] (region {i} -> {j}) must be a finite value >= 0, got {v}",
                )


def _validate(s: ScenarioSpec, where: str) -> None:
    _require(bool(s.name), f"{where}: 'name' must be set")
    _require(bool(s.regions), f"{where}: 'regions' must list at least one region")
    _require(all(isinstance(r, str) and r for r in s.regions), f"{where}: region names must be non-empty strings")
    dup = sorted({r for r in s.regions if s.regions.count(r) > 1})
    _require(not dup, f"{where}: regions must be unique; repeated: {', '.join(dup)}")
    regions = ", ".join(s.regions)
    _require(
        s.server_region in s.regions,
        f"{where}: server_region '{s.server_region}' is not one of the regions ({regions})",
    )
    _require(bool(s.nodes), f"{where}: 'nodes' must list at least one node")
    for i, n in enumerate(s.nodes):
        _require(
            n.region in s.regions, f"{where}: nodes[{i}].region '{n.region}' is not one of the regions ({regions})"
        )
        _require(0 < n.speed < math.inf, f"{where}: nodes[{i}].speed must be a finite number > 0, got {n.speed}")
    r = len(s.regions)
    _require(
        bool(s.links.bandwidth_gbps),
        f"{where}: links.bandwidth_gbps is required ({r}x{r} Gbit/s matrix; the diagonal is intra-region)",
    )
    _check_matrix(s.links.bandwidth_gbps, r, "bandwidth_gbps", where, positive=True)
    if s.links.latency_s:
        _check_matrix(s.links.latency_s, r, "latency_s", where, positive=False)
    m = s.model
    _require(
        0 < m.step_time_s < math.inf,
        f"{where}: model.step_time_s must be > 0 (seconds per inner step at model.reference_speed), got {m.step_time_s}",
    )
    _require(m.num_params >= 0, f"{where}: model.num_params must be >= 0 (0 = the trained model's count), got {m.num_params}")
    _require(0 < m.reference_speed < math.inf, f"{where}: model.reference_speed must be > 0, got {m.reference_speed}")
    h = s.heterogeneity
    _require(0 <= h.eta_percent < math.inf, f"{where}: heterogeneity.eta_percent must be >= 0, got {h.eta_percent}")
    _require(h.spread in SPREADS, f"{where}: heterogeneity.spread must be one of {', '.join(SPREADS)}, got '{h.spread}'")
    for i, f in enumerate(s.failures):
        _require(
            (f.node == -1) != (f.region == ""),
            f"{where}: failures[{i}] must set exactly one of 'node' (one node) and 'region' (every node of a region)",
        )
        if f.region:
            _require(f.region in s.regions, f"{where}: failures[{i}].region '{f.region}' is not one of the regions ({regions})")
        else:
            _require(
                0 <= f.node < len(s.nodes), f"{where}: failures[{i}].node must be in 0..{len(s.nodes) - 1}, got {f.node}"
            )
        _require(0 <= f.at_time < math.inf, f"{where}: failures[{i}].at_time must be >= 0 seconds, got {f.at_time}")
        _require(
            f.duration is None or 0 < f.duration < math.inf,
            f"{where}: failures[{i}].duration must be > 0 seconds (or null = for good), got {f.duration}",
        )
    _validate_process(s.failure_process, len(s.nodes), where)
    for i, w in enumerate(s.link_windows):
        _validate_window(w, i, s, where)


def _validate_window(w: LinkWindowSpec, i: int, s: ScenarioSpec, where: str) -> None:
    key = f"{where}: link_windows[{i}]"
    regions = ", ".join(s.regions)
    chosen = [w.node != -1, w.region != "", bool(w.link)]
    _require(sum(chosen) == 1, f"{key} must set exactly one of 'node', 'region' and 'link' ([A, B]: two regions)")
    if w.node != -1:
        _require(0 <= w.node < len(s.nodes), f"{key}.node must be in 0..{len(s.nodes) - 1}, got {w.node}")
    if w.region:
        _require(w.region in s.regions, f"{key}.region '{w.region}' is not one of the regions ({regions})")
    if w.link:
        _require(len(w.link) == 2, f"{key}.link must name two regions [A, B], got {list(w.link)}")
        bad = [r for r in w.link if r not in s.regions]
        _require(not bad, f"{key}.link region '{bad[0] if bad else ''}' is not one of the regions ({regions})")
    _require(0 <= w.at_time < math.inf, f"{key}.at_time must be a finite time >= 0 seconds, got {w.at_time}")
    _require(w.until_time > w.at_time, f"{key}.until_time must be > at_time ({w.at_time}), got {w.until_time}")
    _require(0 < w.bandwidth_factor < math.inf,
             f"{key}.bandwidth_factor must be a finite number > 0 (< 1 slows the link), got {w.bandwidth_factor}")
    _require(0 <= w.extra_latency_s < math.inf,
             f"{key}.extra_latency_s must be a finite number >= 0 seconds, got {w.extra_latency_s}")


def _validate_process(p: FailureProcessSpec, num_nodes: int, where: str) -> None:
    _require(0 <= p.mtbf_s < math.inf, f"{where}: failure_process.mtbf_s must be >= 0 seconds (0 = off), got {p.mtbf_s}")
    if p.mtbf_s == 0:
        return
    _require(
        0 < p.repair_s < math.inf,
        f"{where}: failure_process.repair_s must be > 0 seconds when failure_process.mtbf_s is set, got {p.repair_s}",
    )
    _require(p.repair in REPAIRS, f"{where}: failure_process.repair must be one of {', '.join(REPAIRS)}, got '{p.repair}'")
    for i, n in enumerate(p.nodes):
        _require(0 <= n < num_nodes, f"{where}: failure_process.nodes[{i}] must be in 0..{num_nodes - 1}, got {n}")
    _require(len(set(p.nodes)) == len(p.nodes), f"{where}: failure_process.nodes must be distinct, got {p.nodes}")


def _eta_multipliers(h: HeterogeneitySpec, k: int) -> list[float]:
    """Per-node step-time multipliers for Di-PS η (docs/algorithms.md §8).

    ``even``: node k of K gets ``1 + η/100 * k/(K-1)`` (η = 100, K = 4: 1, 4/3, 5/3, 2), our
    deterministic reading of "varies uniformly by 0-η %". ``random``: ``1 + U(0, η)/100`` drawn
    in node order from ``random.Random(seed)``, so the first N nodes keep their draws when a run
    uses fewer nodes.
    """
    if h.eta_percent == 0:
        return [1.0] * k
    if h.spread == "random":
        rng = random.Random(h.seed)
        return [1.0 + rng.uniform(0.0, h.eta_percent) / 100.0 for _ in range(k)]
    if k == 1:
        return [1.0]
    return [1.0 + h.eta_percent / 100.0 * i / (k - 1) for i in range(k)]


def _process_for_nodes(p: FailureProcessSpec, num_nodes: int) -> FailureProcessSpec:
    """The failure process over the first ``num_nodes`` nodes; off when it named only dropped nodes
    (an empty ``nodes`` list would otherwise mean every node)."""
    if not p.nodes:
        return dataclasses.replace(p)
    kept = [n for n in p.nodes if n < num_nodes]
    return dataclasses.replace(p, nodes=kept) if kept else dataclasses.replace(p, mtbf_s=0.0, nodes=[])


def scenario_for_nodes(scenario: Scenario, num_nodes: int) -> Scenario:
    """The scenario restricted to a run's ``num_nodes`` nodes (the first ones, in index order).

    A scenario must model at least as many nodes as the run has: inventing speeds and regions for
    the rest would silently change the experiment. Failures of dropped nodes are dropped; the
    η multipliers are spread over the nodes kept (see :class:`Scenario`).
    """
    if num_nodes < 1:
        raise ScenarioError(f"a run needs at least one node, got {num_nodes}")
    if num_nodes > scenario.num_nodes:
        raise ScenarioError(
            f"scenario '{scenario.name}' models {scenario.num_nodes} nodes but the run has {num_nodes} "
            "(run.num_clients): add nodes to the scenario or run fewer clients"
        )
    if num_nodes == scenario.num_nodes:
        return scenario
    spec = scenario.spec
    spec = dataclasses.replace(
        spec,
        nodes=spec.nodes[:num_nodes],
        failures=[f for f in spec.failures if f.node < num_nodes],  # region outages (node -1) stay
        failure_process=_process_for_nodes(spec.failure_process, num_nodes),
        link_windows=[w for w in spec.link_windows if w.node < num_nodes],  # node -1: not a node window
    )
    return Scenario(spec, f"{scenario.name} (first {num_nodes} nodes)")
