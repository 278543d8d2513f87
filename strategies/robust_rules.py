"""The direction-aware ``strategy.robust`` rules as the loops use them: from a group of replies to
what gets folded.

The synchronous loop holds a round's valid replies until the round is complete, the
asynchronous loop holds a step's buffer; both hand the group to `DirectionRule.judge`, which

1. refuses, with the fold's own reasons, the updates the fold would refuse anyway (NaN/Inf, a
   norm beyond ``strategy.max_update_ratio``): a rule must never clip a refused update into an
   accepted one;
2. applies the rule (fl_geo.core.robust_agg) to the others, stacked as one fp32 ``(n, d)`` tensor:

   - ``cosine``: rejects the updates whose cosine with the consensus is below
     ``strategy.robust_cos_min``. Synchronous rounds (``consensus="group"``): the consensus is the
     coordinate median of the round, and the kept updates fold unchanged (token weights, the
     penalty). Asynchronous buffers (``consensus="running"``), too small for a consensus of their
     own: the consensus is a running center, seeded with the coordinate median of the first
     step's updates (the loop holds that step until ``strategy.robust_seed`` have arrived, see
     `DirectionRule.seeded`), and the kept updates are then centered-clipped as below, which
     moves the center; a refused update never moves it;
   - ``centered_clip``: replaces each update by its centered-clipped row (within τ of the
     running center), τ the lower median of the distances to the center of this group and of
     the last ``strategy.robust_window`` ones; the rows fold with the usual weights, so with
     uniform or token weights their mean is exactly centered clipping's v_L, and the center
     becomes that mean;
   - ``trimmed_mean`` / ``median``: one coordinate-wise aggregate, unweighted (a token claim
     cannot move a coordinate rule: each kept value counts once), folded in place of the group.

Fewer than three updates give no consensus: ``cosine`` and the coordinate rules then leave the
group as it is (a trimmed mean of two would be empty), as ``median_norm`` does.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fl_geo.core import robust_agg
from fl_geo.runtime.wire import PayloadError, check_finite_and_norm

DIRECTION_RULES = ("trimmed_mean", "median", "centered_clip", "cosine")
MIN_GROUP = 3


@dataclass
class Judged:
    """What to do with a group: ``rejected`` index → reason; ``rows`` index → the update to fold
    in place of the received one (centered clipping); ``aggregate``: fold this one update
    instead of the kept ones (coordinate rules); ``norms`` index → the received update's norm."""

    rejected: dict[int, str] = field(default_factory=dict)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    aggregate: torch.Tensor | None = None
    norms: dict[int, float] = field(default_factory=dict)


def flat_row(update: Any, numel: int) -> torch.Tensor:
    """An update (a 1-D tensor or ``(offset, piece)`` pieces in any float precision) as a new
    fp32 vector of ``numel`` values (uncovered positions 0)."""
    if isinstance(update, torch.Tensor):
        return update.reshape(-1).to(torch.float32, copy=True)
    row = torch.zeros(numel, dtype=torch.float32)
    for offset, piece in update:
        flat = piece.reshape(-1)
        row[offset : offset + flat.numel()] = flat
    return row


