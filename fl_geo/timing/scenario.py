"""Scenarios: the modelled hardware and WAN a virtual-clock run pretends to have.

A laptop simulation trains a small proxy model on one CPU, yet methods must be compared by the
time they would take across real datacenters. A scenario supplies what that time depends on
(docs/algorithms.md §1, §6, §8): the regions and the bandwidth/latency between them, which region the
parameter server sits in, each node's region and relative speed, the Di-PS η speed spread, and
the *modelled* model (parameter count and base step time). Modelling e.g. Pythia-70M's 70 M
parameters and 238 ms steps keeps the communication/compute ratio of the paper even though the
proxy model being trained is a thousand times smaller.

Scenarios are YAML files in ``configs/scenarios/`` that `fl_geo.scenario_files` reads into the
``*Spec`` dataclasses of :mod:`fl_geo.timing.scenario_spec` (which also validates them; this
module reads no files and needs no omegaconf), then validated into a :class:`Scenario`, which
answers the timing questions (``step_time``, ``transfer_time``, ``job_time``, ring all-reduce)
that :mod:`fl_geo.timing.clock` and the strategies ask; link windows and the ring search are
computed in :mod:`fl_geo.timing.links`. Node index = partition id = the Flower node's
``partition-id``. The names those modules define are re-exported here, their historical home.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, NamedTuple

from fl_geo.timing.links import EXACT_RING_MAX_REGIONS, Ring, _best_region_ring, _flow, _Window
from fl_geo.timing.scenario_spec import (
    REPAIRS,
    SPREADS,
    FailureProcessSpec,
    FailureSpec,
    HeterogeneitySpec,
    LinksSpec,
    LinkWindowSpec,
    ModelSpec,
    NodeSpec,
    ScenarioError,
    ScenarioSpec,
    _eta_multipliers,
    _process_for_nodes,
    _square,
    _validate,
)

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
    "REPAIRS",
    "Ring",
    "SPREADS",
    "Scenario",
    "ScenarioError",
    "ScenarioSpec",
    "payload_bytes",
    "scenario_for_nodes",
]

# Bytes per parameter of a model-sized payload on the wire (the outer state is always fp32).
BYTES_PER_PARAM: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
# Relative slack when rounding step counts up: 0.3/0.1 is 2.9999999999999996 in floating point
# and 0.7/0.1*... can land a hair above an integer; neither may cost a whole extra step.
_CEIL_SLACK = 1e-9


# ---- small value types ------------------------------------------------------------------------


class JobTime(NamedTuple):
    """Modelled duration of one job, split so metrics can report communication vs compute."""

    down: float  # server -> node transfer (seconds)
    compute: float  # steps * step_time(node)
    up: float  # node -> server transfer

    @property
    def total(self) -> float:
        return self.down + self.compute + self.up


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

    def models_params(self) -> bool:
        """Whether the scenario models a parameter count of its own (``model.num_params``)."""
        return self._spec.model.num_params > 0

    def modelled_params(self, fallback: int | None = None) -> int:
        """The modelled parameter count: ``model.num_params``, else ``fallback`` (the real model's)."""
        if self.models_params():
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
        """Best inter-region ring over ``regions`` (see `_best_region_ring`), cached per scenario."""
        if regions in self._ring_cache:
            return self._ring_cache[regions]
        result = _best_region_ring(regions, self._bw, self._lat)
        self._ring_cache[regions] = result
        return result



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
