"""The ``halos`` section: the local parameter servers of HALoS's two tiers.

`fl_geo.core.halos` builds the local servers from these values, in the simulation and in the
two-tier deployment of this package alike. The section's own ranges are checked here; the rule
that the HALoS global server takes no penalty reads two sections and stays in `fl_geo.config`.

``compress*`` / ``error_feedback`` compress what a local server sends the global one (its update
U_k over the inter-region link), separately from ``wire.compress`` (a worker's update to its local
server): the same codecs and keys as the ``wire`` section, default none (docs/compression.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fl_geo.errors import ConfigError, require

if TYPE_CHECKING:
    from fl_geo.core.compress import CompressSettings

# halos.compress: none (U_k at wire.up, as before) or a codec of fl_geo.core.compress
GLOBAL_CODECS = ("none", "int8", "int4", "int2", "sign", "topk", "dct_topk")


@dataclass
class HalosSection:
    """HALoS local parameter servers (docs/algorithms.md §6); the global server is ``strategy.*``."""

    accumulate: int = 32  # K: local updates per global update
    alpha: float = 0.25  # weight of the global model when a local server merges
    group_size: int = 0  # workers per local server ("consistent grouping"); 0 = one per region
    local_lr: float = 0.2 * 16  # delayed Nesterov of the local servers: lr x N
    local_momentum: float = 0.9
    local_buffer: int = 16  # N
    local_activation: float = 0.0  # c
    # local server -> global server: U_k compressed (none = at wire.up); CompressSettings' defaults
    compress: str = "none"
    compress_ratio: float = 0.01  # sparse codecs: fraction of each chunk kept
    compress_chunk: int | None = None  # sparse codecs: elements per chunk (None: 4096 topk, 256 dct_topk)
    compress_values: str = "int2"  # sparse codecs: the kind of the kept values
    compress_block: int = 128  # int codes: elements per fp32 scale
    error_feedback: bool = True  # keep each local server's residual (with its other state)
    error_feedback_decay: float = 1.0  # β: the residual's weight in the next step (1: plain EF)

    def check(self) -> None:
        """Raise `ConfigError` for a local-server setting out of its range."""
        require(self.accumulate >= 1, f"halos.accumulate (K) must be >= 1, got {self.accumulate}")
        require(0 <= self.alpha <= 1, f"halos.alpha must be in [0, 1], got {self.alpha}")
        require(self.group_size >= 0, f"halos.group_size must be >= 0, got {self.group_size}")
        require(self.local_lr > 0 and 0 <= self.local_momentum < 1 and self.local_buffer >= 1,
                "halos: local_lr > 0, local_momentum in [0, 1), local_buffer >= 1")
        require(self.local_activation >= 0, f"halos.local_activation must be >= 0, got {self.local_activation}")
        require(self.compress in GLOBAL_CODECS,
                f"halos.compress must be one of {', '.join(GLOBAL_CODECS)}, got {self.compress!r}")
        settings = self.global_uplink()
        if settings is None:
            return
        try:
            settings.check()
        except ConfigError as exc:  # named by this section's keys
            msg = str(exc)
            for key in ("ratio", "chunk", "values", "block"):
                msg = msg.replace(f"compress.{key}", f"halos.compress_{key}")
            msg = msg.replace("compress.feedback_decay", "halos.error_feedback_decay")
            msg = msg.replace("compress.error_feedback", "halos.error_feedback").replace("compress.codec", "halos.compress")
            raise ConfigError(msg) from None

    def global_uplink(self) -> CompressSettings | None:
        """The `CompressSettings` of a local server's update to the global one; None when
        ``compress`` is none."""
        if self.compress == "none":
            return None
        from fl_geo.core.compress import CompressSettings

        return CompressSettings(codec=self.compress, ratio=self.compress_ratio, chunk=self.compress_chunk,
                                values=self.compress_values, block=self.compress_block,
                                error_feedback=self.error_feedback, feedback_decay=self.error_feedback_decay)
