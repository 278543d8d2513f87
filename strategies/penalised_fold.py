"""The pseudo-gradient penalty's part of an outer step (docs/algorithms.md §4), shared by every
loop that runs with ``penalty.enabled`` (Di-PS and EDiT / A-EDiT by default).

For each update: its per-group norms, the rejection of a non-finite or out-of-bound one, the
z-score test against the step-start statistics, and the weighted fold into the loop's running
sum. For the step: the normalised mean, the clip φ (remembered for the step's metrics: whether
φ binds depends on the model's scale and nothing else in the log says so), and the outer step
with the rollback of modules no update was accepted for. The loop owns the model, the
accumulator, the optimizer and the `Penalty`; this object only sequences them, so every loop
applies the penalty the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from fl_geo.config import FlGeoConfig
from fl_geo.core.penalty import Penalty
from fl_geo.core.state import ParamSpec

if TYPE_CHECKING:
    from fl_geo.strategies.base import OuterLoop
    from fl_geo.strategies.replies import Tally

log = logging.getLogger("fl_geo")


def penalty_from_config(cfg: FlGeoConfig, spec: ParamSpec) -> Penalty | None:
    """The pseudo-gradient penalty of docs/algorithms.md §4, or None when ``penalty.enabled`` is off.

    ``penalty.outlier: false`` (an ablation switch) keeps the statistics but never rejects.
    """
    p = cfg.penalty
    if not p.enabled:
        return None
    return Penalty(
        spec, granularity=p.granularity, rule=p.rule,
        threshold=p.threshold, warmup=p.warmup, reject=p.outlier,
        keying=p.keying, weighting=p.weighting.split("*"),
        temperature="auto" if p.temperature == 0 else p.temperature,
        clip=p.clip or None, clip_mode=p.clip_mode, clip_ratio=p.clip_ratio,
        adaptive_threshold=p.adaptive_threshold,
    )


class PenalisedFold:
    """Fold, clip and step with the penalty of ``loop`` (its ``penalty`` must be set)."""

    def __init__(self, loop: OuterLoop) -> None:
        self.loop = loop
        self._clip_last: tuple[float, list[float]] | None = None  # the last step's clip (`clip_metrics`)

    @property
    def penalty(self) -> Penalty:
        # read at each call: a resumed loop swaps in the checkpoint's statistics
        assert self.loop.penalty is not None, "the penalty is off in this run"
        return self.loop.penalty

    def fold(self, tally: Tally, node: int, update: Any, tokens: int, staleness: float = 0,
             scored: Any = None) -> Any:
        """Norms -> outlier test against the step-start statistics -> weighted fold.

        ``scored``: the update as it arrived, when ``update`` is what a robust rule made of it
        (centered clipping): the outlier test, the statistics and the weights see the arrived
        norms, so a clip cannot hide a ×10 update from the penalty; ``update`` is what folds.
        Returns the verdict, or None when every group was rejected (logged with node and score).
        Statistics are keyed by partition id: Flower's node ids change from run to run.
        """
        loop, penalty = self.loop, self.penalty
        norms = penalty.norms(update if scored is None else scored)
        if not bool(torch.isfinite(norms).all()):
            loop._reject(tally, node, "update holds NaN or Inf values")
            return None
        bound = loop.update_bound()
        if bound is not None and float(norms.norm()) > bound:
            loop._reject(tally, node, f"update norm {float(norms.norm()):.4g} exceeds the bound {bound:.4g} "
                                      "(strategy.max_update_ratio)")
            return None
        key = loop.profiles[node].partition_id if node in loop.profiles else node
        verdict = penalty.observe(key, norms, tokens=tokens, staleness=staleness)
        if bool(verdict.scored.any()):
            z = float(verdict.z[verdict.scored].max())
            tally.max_z = z if math.isnan(tally.max_z) else max(tally.max_z, z)
        if not verdict.any_accepted:
            tally.rejected_groups += penalty.num_groups
            z = float(verdict.z.max()) if verdict.z.numel() else float("nan")
            loop._reject(tally, node, f"outlier (z={z:.2f}, norm={float(norms.norm()):.4g}, rule {loop.cfg.penalty.rule})")
            return None
        if not bool(verdict.accepted.all()):
            bad = [n for n, ok in zip(penalty.group_names, verdict.accepted.tolist(), strict=True) if not ok]
            zs = [f"{float(z):.2f}" for z, ok in zip(verdict.z.tolist(), verdict.accepted.tolist(), strict=True) if not ok]
            log.warning("node %s (partition %s): modules %s rejected as outliers (z=%s)", node, key, ", ".join(bad),
                        ", ".join(zs))
            tally.rejected_groups += len(bad)
        penalty.fold_(loop.accumulator, update, verdict)
        return verdict

    def record_clip(self, pre_norm: float, factors: Sequence[float]) -> None:
        """Remember how hard this outer step's clip φ bound, for `clip_metrics`.

        ``pre_norm`` is ‖Δ̄‖ over the whole model before the clip; ``factors`` the per-group
        min(1, φ/(‖Δ̄_g‖+ε)) applied (one for a global clip).
        """
        self._clip_last = (float(pre_norm), [float(f) for f in factors])

    def clip_metrics(self) -> dict[str, float]:
        """``outer/clip_norm`` (‖Δ̄‖ before the clip), ``outer/clip_scale`` (the mean factor over
        groups: 1 = φ did not bind, 0.1 = the step was cut to a tenth) and ``outer/clip_bound``
        (the share of groups whose factor was below 1) of the last clipped step, then forgotten;
        empty when no clip ran since the last call (clip off, or no step taken)."""
        last, self._clip_last = self._clip_last, None
        if last is None:
            return {}
        pre, factors = last
        return {"outer/clip_norm": pre, "outer/clip_scale": sum(factors) / len(factors),
                "outer/clip_bound": sum(f < 1.0 for f in factors) / len(factors)}

    def step(self, buf: torch.Tensor | None = None) -> list[str]:
        """Clip, then the outer step; modules every worker failed on are not stepped (rollback:
        their parameters and outer momentum stay as they were). ``buf`` is the normalised mean
        (the accumulator's buffer after `Penalty.normalise_` by default). Returns the
        rolled-back module names."""
        loop, penalty = self.loop, self.penalty
        if buf is None:
            buf = loop.accumulator.buffer
            penalty.normalise_(buf)
        if penalty.clip is not None:
            pre = float(torch.linalg.vector_norm(buf))  # one read of Δ̄: the clip's input, for the log
            self.record_clip(pre, penalty.clip_(buf).tolist())
        rolled = penalty.rolled_back
        skip = penalty.ranges(rolled)
        params = loop.global_params
        live = [t for t in loop.optimizer.state_dict().values() if torch.is_tensor(t) and t.numel() == loop.spec.numel]
        saved = [(b, e, [x[b:e].clone() for x in (params, *live)]) for b, e in skip]
        loop.optimizer.step(params, buf)
        for b, e, copies in saved:
            for x, c in zip((params, *live), copies, strict=True):
                x[b:e].copy_(c)
        if skip:
            log.warning("outer step %d: modules %s had no accepted update and were not stepped",
                        loop.version + 1, ", ".join(rolled))
        return rolled
