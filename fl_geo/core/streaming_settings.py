"""The ``streaming`` section: fragments, overlap and merge rule of Streaming DiLoCo and CoCoDC.

`fl_geo.core.streaming` turns these values into the fragment schedule and the merge. The ranges
of the section alone are checked here (the defaults pass them for every strategy); the schedule
against ``strategy.inner_steps``, the model's blocks and the strategy knobs the streaming loop
does not implement read other sections and are checked in `fl_geo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require


@dataclass
class StreamingSection:
    """Streaming DiLoCo and CoCoDC (docs/algorithms.md §7); H is ``strategy.inner_steps``."""

    # P: strided fragments of the transformer blocks (1 <= P <= the model's blocks; the built-in
    # model has 2 by default, the papers use 4 on deeper models: configs/streaming_diloco.yaml)
    fragments: int = 2
    overlap: int = 5  # tau: inner steps between a fragment's sync start and its merge (0 <= tau < H/P)
    # how a worker merges a new global fragment: blend = (1 - alpha) local + alpha global (Streaming
    # DiLoCo); compensate = CoCoDC's delay compensation with lambda = compensation
    rule: str = "blend"
    alpha: float = 0.5  # blend: weight of the global fragment (1 = overwrite)
    compensation: float = 0.5  # compensate: lambda (0 = new global fragment + local progress)
    adaptive: bool = False  # CoCoDC Algorithm 2: N = max(P, floor(gamma H T_c / T_s)) syncs per H steps
    gamma: float = 0.4  # adaptive: share of the network capacity to use, in (0, 1]
    # also score every worker's own model θ^m whenever val/loss is taken (val/worker_loss): the
    # server's global model is a patchwork of fragments stepped at different times, which no
    # worker holds. Streaming strategies only (DiLoCo's workers hold the global model after a sync).
    eval_workers: bool = False
    # the old fragment quantiser, now an alias (fl_geo.config.uplink_wire): int8 / int4 means
    # wire.compress=<it>, wire.compress_block=quantize_block, wire.error_feedback=false (the same
    # bytes and decoded values as before); wire.compress offers every codec and error feedback.
    quantize: str = "none"
    quantize_block: int = 128

    def check(self) -> None:
        """Raise `ConfigError` for a value out of its range, whatever the strategy."""
        require(self.fragments >= 1, f"streaming.fragments (P) must be >= 1, got {self.fragments}")
        require(self.rule in ("blend", "compensate"), f"streaming.rule must be blend or compensate, got {self.rule!r}")
        require(self.overlap >= 0, f"streaming.overlap (tau) must be >= 0, got {self.overlap}")
        require(0 <= self.alpha <= 1, f"streaming.alpha must be in [0, 1], got {self.alpha}")
        require(self.compensation >= 0, f"streaming.compensation (lambda) must be >= 0, got {self.compensation}")
        require(0 < self.gamma <= 1, f"streaming.gamma must be in (0, 1], got {self.gamma}")
        require(self.quantize in ("none", "int8", "int4"),
                f"streaming.quantize must be none, int8 or int4, got {self.quantize!r}")
        require(self.quantize_block >= 1, f"streaming.quantize_block must be >= 1, got {self.quantize_block}")
