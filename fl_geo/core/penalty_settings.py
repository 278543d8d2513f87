"""The ``penalty`` section: how the outer loops judge and weight pseudo-gradients (EDiT, Di-PS).

The section is read by `fl_geo.core.penalty` (the rule, statistics, weights and clipping) and the
strategies that switch it on. Its own ranges are checked here, by the code that knows what each
value means; whether a strategy may use the penalty at all is a cross-section check left to
`fl_geo.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require

PENALTY_WEIGHT_PARTS = ("tokens", "norm_softmax", "uniform", "staleness")


@dataclass
class PenaltySection:
    """Pseudo-gradient penalty (docs/algorithms.md §4): Di-PS, EDiT and HALoS share it."""

    enabled: bool = False
    granularity: str = "global"  # global | module
    rule: str = "zscore"  # zscore (EDiT) | relative_max (Di-PS)
    threshold: float = 3.0  # delta (zscore) or beta (relative_max)
    warmup: int = 20
    keying: str = "node"  # node | pooled
    weighting: str = "tokens"  # tokens | norm_softmax | uniform | staleness (or "a*b" products)
    temperature: float = 1.0  # norm_softmax T; 0 = auto (mean accepted norm of the previous step)
    clip: float = 0.0  # phi; 0 = no clipping (in either mode)
    # absolute: phi = clip (the papers' LLM-scale constants); relative: phi = clip_ratio x the
    # running mean of the clipped update norms (scale-free, docs/algorithms.md §4, "The relative clip")
    clip_mode: str = "absolute"
    clip_ratio: float = 2.0
    adaptive_threshold: bool = False
    # Ablation switch (EDiT Fig. 7a "w/o AE"): false = never reject (statistics still kept).
    # "w/o WA" is weighting=uniform, "w/o GC" is clip=0.
    outlier: bool = True

    def check(self) -> None:
        """Raise `ConfigError` for a value of this section that no strategy could use."""
        require(self.granularity in ("global", "module"), "penalty.granularity must be global or module")
        require(self.rule in ("zscore", "relative_max"), "penalty.rule must be zscore or relative_max")
        require(self.keying in ("node", "pooled"), "penalty.keying must be node or pooled")
        require(self.threshold > 0 and self.warmup >= 0 and self.clip >= 0 and self.temperature >= 0,
                "penalty: threshold > 0, warmup, clip, temperature >= 0")
        require(self.clip_mode in ("absolute", "relative"), "penalty.clip_mode must be absolute or relative")
        require(self.clip_ratio > 0, f"penalty.clip_ratio must be > 0, got {self.clip_ratio}")
        for part in self.weighting.split("*"):
            require(part in PENALTY_WEIGHT_PARTS, f"penalty.weighting part '{part}' is unknown")
