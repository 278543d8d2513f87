"""A-EDiT's step weights mixed into the penalty's weights (`StepWeightMix`): a fast worker that
took more inner steps under a time budget counts for more, in a second O(1) running sum beside
the penalty's."""

from __future__ import annotations

import torch

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.groups import Update, _as_pieces, restrict
from fl_geo.core.penalty import Penalty, Verdict

__all__ = ["StepWeightMix"]


class StepWeightMix:
    """A-EDiT's step weights (atorch ``use_step_weight``) mixed into the penalty's weights.

    Per group, over the updates accepted for it: ``w_i = (1 − r)·w_i^pen + r·s_i / Σ_j s_j``,
    with ``w^pen`` the penalty's normalised weights and ``s_i`` the inner steps update i took
    (under a time budget fast workers take more). The mix is not separable (each term has its own
    normaliser), so the step-weighted sum is kept in a second running sum: the server holds one
    more model-sized buffer, still O(1) in the number of replies.

    Per step: `fold_` after `Penalty.fold_` for every update, `mix_` on the penalty's normalised
    mean before the clip, `reset` when the step is done.
    """

    def __init__(self, penalty: Penalty, ratio: float) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"step weight ratio must be in [0, 1], got {ratio}")
        self.penalty = penalty
        self.ratio = float(ratio)
        self.acc = WeightedAccumulator(penalty.spec.numel)
        self.totals = torch.zeros(penalty.num_groups, dtype=torch.float64)

    def reset(self) -> None:
        self.acc.reset()
        self.totals.zero_()

    def fold_(self, update: Update, verdict: Verdict, steps: int) -> None:
        """Fold the accepted groups of ``update`` with weight ``steps``."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        accepted = verdict.accepted
        if not bool(accepted.any()):
            return
        self.totals += accepted.to(torch.float64) * float(steps)
        if self.penalty.whole_model:
            self.acc.add(update, float(steps))
            return
        pieces = _as_pieces(update)
        for (_, ranges), ok in zip(self.penalty.groups, accepted.tolist(), strict=True):
            if ok:
                self.acc.add(restrict(pieces, ranges), float(steps))

    def mix_(self, mean: torch.Tensor) -> torch.Tensor:
        """``mean ← (1 − r)·mean + r·(Σ s·Δ / Σ s)`` per group with accepted updates, in place."""
        if mean.dim() != 1 or mean.numel() != self.penalty.spec.numel:
            raise ValueError(f"mean must be 1-D with {self.penalty.spec.numel} elements")
        r = self.ratio
        buf = self.acc.buffer
        for (_, ranges), total in zip(self.penalty.groups, self.totals.tolist(), strict=True):
            if total <= 0:
                continue
            for b, e in ranges:
                mean[b:e].mul_(1.0 - r).add_(buf[b:e], alpha=r / total)
        return mean
