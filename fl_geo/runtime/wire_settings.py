"""The ``wire`` section: the precision model-sized payloads travel in.

`fl_geo.runtime.wire` encodes and decodes at these precisions. The section lives in its own
module, not in ``wire.py``, so that the config schema can hold it without importing Flower and
torch's codec; the check of its values lives with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require

WIRE_PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass
class WireSection:
    """Precision of model-sized payloads on the wire (the outer state is always fp32)."""

    up: str = "fp32"  # client -> server pseudo-gradients
    down: str = "fp32"  # server -> client model

    def check(self) -> None:
        """Raise `ConfigError` for a precision the codec does not know."""
        for side in ("up", "down"):
            val = getattr(self, side)
            require(val in WIRE_PRECISIONS, f"wire.{side} must be one of {WIRE_PRECISIONS}, got '{val}'")
