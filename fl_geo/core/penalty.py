"""Pseudo-gradient penalty (docs/algorithms.md §4): outlier rejection, weighting, clipping, rollback.

Shared by Di-PS, EDiT and HALoS. One `Penalty` object lives as long as the server and is used
once per outer step, in the order a *streaming* server needs (it never holds more than O(1)
model-sized buffers, docs/algorithms.md §5)::

    per reply:  norms = penalty.norms(pieces)              # one read of the update, per-group L2
                verdict = penalty.observe(node, norms, tokens=T, staleness=tau)
                penalty.fold_(acc, pieces, verdict)        # second read: weighted fold if accepted
    step end:   penalty.normalise_(acc.buffer)             # Σ w·Δ / Σ w per group  ->  Δ̄
                penalty.clip_(acc.buffer)                  # Δ̂ = min(1, φ/(‖Δ̄‖+ε))·Δ̄ per group
                skip = penalty.rolled_back                 # groups that must not be stepped
                ... outer step on the other groups ...
                report = penalty.commit()                  # statistics learn the accepted updates

Everything per update is a scalar per *group* (one group for ``global`` granularity, one per
top-level module for ``module``): norms, z-scores, decisions and weights are ``[num_groups]``
tensors and every operation on them is vectorised over groups. Statistics are frozen during a
step: `observe` scores against the state left by the previous `commit` (docs/algorithms.md §4.3), so
scoring on arrival equals Di-PS's scoring of the whole set at step time.

Weights and streaming. Each weighting kind is *separable*: the unnormalised weight of update i
depends only on update i (``tokens`` → T_i, ``uniform`` → 1, ``staleness`` → 1/sqrt(1+τ_i),
``norm_softmax`` → exp(−G_i/T)), so folding w_i·Δ_i on arrival and dividing by Σ w_i at the end
is exact. ``norm_softmax`` is kept in range like an online log-sum-exp: its factor is taken
relative to a per-group reference exp(−G_ref/T) (the first accepted update of the step), and
when a later update would exceed e^30 relative to it the reference moves to that update and the
running sum is rescaled once (`Verdict.rescale`); weights below 1e-30 of the reference are
negligible in fp32 and are not folded at all. ``temperature="auto"`` (T = mean accepted norm of
the step) needs a number known only at the step's end; to avoid a second pass over model-sized
data we use **the previous step's mean accepted norm** (per group), and on the first step the
first accepted norm of the step. `compute_weights` implements the formulas on collected scalars
for synchronous callers (there ``"auto"`` is the exact mean of the given set).

Framework-free (no Flower import).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.state import CHUNK_ELEMS, ParamSpec, chunk_ranges

__all__ = [
    "GRANULARITIES",
    "KEYINGS",
    "POOLED_KEY",
    "RULES",
    "WEIGHT_KINDS",
    "EmaStats",
    "OutlierTest",
    "Penalty",
    "Rejection",
    "StepReport",
    "StepWeightMix",
    "StreamingWeights",
    "Verdict",
    "base_weight",
    "clip_",
    "compute_weights",
    "group_norms",
    "module_group_name",
    "module_groups",
    "restrict",
    "scale_ranges_",
]

GRANULARITIES = ("global", "module")
RULES = ("zscore", "relative_max")
KEYINGS = ("node", "pooled")
WEIGHT_KINDS = ("tokens", "norm_softmax", "uniform", "staleness")
POOLED_KEY = "*"  # the one statistics key of `pooled` keying

Ranges = list[tuple[int, int]]
Groups = list[tuple[str, Ranges]]
Pieces = list[tuple[int, torch.Tensor]]
Update = torch.Tensor | Iterable[tuple[int, torch.Tensor]]
NormsLike = torch.Tensor | Sequence[float]

# Streaming norm_softmax: a factor may exceed the reference's by up to e^30 (~1e13) before the
# reference moves (keeps fold weights times update elements far inside fp32's range, and makes
# rescales rare: they need norms 30·T apart); factors under 1e-30 of it cannot change an fp32 sum.
_REBASE_NATS = 30.0
_NEGLIGIBLE = 1e-30
_MIN_TEMPERATURE = 1e-12  # floor of a data-derived temperature, also when eps = 0
_INTEGER = re.compile(r"[0-9]+")


# ---------------------------------------------------------------------------------------------
# Groups of the flat buffer


def module_group_name(name: str) -> str:
    """Top-level module of a parameter name: the first component, plus the second when it is a
    container index (``blocks.3.attn.wq.weight`` → ``blocks.3``, ``embed.weight`` → ``embed``).

    This is what EDiT calls a module (a top-level layer), without knowing the container's name:
    any ``<list>.<integer>`` prefix (``blocks``, ``layers``, ``h``) counts.
    """
    parts = name.split(".")
    if len(parts) >= 2 and _INTEGER.fullmatch(parts[1]):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def module_groups(spec: ParamSpec, granularity: str = "module") -> Groups:
    """Named groups of flat-buffer ranges ``(begin, end)`` for a granularity.

    ``global``: one group ``"model"`` over the whole buffer. ``module``: one group per
    `module_group_name`, in order of first appearance in the spec, with contiguous ranges merged
    (our model gives ``embed``, ``blocks.0`` … ``blocks.{L-1}``, ``norm``, one range each).
    Zero-sized parameters hold no data and are left out.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if granularity == "global":
        return [("model", [(0, spec.numel)] if spec.numel else [])]
    groups: dict[str, Ranges] = {}
    for name, begin, n in zip(spec.names, spec.offsets, spec.numels, strict=True):
        if n == 0:
            continue
        ranges = groups.setdefault(module_group_name(name), [])
        if ranges and ranges[-1][1] == begin:
            ranges[-1] = (ranges[-1][0], begin + n)
        else:
            ranges.append((begin, begin + n))
    return list(groups.items())