class DirectionRule:
    """One loop's direction-aware rule and its state (the centered-clipping center and distances)."""

    def __init__(self, rule: str, numel: int, *, trim: int, iters: int, cos_min: float, window: int,
                 consensus: str = "group") -> None:
        if rule not in DIRECTION_RULES:
            raise ValueError(f"rule must be one of {DIRECTION_RULES}, got {rule!r}")
        if consensus not in ("group", "running"):
            raise ValueError(f"consensus must be 'group' or 'running', got {consensus!r}")
        self.rule, self.numel, self.trim, self.iters, self.cos_min = rule, numel, trim, iters, cos_min
        # cosine against a running center (asynchronous): no center until the first group seeds it
        self.running = rule == "cosine" and consensus == "running"
        self.center = torch.zeros(numel, dtype=torch.float32) if rule == "centered_clip" else None
        self._distances: deque[float] = deque(maxlen=window)

    @property
    def seeded(self) -> bool:
        """False while a running-center ``cosine`` rule has no consensus yet: the loop holds its
        first step until enough updates (``strategy.robust_seed``) arrived to seed one."""
        return not self.running or self.center is not None

    def judge(self, updates: Sequence[Any], weights: Sequence[float], bound: float | None) -> Judged:
        """Judge a group of updates (with the weights the fold would give them); see the module."""
        out = Judged()
        kept: list[int] = []
        for i, u in enumerate(updates):
            try:
                norm = check_finite_and_norm(u if not isinstance(u, torch.Tensor) else [(0, u)])
            except PayloadError as exc:
                out.rejected[i] = str(exc)
                continue
            if bound is not None and norm > bound:
                out.rejected[i] = f"update norm {norm:.4g} exceeds the bound {bound:.4g} (strategy.max_update_ratio)"
                continue
            out.norms[i] = norm
            kept.append(i)
        if not kept:
            return out
        x = torch.stack([flat_row(updates[i], self.numel) for i in kept])
        if self.rule == "centered_clip":
            self._clip(out, kept, x, [weights[i] for i in kept])
        elif self.running:
            self._running_cosine(out, kept, x, [weights[i] for i in kept])
        elif len(kept) >= MIN_GROUP:
            if self.rule == "cosine":
                scores = robust_agg.cosine_scores(x, "median").tolist()
                for j, reason in robust_agg.cosine_outliers(scores, self.cos_min).items():
                    out.rejected[kept[j]] = reason
            elif self.rule == "median":
                out.aggregate = robust_agg.coordinate_median(x)
            else:  # trimmed_mean; more trimmed than the group allows: the median
                trim = self.trim if len(kept) > 2 * self.trim else 0
                out.aggregate = robust_agg.trimmed_mean(x, trim) if trim else robust_agg.coordinate_median(x)
        return out

    def _running_cosine(self, out: Judged, kept: list[int], x: torch.Tensor, weights: list[float]) -> None:
        """Cosine with the running center (seeded by this group's coordinate median when there is
        none; a group of fewer than `MIN_GROUP` seeds it with its mean and is not judged), then
        centered clipping of the kept rows, which moves the center."""
        if self.center is None:
            if len(kept) < MIN_GROUP:
                self.center = x.mean(dim=0)
                out.rows = {i: x[j] for j, i in enumerate(kept)}
                return
            self.center = robust_agg.coordinate_median(x)
        scores = torch.nn.functional.cosine_similarity(
            x, self.center.unsqueeze(0).expand_as(x), dim=1, eps=torch.finfo(x.dtype).tiny).tolist()
        refused = robust_agg.cosine_outliers(scores, self.cos_min, reference="the running consensus")
        for j, reason in refused.items():
            out.rejected[kept[j]] = reason
        keep = [j for j in range(len(kept)) if j not in refused]
        if keep:
            self._clip(out, [kept[j] for j in keep], x[keep], [weights[j] for j in keep])

    def _clip(self, out: Judged, kept: list[int], x: torch.Tensor, weights: list[float]) -> None:
        assert self.center is not None
        distances = torch.linalg.vector_norm(x - self.center, dim=1).tolist()
        tau = statistics.median_low([*self._distances, *distances])
        self._distances.extend(distances)
        rows = robust_agg.centered_clip_rows(x, self.center, tau, self.iters, weights)
        w = torch.as_tensor(weights, dtype=torch.float32).unsqueeze(1)
        if float(w.sum()) > 0:
            self.center = (w * rows).sum(dim=0) / w.sum()
        out.rows = {i: rows[j] for j, i in enumerate(kept)}

    def state_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "center": self.center, "distances": list(self._distances)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rule") != self.rule:
            raise ValueError(f"checkpoint's robust rule is {state.get('rule')!r}, this run's is {self.rule!r}")
        center = state["center"]
        has_center = self.rule == "centered_clip" or self.running  # running: None until seeded
        if (center is None and self.rule == "centered_clip") or (center is not None and not has_center) or (
                center is not None and center.shape != (self.numel,)):
            raise ValueError("checkpoint's centered-clipping center does not fit this model")
        self.center = None if center is None else center.to(torch.float32).clone()
        self._distances.clear()
        self._distances.extend(float(d) for d in state["distances"])
