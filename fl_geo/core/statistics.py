"""Per-group statistics of pseudo-gradient norms and the outlier tests on them (docs/algorithms.md §4.2–4.3).

`EmaStats` keeps EMA mean/std of the norms per (key, group), a key being a node (EDiT) or one
pooled key for all nodes (Di-PS's leader); `zscores` turns a norm into z = (G − μ)/σ per group.
`OutlierTest` accepts or rejects each group from its z-score (``zscore``: z > δ, optionally with
atorch's adaptive bound; ``relative_max``: z > β·max(max(E), 1) over Di-PS's window E of recent
accepted scores). All values are ``[num_groups]`` float64 tensors and every operation is
vectorised over groups.

Contract: reading (`zscores`, `ready`, `bounds`, `accept`) never changes state; only `update`
does, and only with accepted, finite values. This is what lets the penalty freeze the statistics
during a step: `fl_geo.core.penalty.Penalty.observe` scores against the state left by the
previous `commit` (docs/algorithms.md §4.3), so scoring each update on arrival equals Di-PS's
scoring of the whole set at step time; the statistics learn the step's accepted updates at
`commit`, in arrival order. State is plain (string keys, tensors) for checkpoints.

The per-group input checks (`_check_norms`, `_check_mask`, `_positive_int`) live here and are
shared with `fl_geo.core.weights` and `fl_geo.core.penalty`.

Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "KEYINGS",
    "POOLED_KEY",
    "RULES",
    "EmaStats",
    "OutlierTest",
]

RULES = ("zscore", "relative_max")
KEYINGS = ("node", "pooled")
POOLED_KEY = "*"  # the one statistics key of `pooled` keying

NormsLike = torch.Tensor | Sequence[float]


def _check_norms(norms: NormsLike, num_groups: int) -> torch.Tensor:
    t = torch.as_tensor(norms, dtype=torch.float64).reshape(-1)
    if t.numel() != num_groups:
        raise ValueError(f"need one norm per group ({num_groups}), got {t.numel()}")
    return t


def _check_mask(mask: torch.Tensor | Sequence[bool], num_groups: int) -> torch.Tensor:
    t = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
    if t.numel() != num_groups:
        raise ValueError(f"need one mask entry per group ({num_groups}), got {t.numel()}")
    return t


def _positive_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _push_rows(history: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Append ``values[g]`` to row g of a NaN-padded window (oldest dropped) where ``mask``."""
    if history.shape[1] == 0:
        return history
    shifted = torch.cat([history[:, 1:], values[:, None]], dim=1)
    return torch.where(mask[:, None], shifted, history)


def _check_state_kind(state: Mapping[str, Any], owner: str, key: str, value: str, num_groups: int) -> None:
    """Refuse a ``state_dict`` made by another kind of ``owner`` (its ``key``, e.g. the keying or
    the rule, and its ``num_groups`` must be this one's) before any of it is loaded: ValueError
    naming both."""
    if state.get(key) != value or state.get("num_groups") != num_groups:
        raise ValueError(
            f"{owner} state is for {key} {state.get(key)!r} with "
            f"{state.get('num_groups')} groups; this one has {value!r} with "
            f"{num_groups}"
        )