def _segments(groups: Sequence[tuple[str, Ranges]]) -> list[tuple[int, int, int]]:
    """All non-empty ranges as sorted ``(begin, end, group index)``; overlaps are an error (an
    element in two groups would be normed, scaled and stepped twice)."""
    segments = sorted((b, e, g) for g, (_, ranges) in enumerate(groups) for b, e in ranges
                      if e > b)
    for (_, e0, g0), (b1, _, g1) in zip(segments, segments[1:], strict=False):
        if b1 < e0:
            raise ValueError(f"groups {groups[g0][0]!r} and {groups[g1][0]!r} overlap at {b1}")
    return segments


def _as_pieces(update: Update) -> Pieces:
    """A flat tensor or ``(offset, tensor)`` pieces as flattened pieces (views, no copies)."""
    if isinstance(update, torch.Tensor):
        return [(0, update.reshape(-1))]
    pieces: Pieces = []
    for offset, piece in update:
        if not piece.is_floating_point():
            raise TypeError(f"piece at offset {offset} has non-floating dtype {piece.dtype}")
        pieces.append((int(offset), piece.reshape(-1)))
    return pieces


def restrict(update: Update, ranges: Ranges) -> Pieces:
    """The parts of an update that lie inside ``ranges`` (sorted, disjoint), as views.

    Lets a caller fold one group of an update with its own weight (`Penalty.fold_`).
    """
    starts = [b for b, _ in ranges]
    out: Pieces = []
    for offset, flat in _as_pieces(update):
        stop = offset + flat.numel()
        k = max(bisect_right(starts, offset) - 1, 0)
        while k < len(ranges) and ranges[k][0] < stop:
            lo, hi = max(ranges[k][0], offset), min(ranges[k][1], stop)
            if lo < hi:
                out.append((lo, flat[lo - offset:hi - offset]))
            k += 1
    return out


def _split_at(groups: Sequence[tuple[str, Ranges]], boundaries: Sequence[int]) -> list[tuple[str, Ranges]]:
    """The groups with every range cut at the given offsets (tensor starts)."""
    cuts = sorted(set(int(b) for b in boundaries))
    out = []
    for name, ranges in groups:
        pieces: Ranges = []
        for b, e in ranges:
            k = bisect_right(cuts, b)
            start = b
            while k < len(cuts) and cuts[k] < e:
                pieces.append((start, cuts[k]))
                start = cuts[k]
                k += 1
            pieces.append((start, e))
        out.append((name, pieces))
    return out


