"""Direction-aware robust aggregation: what a norm bound cannot see.

`fl_geo.core.robust` bounds an update's norm against its peers'. A site that turns its update
around (Δ → −3Δ) keeps a plausible norm and still drags the mean backwards: 1 of 4 sites at −3Δ
turns the mean of four updates to zero. The rules here look at direction. Each works on
updates stacked as the rows of one ``(n, d)`` fp32 tensor (flattened models), vectorised over
whole rows, with no framework in sight; the loops (strategies/sync.py, strategies/asynchronous.py)
decide where the rows come from and what happens to the result.

- `coordinate_median`: per coordinate, the median of the n values (the mean of the two middle
  ones for even n). Tolerates f < n/2 hostile rows; unweighted by construction.
- `trimmed_mean`: per coordinate, drop the ``trim`` largest and ``trim`` smallest values and
  average the rest. Tolerates f ≤ trim hostile rows; needs n > 2·trim.
- `centered_clip`: Karimireddy, He & Jaggi 2021 ("Learning from History for Byzantine Robust
  Optimization"): from a running center v₀, iterate v ← v + Σ wᵢ·clip(xᵢ − v, τ) / Σ wᵢ L
  times, clip(z, τ) = z·min(1, τ/‖z‖). One row moves the result by at most τ·wᵢ/Σw per
  iteration, whatever it holds. `centered_clip_rows` returns the rows yᵢ = v_{L−1} +
  clip(xᵢ − v_{L−1}, τ), whose weighted mean is exactly v_L: a loop can fold them like any
  updates (token weights, staleness weights, the penalty) instead of replacing its fold.
- `cosine_scores` / `cosine_outliers`: the cosine of each row with a consensus of its peers
  (the coordinate median of all rows, or the mean of the others); a row below a threshold points
  away from its peers and is rejected. The leave-one-out mean is dragged by a scaled attacker
  (1 of 4 at −3Δ makes the others' leave-one-out mean point backwards), so the median is the
  default reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["centered_clip", "centered_clip_rows", "clip_rows", "coordinate_median", "cosine_outliers",
           "cosine_scores", "trimmed_mean"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"updates must be stacked as a non-empty (n, d) tensor, got shape {tuple(x.shape)}")
    return x


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """The per-coordinate median of the rows of ``x`` (n, d): for even n the mean of the two
    middle values, so the result does not depend on which of them sorts first."""
    n = _rows(x).shape[0]
    ordered = torch.sort(x, dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(x: torch.Tensor, trim: int) -> torch.Tensor:
    """The per-coordinate mean of the rows of ``x`` (n, d) after dropping, in each coordinate,
    the ``trim`` largest and ``trim`` smallest values. Needs n > 2·trim (something must remain)."""
    n = _rows(x).shape[0]
    if trim < 0 or n <= 2 * trim:
        raise ValueError(f"trimmed_mean needs 0 <= trim and n > 2 * trim, got n={n}, trim={trim}")
    if trim == 0:
        return x.mean(dim=0)
    return torch.sort(x, dim=0).values[trim : n - trim].mean(dim=0)


def clip_rows(z: torch.Tensor, tau: float) -> torch.Tensor:
    """Each row of ``z`` scaled to L2 norm at most ``tau`` (rows within it are unchanged)."""
    norms = torch.linalg.vector_norm(_rows(z), dim=1, keepdim=True)
    scale = torch.clamp(tau / torch.clamp(norms, min=torch.finfo(z.dtype).tiny), max=1.0)
    return z * scale


def _weights(x: torch.Tensor, weights: Sequence[float] | None) -> torch.Tensor:
    n = x.shape[0]
    w = torch.ones(n, dtype=x.dtype) if weights is None else torch.as_tensor(list(weights), dtype=x.dtype)
    if w.shape != (n,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"weights must be {n} finite non-negative numbers with a positive sum, got {list(w.tolist())}")
    return (w / w.sum()).unsqueeze(1)


def _check_clip(tau: float, iters: int) -> None:
    if not (math.isfinite(tau) and tau >= 0) or iters < 1:
        raise ValueError(f"centered clipping needs a finite tau >= 0 and iters >= 1, got tau={tau}, iters={iters}")


def centered_clip(x: torch.Tensor, center: torch.Tensor, tau: float, iters: int,
                  weights: Sequence[float] | None = None) -> torch.Tensor:
    """v_L of centered clipping: v₀ = ``center``, v ← v + Σ wᵢ·clip(xᵢ − v, τ) / Σ wᵢ, ``iters`` times."""
    _check_clip(tau, iters)
    w = _weights(_rows(x), weights)
    v = center.to(x.dtype).clone()
    for _ in range(iters):
        v += (w * clip_rows(x - v, tau)).sum(dim=0)
    return v


def centered_clip_rows(x: torch.Tensor, center: torch.Tensor, tau: float, iters: int,
                       weights: Sequence[float] | None = None) -> torch.Tensor:
    """The rows yᵢ = v_{L−1} + clip(xᵢ − v_{L−1}, τ), with v_{L−1} from `centered_clip` after
    ``iters`` − 1 iterations: Σ wᵢ·yᵢ / Σ wᵢ = v_L. Each yᵢ lies within τ of v_{L−1}."""
    _check_clip(tau, iters)
    v = center.to(x.dtype).clone() if iters == 1 else centered_clip(x, center, tau, iters - 1, weights)
    return v + clip_rows(x - v, tau)


def cosine_scores(x: torch.Tensor, reference: str = "median") -> torch.Tensor:
    """The cosine of each row of ``x`` (n, d) with its peers' consensus: ``"median"`` the
    coordinate median of all rows, ``"loo_mean"`` the mean of the other rows (n ≥ 2). A zero
    row or a zero reference scores 0 (no direction to agree with)."""
    n = _rows(x).shape[0]
    if reference == "median":
        ref = coordinate_median(x).unsqueeze(0).expand_as(x)
    elif reference == "loo_mean":
        if n < 2:
            raise ValueError("a leave-one-out mean needs at least 2 rows")
        ref = (x.sum(dim=0, keepdim=True) - x) / (n - 1)
    else:
        raise ValueError(f"reference must be 'median' or 'loo_mean', got {reference!r}")
    return torch.nn.functional.cosine_similarity(x, ref, dim=1, eps=torch.finfo(x.dtype).tiny)


def cosine_outliers(scores: Sequence[float], threshold: float, reference: str = "the coordinate median") -> dict[int, str]:
    """Indices of ``scores`` below ``threshold``, with the logged reason."""
    return {i: (f"update points away from its peers: cosine {s:.3f} with {reference} of the updates is below "
                f"{threshold:g} (strategy.robust=cosine)")
            for i, s in enumerate(scores) if not s >= threshold}