class EmaStats:
    """EMA mean/std of pseudo-gradient norms per (key, group) (docs/algorithms.md §4.2).

    μ ← α·G + (1−α)·μ;  σ ← sqrt((1−α)·σ² + α·(G − μ_new)²), with μ = first G, σ = 0 on a key's
    first observation of a group (our choice: atorch starts at μ = 0, which biases the early
    mean; note the recursion applied to μ = G, σ = 0 gives the same values, so "initialise" and
    "first update" agree). ``keying="node"``: one set per node key (EDiT's μ^(i,l)); ``pooled``:
    one set shared by all nodes (Di-PS's leader). Keys are strings (`str` of the node id), so
    the state is plain. Only `update` changes anything, and only for accepted, finite norms.
    """

    def __init__(self, num_groups: int, alpha: float = 0.02, warmup: int = 20,
                 keying: str = "node") -> None:
        self.num_groups = _positive_int("num_groups", num_groups, 1)
        alpha = float(alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.warmup = _positive_int("warmup", warmup)
        if keying not in KEYINGS:
            raise ValueError(f"unknown keying {keying!r}; valid: {', '.join(KEYINGS)}")
        self.keying = keying
        self._mean: dict[str, torch.Tensor] = {}
        self._std: dict[str, torch.Tensor] = {}
        self._count: dict[str, torch.Tensor] = {}

    def stats_key(self, node: Any) -> str:
        """The statistics key of a node: its id as a string, or `POOLED_KEY` when pooled."""
        return POOLED_KEY if self.keying == "pooled" else str(node)

    def keys(self) -> list[str]:
        """Statistics keys seen so far, in first-observation order."""
        return list(self._count)

    def _get(self, node: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = self.stats_key(node)
        if key not in self._count:
            zeros = torch.zeros(self.num_groups, dtype=torch.float64)
            return zeros, zeros, torch.zeros(self.num_groups, dtype=torch.int64)
        return self._mean[key], self._std[key], self._count[key]

    def observations(self, node: Any) -> torch.Tensor:
        """Accepted observations per group for the node's key (int64, zeros for a new key)."""
        return self._get(node)[2].clone()

    def mean(self, node: Any) -> torch.Tensor:
        """μ per group (0 where nothing was observed)."""
        return self._get(node)[0].clone()

    def std(self, node: Any) -> torch.Tensor:
        """σ per group."""
        return self._get(node)[1].clone()

    def ready(self, node: Any) -> torch.Tensor:
        """Groups whose z-score is real: ≥ ``warmup`` observations and σ > 0 (else z := 0)."""
        _, std, count = self._get(node)
        return (count >= self.warmup) & (std > 0)

    def zscores(self, node: Any, norms: NormsLike) -> torch.Tensor:
        """z = (G − μ)/σ per group with the statistics as they are (nothing is updated).

        0 where the key is still warming up (`ready` false). A non-finite norm is passed
        through as its z (NaN/+Inf), so it can never look acceptable.
        """
        g = _check_norms(norms, self.num_groups)
        mean, std, _ = self._get(node)
        ready = self.ready(node)
        z = torch.where(ready, (g - mean) / torch.where(ready, std, 1.0), 0.0)
        return torch.where(torch.isfinite(g), z, g)

    def update(self, node: Any, norms: NormsLike, accepted: torch.Tensor | Sequence[bool]
               ) -> None:
        """Fold the accepted, finite norms into the node key's statistics (others untouched)."""
        g = _check_norms(norms, self.num_groups)
        mask = _check_mask(accepted, self.num_groups) & torch.isfinite(g)
        if not bool(mask.any()):
            return
        key = self.stats_key(node)
        mean, std, count = self._get(node)
        a = self.alpha
        first = mask & (count == 0)
        new_mean = a * g + (1 - a) * mean
        new_std = torch.sqrt((1 - a) * std * std + a * (g - new_mean) ** 2)
        self._mean[key] = torch.where(first, g, torch.where(mask, new_mean, mean))
        self._std[key] = torch.where(first, 0.0, torch.where(mask, new_std, std))
        self._count[key] = count + mask.to(torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """Keys and ``[num_keys, num_groups]`` tensors (loadable with ``weights_only=True``)."""
        keys = self.keys()
        empty = torch.zeros(0, self.num_groups, dtype=torch.float64)
        return {
            "keying": self.keying,
            "num_groups": self.num_groups,
            "keys": keys,
            "mean": torch.stack([self._mean[k] for k in keys]) if keys else empty,
            "std": torch.stack([self._std[k] for k in keys]) if keys else empty.clone(),
            "count": (torch.stack([self._count[k] for k in keys]) if keys
                      else empty.to(torch.int64)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output (validated first; α and warm-up stay the constructor's)."""
        _check_state_kind(state, "EmaStats", "keying", self.keying, self.num_groups)
        keys = [str(k) for k in state["keys"]]
        shape = (len(keys), self.num_groups)
        tensors = [torch.as_tensor(state[name]) for name in ("mean", "std", "count")]
        for name, t in zip(("mean", "std", "count"), tensors, strict=True):
            if tuple(t.shape) != shape:
                raise ValueError(f"EmaStats state {name!r} has shape {tuple(t.shape)}, "
                                 f"expected {shape}")
        mean, std, count = (tensors[0].to(torch.float64), tensors[1].to(torch.float64),
                            tensors[2].to(torch.int64))
        self._mean = {k: mean[i].clone() for i, k in enumerate(keys)}
        self._std = {k: std[i].clone() for i, k in enumerate(keys)}
        self._count = {k: count[i].clone() for i, k in enumerate(keys)}


class OutlierTest:
    """Accept/reject per group from z-scores (docs/algorithms.md §4.3); state changes only in
    `update`, i.e. after the step's decisions.

    - ``zscore`` (EDiT): reject if z > δ. With ``adaptive_threshold`` (atorch) the bound is
      δ·max(1, std of the last ``history`` real z-scores of the key and group); the window holds
      the scores of *accepted* updates only (a rejected update touches no statistics) and only
      real ones (z := 0 during warm-up says nothing about spread); sample std (torch's default,
      as atorch), factor 1 until two scores are in.
    - ``relative_max`` (Di-PS): reject if z > β·max(max(E), 1), E = the last ``window`` accepted
      real scores of the group (one stack per group for all nodes, as the Di-PS leader's; the
      floor of 1 is ours); while E is empty, accept.

    A NaN/±Inf z (non-finite norm) is always rejected.
    """

    def __init__(self, num_groups: int, rule: str = "zscore", threshold: float = 3.0,
                 window: int = 16, adaptive_threshold: bool = False, history: int = 20) -> None:
        self.num_groups = _positive_int("num_groups", num_groups, 1)
        if rule not in RULES:
            raise ValueError(f"unknown outlier rule {rule!r}; valid: {', '.join(RULES)}")
        self.rule = rule
        threshold = float(threshold)
        if not (threshold > 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be finite and > 0, got {threshold}")
        self.threshold = threshold
        self.window = _positive_int("window", window, 1)
        if adaptive_threshold and rule != "zscore":
            raise ValueError("adaptive_threshold is an option of the zscore rule only")
        self.adaptive_threshold = bool(adaptive_threshold)
        self.history = _positive_int("history", history)
        self._scores = torch.full((self.num_groups, self.window), math.nan, dtype=torch.float64)
        self._z_history: dict[str, torch.Tensor] = {}

    def scores(self) -> torch.Tensor:
        """E per group, oldest first, NaN-padded on the left (``[num_groups, window]``)."""
        return self._scores.clone()

    def adaptive_factor(self, key: str) -> torch.Tensor:
        """max(1, std of the key's recent z-scores) per group (1 without the option)."""
        hist = self._z_history.get(key)
        if not self.adaptive_threshold or hist is None:
            return torch.ones(self.num_groups, dtype=torch.float64)
        valid = ~torch.isnan(hist)
        n = valid.sum(dim=1)
        x = torch.where(valid, hist, 0.0)
        mean = x.sum(dim=1) / n.clamp(min=1)
        var = torch.where(valid, (hist - mean[:, None]) ** 2, 0.0).sum(dim=1) / (n - 1).clamp(
            min=1)
        return torch.where(n >= 2, torch.clamp(var.sqrt(), min=1.0), 1.0)

    def bounds(self, key: str) -> torch.Tensor:
        """The z above which an update of this key is rejected, per group (+Inf: accept all)."""
        if self.rule == "zscore":
            return self.threshold * self.adaptive_factor(key)
        empty = torch.isnan(self._scores).all(dim=1)
        top = torch.where(torch.isnan(self._scores), -math.inf, self._scores).amax(dim=1)
        return torch.where(empty, math.inf, self.threshold * torch.clamp(top, min=1.0))

    def accept(self, key: str, z: torch.Tensor) -> torch.Tensor:
        """Accept mask per group: finite z not above the bound."""
        z = _check_norms(z, self.num_groups)
        return torch.isfinite(z) & ~(z > self.bounds(key))

    def update(self, key: str, z: torch.Tensor, mask: torch.Tensor) -> None:
        """Record the real z-scores of accepted groups (``mask``) into E and the key's window."""
        z = _check_norms(z, self.num_groups)
        mask = _check_mask(mask, self.num_groups) & torch.isfinite(z)
        if not bool(mask.any()):
            return
        if self.rule == "relative_max":
            self._scores = _push_rows(self._scores, z, mask)
        elif self.adaptive_threshold and self.history > 0:
            hist = self._z_history.get(key)
            if hist is None:
                hist = torch.full((self.num_groups, self.history), math.nan, dtype=torch.float64)
            self._z_history[key] = _push_rows(hist, z, mask)

    def state_dict(self) -> dict[str, Any]:
        """E and the per-key z windows as plain tensors (NaN = empty slot)."""
        keys = list(self._z_history)
        return {
            "rule": self.rule,
            "num_groups": self.num_groups,
            "scores": self._scores.clone(),
            "z_keys": keys,
            "z_history": (torch.stack([self._z_history[k] for k in keys]) if keys
                          else torch.zeros(0, self.num_groups, self.history,
                                           dtype=torch.float64)),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; window sizes must match the constructor's."""
        _check_state_kind(state, "OutlierTest", "rule", self.rule, self.num_groups)
        scores = torch.as_tensor(state["scores"], dtype=torch.float64)
        if tuple(scores.shape) != (self.num_groups, self.window):
            raise ValueError(f"OutlierTest scores have shape {tuple(scores.shape)}, expected "
                             f"{(self.num_groups, self.window)}")
        keys = [str(k) for k in state["z_keys"]]
        hist = torch.as_tensor(state["z_history"], dtype=torch.float64)
        if tuple(hist.shape) != (len(keys), self.num_groups, self.history):
            raise ValueError(f"OutlierTest z_history has shape {tuple(hist.shape)}, expected "
                             f"{(len(keys), self.num_groups, self.history)}")
        self._scores = scores.clone()
        self._z_history = {k: hist[i].clone() for i, k in enumerate(keys)}