def group_norms(update: Update, groups: Sequence[tuple[str, Ranges]],
                boundaries: Sequence[int] | None = None) -> torch.Tensor:
    """Per-group L2 norms of an update, as a float64 tensor of ``len(groups)``.

    ``update``: a 1-D tensor over the flat buffer, or ``(offset, tensor)`` pieces as
    `fl_geo.runtime.wire.decode` returns them (any order, any floating dtype); elements outside every
    group are ignored. Arithmetic as `fl_geo.runtime.wire.check_finite_and_norm`: per chunk of
    `CHUNK_ELEMS` an fp32 sum of squares (``torch.dot``), fp16/bf16 chunks first converted into
    a chunk-sized scratch (never a whole-piece fp32 copy), chunk sums accumulated in fp64.
    A NaN/±Inf element, or an fp32 overflow of a chunk's sum, makes its group's norm NaN/+Inf:
    nothing is raised, the caller rejects (a non-finite norm never passes `Penalty.observe`).

    ``boundaries`` (the spec's tensor offsets, as `Penalty` passes them): every range is cut at
    them, so each tensor is read in chunks from its own first element and its sum is added to its
    group in tensor order. A norm then has the same bits however the buffer is split into
    pieces or shards (`fl_geo.core.shards.tensor_sq_sums`, the sharded parameter server).
    """
    if boundaries is not None:
        groups = _split_at(groups, boundaries)
    segments = _segments(groups)
    starts = [b for b, _, _ in segments]
    sums = [0.0] * len(groups)
    scratch: torch.Tensor | None = None
    for offset, flat in sorted(_as_pieces(update), key=lambda p: p[0]):
        stop = offset + flat.numel()
        k = max(bisect_right(starts, offset) - 1, 0)
        while k < len(segments) and segments[k][0] < stop:
            begin, end, g = segments[k]
            lo, hi = max(begin, offset), min(end, stop)
            part = 0.0
            for b, e in chunk_ranges(lo - offset, hi - offset):
                chunk = flat[b:e]
                if chunk.dtype not in (torch.float32, torch.float64):
                    if scratch is None or scratch.device != chunk.device:
                        scratch = torch.empty(CHUNK_ELEMS, dtype=torch.float32,
                                              device=chunk.device)
                    chunk = scratch[: e - b].copy_(chunk)
                part += float(torch.dot(chunk, chunk))
            sums[g] += part
            k += 1
    return torch.tensor(sums, dtype=torch.float64).sqrt()


def scale_ranges_(buffer: torch.Tensor, groups: Sequence[tuple[str, Ranges]],
                  factors: torch.Tensor) -> None:
    """Multiply each group's ranges of a flat buffer by its factor, in place (factor 1: skipped,
    so the common case costs no pass over the data)."""
    if factors.numel() != len(groups):
        raise ValueError(f"need one factor per group: {factors.numel()} for {len(groups)}")
    for (_, ranges), f in zip(groups, factors.tolist(), strict=True):
        if f != 1.0:
            for b, e in ranges:
                buffer[b:e].mul_(f)


