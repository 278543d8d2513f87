"""Where to put the parameter server: Di-PS's placement cost model (Di-PS, NSDI 2026, §4.1).

Di-PS picks the PS cluster that can best absorb the parameter traffic. With N candidate clusters
(rows), M training clusters (columns), the bandwidth matrix ``B`` (Gbit/s) and each training
cluster's throughput ``p_j``, and assuming a cluster communicates as often as it finishes outer
rounds (so in proportion to its throughput), candidate i's demand score is the row product
``s_i = B[i, :] · p`` and the PS goes to ``i* = argmax_i s_i``: the candidate whose fast links
point at the clusters that talk most.

From a scenario (:func:`place_from_scenario`) each node is a training cluster. Its throughput is
``1 / step_time(j)``, inner steps per second, which includes the node's η slow-down. With equal
batches on every cluster, tokens/s is that times one constant, so the argmax is unchanged.
``B[i, j]`` is ``bandwidth_gbps(candidate region i, region of node j)``, the PS-to-cluster
direction. The candidates default to every region of the scenario: "we treat training clusters
as candidates", and a dedicated CPU region (like ``ps`` in the Di-PS scenarios) is a candidate
too. A candidate in a node's own region reaches it over the intra-region link (the diagonal),
so the model favours putting the PS next to the fastest clusters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fl_geo.timing.cost import CostModel
from fl_geo.timing.scenario import Scenario, ScenarioError

__all__ = [
    "Placement",
    "best_placement",
    "format_placement",
    "place_from_scenario",
    "placement_ranks",
    "placement_scores",
]

# Relative tolerance under which two scores count as tied. A matvec sums each row in its own
# order, so candidates that should score exactly the same (a symmetric WAN) can land an ulp
# apart; without the tolerance that rounding error, not the model, would pick the winner.
TIE_RTOL = 1e-9


def _as_tensor(x: Any, name: str, dims: int) -> torch.Tensor:
    """``x`` as a float64 tensor of ``dims`` dimensions with only finite positive entries."""
    try:
        t = torch.as_tensor(x, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be numeric with {dims} dimension(s): {exc}") from None
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    bad = ~(torch.isfinite(t) & (t > 0))
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}{list(idx)} = {t[idx].item()}: every entry must be finite and > 0")
    return t


def placement_scores(
    bandwidth: torch.Tensor | Sequence[Sequence[float]], throughput: torch.Tensor | Sequence[float]
) -> torch.Tensor:
    """Demand scores ``s = B @ p``: one per candidate (row of ``bandwidth``), float64.

    ``bandwidth`` is N x M (candidate x training cluster), ``throughput`` has M entries. Both must
    be finite and positive: a zero or infinite link, or a cluster that does not train, has no
    meaning in the model and would hide a typo in a scenario.
    """
    b = _as_tensor(bandwidth, "bandwidth", 2)
    p = _as_tensor(throughput, "throughput", 1)
    if b.shape[1] != p.shape[0]:
        raise ValueError(
            f"bandwidth is {b.shape[0]}x{b.shape[1]} (candidates x training clusters) but throughput "
            f"has {p.shape[0]} entries; they must agree on the number of training clusters"
        )
    return b @ p


def placement_ranks(scores: torch.Tensor, rtol: float = TIE_RTOL) -> torch.Tensor:
    """Competition ranks (1 = best) of ``scores``; scores within ``rtol`` of each other tie.

    Rank = 1 + how many candidates score clearly higher, so tied candidates share a rank
    ("1, 2, 2, 4").
    """
    s = torch.as_tensor(scores, dtype=torch.float64)
    tol = rtol * s.abs().max()
    return 1 + (s[None, :] > s[:, None] + tol).sum(dim=1)


def best_placement(
    bandwidth: torch.Tensor | Sequence[Sequence[float]], throughput: torch.Tensor | Sequence[float]
) -> int:
    """``argmax_i B[i, :] · p``; ties (within :data:`TIE_RTOL`) go to the lowest index.

    Lowest index so that the order the candidates are given in breaks ties, e.g. listing the
    scenario's current server region first keeps it when nothing beats it.
    """
    ranks = placement_ranks(placement_scores(bandwidth, throughput))
    return int((ranks == 1).nonzero()[0, 0])


@dataclass
class Placement:
    """The cost model evaluated on a scenario, with what :func:`fl_geo.cli` prints."""

    scenario: str
    candidates: list[str]  # candidate regions, in the order given
    scores: list[float]  # B[i, :] · p, Gbit/s x steps/s
    ranks: list[int]  # 1 = best; ties share a rank
    best: str  # the chosen candidate (lowest index among the rank-1 ones)
    best_index: int
    server_region: str  # where the scenario currently puts the server
    nodes: list[str]  # training clusters (node name, or node-<i>), columns of B
    node_regions: list[str]
    throughput: list[float]  # p_j, inner steps per second
    bandwidth: list[list[float]]  # B, Gbit/s, candidates x nodes
    # Per candidate, the slowest node's modelled model round trip (down + up, `CostModel`, fp32)
    # with the server there; None when the scenario models no parameter count.
    round_trip_s: list[float] | None = None

    @property
    def matches(self) -> bool:
        """Whether the scenario's server already sits in the chosen region."""
        return self.best == self.server_region

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "matches": self.matches}


