"""The scale-free clip threshold: φ_eff = c · (running mean of the clipped update norms).

Why: Di-PS's φ = 1 and EDiT's φ = 10 are absolute norms chosen for language models of 10⁸–10⁹
parameters, whose averaged pseudo-gradients have norms well above them, so there the clip binds on
(nearly) every step. On any other model the same constant means something else: on a model whose
updates are small it never binds and guards nothing; on one whose updates are large it cuts every
step to a fixed length. A threshold relative to the updates' own running scale keeps what the
clip is for (cut a step that is much larger than the recent ones) on every model
(docs/algorithms.md §4, "The relative clip" derives it).

Per group g (one group for a global clip, one per module for EDiT's), with ε the clip's ε::

    φ_g,t = c · m_g,t−1                          (+∞ before the group's first step: no clip)
    Δ̂_g,t = min(1, φ_g,t / (‖Δ̄_g,t‖ + ε)) · Δ̄_g,t
    m_g,t = ‖Δ̂_g,1‖                             on the group's first step,
    m_g,t = (1 − α) · m_g,t−1 + α · ‖Δ̂_g,t‖     after it.

The statistic learns the *clipped* norms, so a run of spikes cannot teach it a larger scale faster
than m_t ≤ (1 − α + α·c) · m_t−1 per step; and multiplying every update by s > 0 multiplies every
m and φ by s, so the clip factors do not depend on the model's norm scale at all. Groups that took
no step (rolled back) leave their m unchanged.

Framework-free vectorised torch over groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RelativeClip"]


class RelativeClip:
    """The running statistic m_g and the thresholds φ_g = c·m_g of the relative clip (float64).

    ``ratio`` c > 0 (c ≤ 1 lets steps only shrink; > 1 lets them grow by at most
    1 − α + α·c per step); ``alpha`` α in (0, 1], the EMA weight of the newest clipped norm.
    """

    def __init__(self, num_groups: int, ratio: float = 2.0, alpha: float = 0.1) -> None:
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        ratio, alpha = float(ratio), float(alpha)
        if not (ratio > 0 and math.isfinite(ratio)):
            raise ValueError(f"relative clip ratio c must be finite and > 0, got {ratio}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"relative clip alpha must be in (0, 1], got {alpha}")
        self.num_groups, self.ratio, self.alpha = int(num_groups), ratio, alpha
        self.mean = torch.full((self.num_groups,), math.nan, dtype=torch.float64)  # NaN: no step yet

    def thresholds(self) -> torch.Tensor:
        """φ_g = c·m_g for this step, ``[num_groups]``; +∞ for a group with no step yet."""
        return torch.where(torch.isnan(self.mean), math.inf, self.ratio * self.mean)

    def update(self, clipped_norms: torch.Tensor, stepped: torch.Tensor | None = None) -> None:
        """Learn this step's clipped norms ‖Δ̂_g‖ for the groups in ``stepped`` (bool, default all)."""
        g = torch.as_tensor(clipped_norms, dtype=torch.float64).reshape(-1)
        if g.numel() != self.num_groups:
            raise ValueError(f"need {self.num_groups} norms, got {g.numel()}")
        mask = torch.isfinite(g)
        if stepped is not None:
            mask = mask & torch.as_tensor(stepped, dtype=torch.bool).reshape(-1)
        ema = torch.where(torch.isnan(self.mean), g, (1.0 - self.alpha) * self.mean + self.alpha * g)
        self.mean = torch.where(mask, ema, self.mean)

    def state_dict(self) -> dict[str, Any]:
        """m per group (NaN: no step yet)."""
        return {"mean": self.mean.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; the number of groups must match."""
        mean = torch.as_tensor(state["mean"], dtype=torch.float64).reshape(-1)
        if mean.numel() != self.num_groups:
            raise ValueError(f"relative clip state has {mean.numel()} groups, expected {self.num_groups}")
        self.mean = mean.clone()