def clip_(update: torch.Tensor, groups: Sequence[tuple[str, Ranges]], phi: float,
          eps: float = 1e-6, boundaries: Sequence[int] | None = None) -> torch.Tensor:
    """Δ̂ = min(1, φ/(‖Δ̄‖+ε))·Δ̄ per group, in place on a flat buffer; returns the factors.

    One group over everything is Di-PS's global clip (φ = 1, there without ε); one group per
    module is EDiT's (φ = 10; atorch clips each FSDP unit). The norms take one read of the
    buffer, the scaling one more read-write of the groups that are actually clipped.
    """
    phi, eps = float(phi), float(eps)
    if not (phi > 0 and math.isfinite(phi)):
        raise ValueError(f"clip threshold φ must be finite and > 0, got {phi}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    norms = group_norms(update, groups, boundaries)
    if not bool(torch.isfinite(norms).all()):
        bad = [groups[i][0] for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
        raise ValueError(f"cannot clip a non-finite averaged update (groups {bad})")
    factors = torch.clamp(phi / (norms + eps), max=1.0)
    scale_ranges_(update, groups, factors)
    return factors


# ---------------------------------------------------------------------------------------------
# Statistics and tests


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
        if state.get("keying") != self.keying or state.get("num_groups") != self.num_groups:
            raise ValueError(
                f"EmaStats state is for keying {state.get('keying')!r} with "
                f"{state.get('num_groups')} groups; this one has {self.keying!r} with "
                f"{self.num_groups}"
            )
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
        if state.get("rule") != self.rule or state.get("num_groups") != self.num_groups:
            raise ValueError(
                f"OutlierTest state is for rule {state.get('rule')!r} with "
                f"{state.get('num_groups')} groups; this one has {self.rule!r} with "
                f"{self.num_groups}"
            )
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


# ---------------------------------------------------------------------------------------------
# Weights


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


# ---------------------------------------------------------------------------------------------
# The penalty of one outer step


@dataclass(frozen=True)
class Verdict:
    """What `Penalty.observe` decided for one update; all tensors are ``[num_groups]``.

    ``accepted``: fold these groups. ``z``: the scores (0 in warm-up). ``scored``: z was real
    (key and group past warm-up). ``weights``: unnormalised fold weights (0 = do not fold this
    group). ``rescale``: multiply the running sum's group by this before folding (1 = untouched).
    """

    index: int
    node: str
    key: str
    norms: torch.Tensor
    z: torch.Tensor
    scored: torch.Tensor
    accepted: torch.Tensor
    weights: torch.Tensor
    rescale: torch.Tensor
    tokens: int | None
    staleness: float

    @property
    def any_accepted(self) -> bool:
        """True if at least one group of the update will be folded."""
        return bool(self.accepted.any())


@dataclass(frozen=True)
class Rejection:
    """One update with at least one rejected group, for logs and metrics."""

    index: int
    node: str
    groups: tuple[str, ...]
    z: tuple[float, ...]
    norms: tuple[float, ...]


@dataclass(frozen=True)
class StepReport:
    """Outcome of a committed step: counts, rejections (node and score) and rollbacks."""

    updates: int
    accepted: torch.Tensor  # accepted updates per group
    rejections: list[Rejection] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    temperature: torch.Tensor | None = None  # per group, norm_softmax only


@dataclass
class _Step:
    weights: StreamingWeights
    verdicts: list[Verdict] = field(default_factory=list)


class Penalty:
    """The pseudo-gradient penalty of docs/algorithms.md §4 for a flat buffer laid out by ``spec``.

    Parameters (defaults as docs/algorithms.md §4): ``granularity`` ``global``|``module``; ``rule``
    ``zscore``|``relative_max``; ``threshold`` δ or β (3); ``warmup`` observations per key
    before z is real (20); ``keying`` ``node``|``pooled``; ``weighting`` one of `WEIGHT_KINDS`
    or a list (product, renormalised); ``temperature`` T of ``norm_softmax`` (1) or ``"auto"``;
    ``clip`` φ or None; ``eps`` ε of the clip (1e-6) and floor of an auto temperature;
    ``ema_alpha`` α (0.02); ``window`` W of E (16); ``adaptive_threshold`` (zscore only);
    ``reject`` False turns the outlier test off (every finite update is accepted).

    Per step: `norms` → `observe` (→ `fold_`) for each update, then `normalise_`, `clip_`,
    `rolled_back`, the caller's outer step, `commit`. `score` is the side-effect-free test.
    Under ``global`` granularity there is one group, so a rejection rejects the whole update;
    under ``module`` each module is accepted, weighted, clipped and rolled back on its own
    (EDiT Algorithm 2).
    """

    def __init__(
        self,
        spec: ParamSpec,
        granularity: str = "global",
        rule: str = "zscore",
        threshold: float = 3.0,
        warmup: int = 20,
        keying: str = "node",
        weighting: str | Sequence[str] = "tokens",
        temperature: float | str = 1.0,
        clip: float | None = None,
        eps: float = 1e-6,
        ema_alpha: float = 0.02,
        window: int = 16,
        adaptive_threshold: bool = False,
        reject: bool = True,
    ) -> None:
        self.spec = spec
        # reject=False (EDiT ablation "w/o anomaly elimination"): score and keep statistics, but
        # accept every finite update.
        self.reject = bool(reject)
        self.granularity = granularity
        self.groups = module_groups(spec, granularity)
        if spec.numel == 0:
            raise ValueError("the penalty needs a non-empty parameter buffer")
        self.group_names = [name for name, _ in self.groups]
        self.num_groups = len(self.groups)
        self.weighting = _parse_weighting(weighting)
        if isinstance(temperature, str):
            if temperature != "auto":
                raise ValueError(f"temperature must be a number or 'auto', got {temperature!r}")
        else:
            temperature = float(temperature)
            if not (temperature > 0 and math.isfinite(temperature)):
                raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        self.temperature = temperature
        if clip is not None:
            clip = float(clip)
            if not (clip > 0 and math.isfinite(clip)):
                raise ValueError(f"clip φ must be finite and > 0 (or None), got {clip}")
        self.clip = clip
        self.eps = float(eps)
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be finite and >= 0, got {eps}")
        self.stats = EmaStats(self.num_groups, ema_alpha, warmup, keying)
        self.test = OutlierTest(self.num_groups, rule, threshold, window, adaptive_threshold,
                                history=warmup)
        # Mean accepted norm of the last step that accepted something, per group: the
        # temperature of the next step under temperature="auto" (NaN: none yet).
        self._last_mean_norm = torch.full((self.num_groups,), math.nan, dtype=torch.float64)
        self._step: _Step | None = None
        self._full = self.num_groups == 1 and self.groups[0][1] == [(0, spec.numel)]

    # -- per update ----------------------------------------------------------------------------

    def norms(self, update: Update) -> torch.Tensor:
        """Per-group L2 norms of an update (`group_norms`), after checking it fits the buffer.
        Non-finite values give NaN/+Inf norms, which `observe` rejects."""
        pieces = _as_pieces(update)
        for offset, piece in pieces:
            if offset < 0 or offset + piece.numel() > self.spec.numel:
                raise ValueError(f"piece [{offset}, {offset + piece.numel()}) outside the "
                                 f"buffer of {self.spec.numel}")
        if isinstance(update, torch.Tensor) and update.numel() != self.spec.numel:
            raise ValueError(f"update has {update.numel()} elements, the buffer "
                             f"{self.spec.numel}")
        return group_norms(pieces, self.groups, self.spec.offsets)

    def score(self, node: Any, norms: NormsLike) -> tuple[torch.Tensor, torch.Tensor]:
        """``(accept[num_groups] bool, z[num_groups])`` against the statistics of the last
        commit; changes nothing. Non-finite norms are always rejected."""
        g = _check_norms(norms, self.num_groups)
        z = self.stats.zscores(node, g)
        if not self.reject:
            return torch.isfinite(g), z
        return self.test.accept(self.stats.stats_key(node), z) & torch.isfinite(g), z

    def observe(self, node: Any, norms: NormsLike, tokens: int | None = None,
                staleness: float = 0) -> Verdict:
        """Score an update and enter it into the current step; returns how to fold it.

        ``tokens`` is required by ``tokens`` weighting, ``staleness`` (τ ≥ 0) used by
        ``staleness`` weighting. Arguments are validated before the step changes.
        """
        g = _check_norms(norms, self.num_groups)
        base_weight(self.weighting, tokens, staleness)  # validate before any state changes
        accepted, z = self.score(node, g)
        step = self._open_step()
        weights, rescale = step.weights.push(g, accepted, tokens, staleness)
        verdict = Verdict(
            index=len(step.verdicts), node=str(node), key=self.stats.stats_key(node),
            norms=g, z=z, scored=self.stats.ready(node), accepted=accepted, weights=weights,
            rescale=rescale, tokens=tokens, staleness=float(staleness),
        )
        step.verdicts.append(verdict)
        return verdict

    def fold_(self, acc: WeightedAccumulator, update: Update, verdict: Verdict) -> None:
        """Apply ``verdict.rescale`` to the running sum, then fold each accepted group of the
        update with its weight (one read of the update in all).

        The accumulator is used as a plain running sum: its ``count``/``total_weight`` count
        per-group folds, so take the mean with `normalise_` (on ``acc.buffer``), not
        ``acc.mean()``. Rejected and negligible groups are not read at all.
        """
        if bool((verdict.rescale != 1.0).any()):
            scale_ranges_(acc.buffer, self.groups, verdict.rescale)
        weights = verdict.weights.tolist()
        if self._full:
            if weights[0] > 0:
                acc.add(update, weights[0])
            return
        pieces = _as_pieces(update)
        for (_, ranges), w in zip(self.groups, weights, strict=True):
            if w > 0:
                acc.add(restrict(pieces, ranges), w)

    # -- step end ------------------------------------------------------------------------------

    @property
    def total_weight(self) -> torch.Tensor:
        """Σ of the fold weights per group in the current step (after rescales)."""
        step = self._step
        return (step.weights.total.clone() if step is not None
                else torch.zeros(self.num_groups, dtype=torch.float64))

    @property
    def accepted_counts(self) -> torch.Tensor:
        """Accepted updates per group in the current step."""
        step = self._step
        return (step.weights.count.clone() if step is not None
                else torch.zeros(self.num_groups, dtype=torch.int64))

    @property
    def rolled_back_mask(self) -> torch.Tensor:
        """Groups with no accepted update in the current step (every update was rejected)."""
        return self.accepted_counts == 0

    @property
    def rolled_back(self) -> list[str]:
        """Names of the groups to roll back (EDiT Algorithm 2, lines 7–8): do not step them
        (outer momentum untouched) and have the workers restart them from θ_t."""
        return [n for n, bad in zip(self.group_names, self.rolled_back_mask.tolist(),
                                    strict=True) if bad]

    def ranges(self, names: Iterable[str]) -> Ranges:
        """Flat-buffer ranges of the named groups, sorted (e.g. of `rolled_back`)."""
        index = {name: i for i, name in enumerate(self.group_names)}
        return sorted(r for name in names for r in self.groups[index[name]][1])

    def normalise_(self, buffer: torch.Tensor) -> torch.Tensor:
        """Divide each group of the running sum by its total weight, in place: Σ w·Δ → Δ̄.
        Rolled-back groups (total 0) are left as they are. Returns the totals."""
        if buffer.dim() != 1 or buffer.numel() != self.spec.numel:
            raise ValueError(f"buffer must be 1-D with {self.spec.numel} elements, got "
                             f"{tuple(buffer.shape)}")
        totals = self.total_weight
        for (_, ranges), total in zip(self.groups, totals.tolist(), strict=True):
            if total > 0 and total != 1.0:
                for b, e in ranges:
                    buffer[b:e].div_(total)
        return totals

    def clip_(self, update: torch.Tensor) -> torch.Tensor:
        """Clip the averaged update in place per group (`clip_` with φ = ``clip``); returns the
        scale factors (all 1, without touching the buffer, when clipping is off)."""
        if self.clip is None:
            return torch.ones(self.num_groups, dtype=torch.float64)
        if update.dim() != 1 or update.numel() != self.spec.numel:
            raise ValueError(f"update must be 1-D with {self.spec.numel} elements, got "
                             f"{tuple(update.shape)}")
        return clip_(update, self.groups, self.clip, self.eps, self.spec.offsets)

    def finalize_weights(self) -> torch.Tensor:
        """Normalised weights ``[num_updates, num_groups]`` of the step's updates, from their
        scalars (`compute_weights` with the temperature the step used): equal to the streaming
        ``weights / total_weight`` up to rounding, for callers that fold at the end."""
        step = self._step
        if step is None or not step.verdicts:
            return torch.zeros(0, self.num_groups, dtype=torch.float64)
        vs = step.verdicts
        return compute_weights(
            torch.stack([v.norms for v in vs]), torch.stack([v.accepted for v in vs]),
            self.weighting, step.weights.temperature,
            tokens=[v.tokens for v in vs] if "tokens" in self.weighting else None,
            staleness=[v.staleness for v in vs], eps=self.eps,
        )

    def commit(self) -> StepReport:
        """Close the step: EMA statistics, E and z windows learn the accepted updates in arrival
        order (rejected groups touch nothing); the auto temperature of the next step is set."""
        step = self._step
        if step is None:
            return StepReport(updates=0, accepted=torch.zeros(self.num_groups, dtype=torch.int64),
                              rolled_back=list(self.group_names))
        rolled_back = self.rolled_back
        rejections: list[Rejection] = []
        norm_sum = torch.zeros(self.num_groups, dtype=torch.float64)
        for v in step.verdicts:
            self.stats.update(v.key, v.norms, v.accepted)
            self.test.update(v.key, v.z, v.accepted & v.scored)
            norm_sum += torch.where(v.accepted, v.norms, 0.0)
            if not bool(v.accepted.all()):
                bad = torch.nonzero(~v.accepted).flatten().tolist()
                rejections.append(Rejection(
                    index=v.index, node=v.node, groups=tuple(self.group_names[i] for i in bad),
                    z=tuple(float(v.z[i]) for i in bad),
                    norms=tuple(float(v.norms[i]) for i in bad)))
        counts = step.weights.count
        self._last_mean_norm = torch.where(
            counts > 0, norm_sum / counts.clamp(min=1), self._last_mean_norm)
        self._step = None
        return StepReport(
            updates=len(step.verdicts), accepted=counts.clone(), rejections=rejections,
            rolled_back=rolled_back,
            temperature=(step.weights.temperature.clone() if "norm_softmax" in self.weighting
                         else None),
        )

    def discard_step(self) -> None:
        """Forget the open step without learning from it (its updates were voided: a sharded
        parameter server lost a follower mid-window). The statistics stay as at the last commit."""
        self._step = None

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Statistics between steps (plain tensors, ints, str): EMA, E, z windows and the last
        step's mean norm. An uncommitted step is not included (nor are its replies)."""
        return {
            "granularity": self.granularity,
            "groups": list(self.group_names),
            "stats": self.stats.state_dict(),
            "test": self.test.state_dict(),
            "last_mean_norm": self._last_mean_norm.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output; the groups must match. Drops any open step."""
        if state.get("granularity") != self.granularity or list(state.get("groups", [])) != \
                self.group_names:
            raise ValueError(
                f"penalty state is for {state.get('granularity')!r} groups "
                f"{list(state.get('groups', []))[:5]}, this penalty has {self.granularity!r} "
                f"groups {self.group_names[:5]}"
            )
        last = torch.as_tensor(state["last_mean_norm"], dtype=torch.float64)
        if last.numel() != self.num_groups:
            raise ValueError(f"last_mean_norm has {last.numel()} entries, expected "
                             f"{self.num_groups}")
        # Load into fresh copies and swap, so a bad state leaves this penalty untouched.
        stats = EmaStats(self.num_groups, self.stats.alpha, self.stats.warmup, self.stats.keying)
        stats.load_state_dict(state["stats"])
        test = OutlierTest(self.num_groups, self.test.rule, self.test.threshold, self.test.window,
                           self.test.adaptive_threshold, self.test.history)
        test.load_state_dict(state["test"])
        self.stats, self.test = stats, test
        self._last_mean_norm = last.reshape(-1).clone()
        self._step = None

    # -- internals -----------------------------------------------------------------------------

    def _open_step(self) -> _Step:
        if self._step is None:
            if self.temperature == "auto":
                # NaN (no previous step) stays NaN: the step's first accepted norm is used.
                temp = self._last_mean_norm.clamp(min=max(self.eps, _MIN_TEMPERATURE))
            else:
                temp = torch.full((self.num_groups,), float(self.temperature),
                                  dtype=torch.float64)
            self._step = _Step(StreamingWeights(self.num_groups, self.weighting, temp,
                                                self.eps))
        return self._step


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
        if self.penalty._full:
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