def place_from_scenario(scenario: Scenario, candidates: Sequence[str] | None = None) -> Placement:
    """Evaluate the placement model on ``scenario``'s nodes; candidates default to all regions.

    Unknown or repeated candidate regions raise :class:`~fl_geo.timing.scenario.ScenarioError` (a
    config error: the CLI exits with status 2), as does an infinite link to a node, which would
    make the scores meaningless.
    """
    regions = scenario.regions
    cands = list(regions if candidates is None else candidates)
    if not cands:
        raise ScenarioError(f"scenario '{scenario.name}': no candidate regions given")
    for c in cands:
        if c not in regions:
            raise ScenarioError(
                f"scenario '{scenario.name}': unknown candidate region '{c}'; regions: {', '.join(regions)}"
            )
    dup = sorted({c for c in cands if cands.count(c) > 1})
    if dup:
        raise ScenarioError(f"candidate regions must be distinct; repeated: {', '.join(dup)}")
    nodes = range(scenario.num_nodes)
    node_regions = [scenario.node_region(j) for j in nodes]
    bw = [[scenario.bandwidth_gbps(c, r) for r in node_regions] for c in cands]
    for c, row in zip(cands, bw, strict=True):
        for r, v in zip(node_regions, row, strict=True):
            if not math.isfinite(v):
                raise ScenarioError(
                    f"scenario '{scenario.name}': link {c} -> {r} has infinite bandwidth; the "
                    "placement model needs finite values (set a large finite number instead)"
                )
    throughput = [1.0 / scenario.step_time(j) for j in nodes]
    scores = placement_scores(bw, throughput)
    round_trip = None
    if scenario.models_params():  # the scenario's own question: no trained model behind it
        cost = CostModel(0, scenario)
        round_trip = [max(cost.job_time(j, 0, "fp32", "fp32", peer_region=c).total for j in nodes) for c in cands]
    ranks = placement_ranks(scores)
    best = int((ranks == 1).nonzero()[0, 0])
    return Placement(
        scenario=scenario.name,
        candidates=cands,
        scores=scores.tolist(),
        ranks=ranks.tolist(),
        best=cands[best],
        best_index=best,
        server_region=scenario.server_region,
        nodes=[scenario.node(j).name or f"node-{j}" for j in nodes],
        node_regions=node_regions,
        throughput=throughput,
        bandwidth=bw,
        round_trip_s=round_trip,
    )


def format_placement(pl: Placement) -> str:
    """The table ``fl-geo place`` prints."""
    lines = [
        f"scenario {pl.scenario}: {len(pl.nodes)} training clusters; PS demand score s_i = B[i,:] . p",
        "throughput p (inner steps/s): "
        + ", ".join(f"{n} ({r}) {p:.4g}" for n, r, p in zip(pl.nodes, pl.node_regions, pl.throughput, strict=True)),
        "",
        "| candidate | score B_i . p (Gbit/s x steps/s) | rank | |"
        + (" slowest fp32 model round trip (s) |" if pl.round_trip_s is not None else ""),
        "|---|---|---|---|" + ("---|" if pl.round_trip_s is not None else ""),
    ]
    for i, (c, s, r) in enumerate(zip(pl.candidates, pl.scores, pl.ranks, strict=True)):
        notes = [n for n, on in (("chosen", c == pl.best), ("current server_region", c == pl.server_region)) if on]
        trip = f" {pl.round_trip_s[i]:.4g} |" if pl.round_trip_s is not None else ""
        lines.append(f"| {c} | {s:.6g} | {r} | {', '.join(notes)} |{trip}")
    lines += [
        "",
        f"chosen: {pl.best}; scenario server_region: {pl.server_region} "
        f"({'matches' if pl.matches else 'differs'}"
        f"{'' if pl.server_region in pl.candidates else ', not among the candidates'})",
    ]
    return "\n".join(lines)
