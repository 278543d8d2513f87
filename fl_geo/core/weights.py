"""Weights of the pseudo-gradient penalty: how much each accepted update counts in a group's mean.

Kinds (`WEIGHT_KINDS`, combinable: a list multiplies and is renormalised): ``tokens`` → T_i,
``uniform`` → 1, ``staleness`` → 1/sqrt(1+τ_i) (FedBuff), ``norm_softmax`` → exp(−G_i/T).

Weights and streaming. Each weighting kind is *separable*: the unnormalised weight of update i
depends only on update i, so folding w_i·Δ_i on arrival and dividing by Σ w_i at the end
is exact. ``norm_softmax`` is kept in range like an online log-sum-exp: its factor is taken
relative to a per-group reference exp(−G_ref/T) (the first accepted update of the step), and
when a later update would exceed e^30 relative to it the reference moves to that update and the
running sum is rescaled once (`fl_geo.core.penalty.Verdict.rescale`); weights below 1e-30 of the
reference are negligible in fp32 and are not folded at all. ``temperature="auto"`` (T = mean
accepted norm of the step) needs a number known only at the step's end; to avoid a second pass
over model-sized data the penalty uses **the previous step's mean accepted norm** (per group),
and on the first step the first accepted norm of the step. `StreamingWeights` is the on-arrival
form; `compute_weights` implements the formulas on collected scalars for synchronous callers
(there ``"auto"`` is the exact mean of the given set). Both are ``[num_groups]``-vectorised.

Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fl_geo.core.statistics import NormsLike, _check_mask, _check_norms, _positive_int

__all__ = [
    "WEIGHT_KINDS",
    "StreamingWeights",
    "base_weight",
    "compute_weights",
    "staleness_weight",
]

WEIGHT_KINDS = ("tokens", "norm_softmax", "uniform", "staleness")

# Streaming norm_softmax: a factor may exceed the reference's by up to e^30 (~1e13) before the
# reference moves (keeps fold weights times update elements far inside fp32's range, and makes
# rescales rare: they need norms 30·T apart); factors under 1e-30 of it cannot change an fp32 sum.
_REBASE_NATS = 30.0
_NEGLIGIBLE = 1e-30
_MIN_TEMPERATURE = 1e-12  # floor of a data-derived temperature, also when eps = 0


def staleness_weight(staleness: int) -> float:
    """FedBuff's s(τ) = 1/sqrt(1 + τ): the factor on an update τ model versions old."""
    return 1.0 / math.sqrt(1.0 + staleness)


def _parse_weighting(weighting: str | Sequence[str]) -> tuple[str, ...]:
    kinds = (weighting,) if isinstance(weighting, str) else tuple(weighting)
    if not kinds:
        raise ValueError("weighting needs at least one kind")
    for kind in kinds:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"unknown weighting {kind!r}; valid: {', '.join(WEIGHT_KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"weighting kinds repeat: {list(kinds)}")
    return kinds


def _check_tokens(tokens: Any) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    return tokens


def _check_staleness(staleness: Any) -> float:
    value = float(staleness)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"staleness must be finite and >= 0, got {staleness!r}")
    return value


def base_weight(kinds: Sequence[str], tokens: int | None = None, staleness: float = 0) -> float:
    """The norm-independent factor of an update's unnormalised weight (one scalar for all
    groups): T_i for ``tokens``, s(τ) = 1/sqrt(1+τ) for ``staleness`` (FedBuff), 1 otherwise;
    products multiply. Arguments are validated when their kind is used."""
    w = 1.0
    if "tokens" in kinds:
        if tokens is None:
            raise ValueError("tokens weighting needs the update's token count")
        w *= float(_check_tokens(tokens))
    if "staleness" in kinds:
        w /= math.sqrt(1.0 + _check_staleness(staleness))
    return w


def _temperature_tensor(temperature: float | torch.Tensor, num_groups: int) -> torch.Tensor:
    t = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1)
    if t.numel() == 1:
        t = t.expand(num_groups).clone()
    if t.numel() != num_groups:
        raise ValueError(f"need one temperature per group ({num_groups}), got {t.numel()}")
    return t


