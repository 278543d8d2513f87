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

This module holds the policy only: the order of the calls above, what a step decides
(`Verdict`, `Rejection`, `StepReport`), rollback, the auto temperature carried from step to step,
and A-EDiT's step-weight mix (`StepWeightMix`). The parts live in one module each:
`fl_geo.core.groups` (groups, ranges, norms, clipping), `fl_geo.core.statistics` (EMA statistics
and outlier tests) and `fl_geo.core.weights` (weighting kinds, streaming fold weights with their
rescales, and the synchronous `compute_weights`; its docstring explains why each kind can be
folded on arrival and how ``temperature="auto"`` uses the previous step's mean accepted norm).
Import those names from their modules; this one exports only the policy.

Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.groups import (
    Ranges,
    Update,
    _as_pieces,
    clip_,
    group_norms,
    module_groups,
    restrict,
    scale_ranges_,
)
from fl_geo.core.relative_clip import RelativeClip
from fl_geo.core.state import ParamSpec
from fl_geo.core.statistics import EmaStats, NormsLike, OutlierTest, _check_norms
from fl_geo.core.weights import (
    _MIN_TEMPERATURE,
    StreamingWeights,
    _parse_weighting,
    base_weight,
    compute_weights,
)

__all__ = [
    "Penalty",
    "Rejection",
    "StepReport",
    "Verdict",
]


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
    ``clip`` φ or None (None: no clipping in either mode); ``clip_mode`` ``absolute`` (φ =
    ``clip``, the papers') or ``relative`` (φ_g = ``clip_ratio`` × the running mean of the
    group's clipped norms, `fl_geo.core.relative_clip`; docs/algorithms.md §4, "The relative
    clip");
    ``eps`` ε of the clip (1e-6) and floor of an auto temperature;
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
        clip_mode: str = "absolute",
        clip_ratio: float = 2.0,
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
        if clip_mode not in ("absolute", "relative"):
            raise ValueError(f"clip_mode must be 'absolute' or 'relative', got {clip_mode!r}")
        self.clip_mode = clip_mode
        self.relative = (RelativeClip(self.num_groups, clip_ratio)
                         if clip is not None and clip_mode == "relative" else None)
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

    @property
    def whole_model(self) -> bool:
        """One group covering the whole model (``granularity: global``): updates fold as is."""
        return self._full

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

    def clip_thresholds(self) -> torch.Tensor:
        """This step's φ per group ``[num_groups]``: ``clip`` (absolute), c·m_g (relative; +∞
        before a group's first step), +∞ when clipping is off."""
        if self.clip is None:
            return torch.full((self.num_groups,), math.inf, dtype=torch.float64)
        if self.relative is None:
            return torch.full((self.num_groups,), self.clip, dtype=torch.float64)
        return self.relative.thresholds()

    def record_clipped(self, clipped_norms: torch.Tensor) -> None:
        """Teach the relative clip this step's clipped norms ‖Δ̂_g‖ (groups rolled back this step
        are skipped); a no-op in absolute mode. For callers that clip without `clip_` (the
        sharded parameter server scales on its followers)."""
        if self.relative is not None:
            self.relative.update(clipped_norms, ~self.rolled_back_mask)

    def clip_(self, update: torch.Tensor) -> torch.Tensor:
        """Clip the averaged update in place per group (`clip_` with φ = `clip_thresholds`) and,
        in relative mode, learn the clipped norms; returns the scale factors (all 1, without
        touching the buffer, when clipping is off)."""
        if self.clip is None:
            return torch.ones(self.num_groups, dtype=torch.float64)
        if update.dim() != 1 or update.numel() != self.spec.numel:
            raise ValueError(f"update must be 1-D with {self.spec.numel} elements, got "
                             f"{tuple(update.shape)}")
        if self.relative is None:
            return clip_(update, self.groups, self.clip, self.eps, self.spec.offsets)
        # ‖Δ̂_g‖ as f_g·‖Δ̄_g‖ (what the sharded server, which never holds Δ̂, can also compute):
        # one more read of the buffer than the absolute clip
        norms = group_norms(update, self.groups, self.spec.offsets)
        factors = clip_(update, self.groups, self.relative.thresholds(), self.eps, self.spec.offsets)
        self.record_clipped(factors * norms)
        return factors

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
            **({"relative_clip": self.relative.state_dict()} if self.relative is not None else {}),
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
        if self.relative is not None and "relative_clip" in state:
            # a checkpoint from an absolute-mode run has none: the statistic starts afresh
            self.relative.load_state_dict(state["relative_clip"])
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
