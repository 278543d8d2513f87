"""The scenario file's schema and its validation: what a scenario may say, checked in one place.

`fl_geo.scenario_files` reads a YAML file into the ``*Spec`` dataclasses here (omegaconf
structured configs), and :class:`fl_geo.timing.scenario.Scenario` runs :func:`_validate` on one
before it answers any timing question. The schema and its checks live apart from the timing
model so that a reader of the file format (or of an error message) finds every key, default and
rule on one page, and the model's module holds only the maths. Every check raises
:class:`ScenarioError` naming the key and the bad value. Two derivations that read a spec and
nothing else sit here too: the η step-time multipliers and a failure process cut down to a
run's first nodes. No files are read here.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

from fl_geo.errors import ConfigError

__all__ = [
    "FailureProcessSpec",
    "FailureSpec",
    "HeterogeneitySpec",
    "LinkWindowSpec",
    "LinksSpec",
    "ModelSpec",
    "NodeSpec",
    "ScenarioError",
    "ScenarioSpec",
]

SPREADS = ("even", "random")
REPAIRS = ("fixed", "exponential")


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