def compute_weights(
    norms: torch.Tensor,
    accepted: torch.Tensor,
    weighting: str | Sequence[str] = "tokens",
    temperature: float | str | torch.Tensor = 1.0,
    tokens: Sequence[int] | None = None,
    staleness: Sequence[float] | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalised weights ``[num_updates, num_groups]`` from collected per-update scalars.

    w_ig = f_i·exp(−G_ig/T_g) / Σ_j f_j·exp(−G_jg/T_g) over the accepted updates of group g
    (the exponential only with ``norm_softmax``; f_i = `base_weight`), computed in log space
    with a log-sum-exp, so norms of 1e4 at T = 1 give the argmin instead of 0/0. Rejected
    entries get 0; a group with no accepted update gets all zeros (it is rolled back).
    ``temperature``: a number, one per group, or ``"auto"`` = the mean accepted norm of the
    group in this set (floored at ``eps``). The synchronous counterpart of `StreamingWeights`.
    """
    kinds = _parse_weighting(weighting)
    norms = torch.as_tensor(norms, dtype=torch.float64)
    if norms.dim() != 2:
        raise ValueError(f"norms must be [num_updates, num_groups], got {tuple(norms.shape)}")
    n, g = norms.shape
    accepted = torch.as_tensor(accepted, dtype=torch.bool)
    if tuple(accepted.shape) != (n, g):
        raise ValueError(f"accepted must have shape {(n, g)}, got {tuple(accepted.shape)}")
    if (tokens is not None and len(tokens) != n) or (staleness is not None
                                                     and len(staleness) != n):
        raise ValueError(f"need one tokens/staleness entry per update ({n})")
    log_base = torch.tensor(
        [math.log(base_weight(kinds, None if tokens is None else tokens[i],
                              0 if staleness is None else staleness[i])) for i in range(n)],
        dtype=torch.float64,
    )
    logw = log_base[:, None].expand(n, g)
    if "norm_softmax" in kinds:
        safe = torch.where(accepted, norms, 0.0)
        if isinstance(temperature, str):
            if temperature != "auto":
                raise ValueError(f"temperature must be a number or 'auto', got {temperature!r}")
            temp = safe.sum(dim=0) / accepted.sum(dim=0).clamp(min=1)
            temp = temp.clamp(min=max(eps, _MIN_TEMPERATURE))
        else:
            temp = _temperature_tensor(temperature, g)
        logw = logw - safe / temp
    logw = torch.where(accepted, logw, -math.inf)
    lse = torch.logsumexp(logw, dim=0)
    return torch.where(accepted, torch.exp(logw - lse), 0.0)


class StreamingWeights:
    """Unnormalised per-group fold weights for one step, decided on arrival (see module doc).

    `push` returns, for one update, ``weights[g]`` to fold it with (0: rejected or negligible)
    and ``rescale[g]`` to multiply the running sum's group by *before* that fold (1: leave it);
    `total` is Σ of the folded weights after rescales, the divisor of `Penalty.normalise_`.
    ``temperature``: per group, NaN = "the first accepted norm of the step" (the auto fallback).
    """

    def __init__(self, num_groups: int, kinds: Sequence[str],
                 temperature: float | torch.Tensor = 1.0, eps: float = 1e-6) -> None:
        self.num_groups = _positive_int("num_groups", num_groups, 1)
        self.kinds = _parse_weighting(kinds)
        self.softmax = "norm_softmax" in self.kinds
        self.temperature = _temperature_tensor(temperature, self.num_groups)
        self.eps = float(eps)
        self._reference = torch.full((self.num_groups,), math.nan, dtype=torch.float64)
        self.total = torch.zeros(self.num_groups, dtype=torch.float64)
        self.count = torch.zeros(self.num_groups, dtype=torch.int64)

    def push(self, norms: NormsLike, accepted: torch.Tensor, tokens: int | None = None,
             staleness: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and rescale factors of the next update (validates before changing state)."""
        base = base_weight(self.kinds, tokens, staleness)
        g = _check_norms(norms, self.num_groups)
        acc = _check_mask(accepted, self.num_groups)
        rescale = torch.ones(self.num_groups, dtype=torch.float64)
        factor = torch.ones(self.num_groups, dtype=torch.float64)
        if self.softmax:
            unset = torch.isnan(self.temperature) & acc
            floor = max(self.eps, _MIN_TEMPERATURE)
            self.temperature = torch.where(unset, g.clamp(min=floor), self.temperature)
            logit = torch.where(acc, -g / torch.where(acc, self.temperature, 1.0), 0.0)
            first = acc & torch.isnan(self._reference)
            self._reference = torch.where(first, logit, self._reference)
            exponent = torch.where(acc, logit - self._reference, 0.0)
            rebase = acc & (exponent > _REBASE_NATS)
            rescale = torch.where(rebase, torch.exp(-exponent), 1.0)
            self._reference = torch.where(rebase, logit, self._reference)
            factor = torch.exp(torch.where(rebase, 0.0, exponent))
            self.total = self.total * rescale
        weights = base * factor
        weights = torch.where(acc & (weights >= _NEGLIGIBLE), weights, 0.0)
        self.total = self.total + weights
        self.count = self.count + acc.to(torch.int64)
        return weights, rescale
