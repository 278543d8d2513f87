"""The ``wire`` section: the precision model-sized payloads travel in, and the uplink's compression.

`fl_geo.runtime.wire` encodes and decodes at these precisions; with ``compress`` set, the uplink
(a site's pseudo-gradient) travels as a `fl_geo.core.compress` payload instead
(`fl_geo.runtime.compressed`, docs/compression.md). The section lives in its own module, not in
``wire.py``, so that the config schema can hold it without importing Flower and torch's codec;
the check of its values lives with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fl_geo.errors import ConfigError, require

if TYPE_CHECKING:
    from fl_geo.core.compress import CompressSettings

WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
# wire.compress: none (the uplink in wire.up precision, as before) or a codec of fl_geo.core.compress
# (fp32 / bf16 are wire.up's own precisions: not offered here)
UPLINK_CODECS = ("none", "int8", "int4", "int2", "topk", "dct_topk")


@dataclass
class WireSection:
    """Precision of model-sized payloads on the wire (the outer state is always fp32), and the
    compression of the uplink (client -> server pseudo-gradients of fl-geo's ClientApp).

    ``compress``: none | int8 | int4 | int2 | topk | dct_topk (`UPLINK_CODECS`); the other
    ``compress_*`` keys and ``error_feedback`` are `CompressSettings`'s, with its defaults
    (``compress_chunk`` None: 4096 for topk, 256 for dct_topk).
    """

    up: str = "fp32"  # client -> server pseudo-gradients
    down: str = "fp32"  # server -> client model
    compress: str = "none"
    compress_ratio: float = 0.01  # sparse codecs: fraction of each chunk kept
    compress_chunk: int | None = None  # sparse codecs: elements per chunk
    compress_values: str = "int2"  # sparse codecs: the kind of the kept values
    compress_block: int = 128  # int codes: elements per fp32 scale
    error_feedback: bool = True  # keep each site's residual (per run, in its inner state)

    def check(self) -> None:
        """Raise `ConfigError` for a precision the codec does not know or a compression setting
        out of range (`CompressSettings.check`)."""
        for side in ("up", "down"):
            val = getattr(self, side)
            require(val in WIRE_PRECISIONS, f"wire.{side} must be one of {WIRE_PRECISIONS}, got '{val}'")
        require(self.compress in UPLINK_CODECS, f"wire.compress must be one of {', '.join(UPLINK_CODECS)}, "
                                                f"got {self.compress!r}")
        if self.compress == "none":
            return
        require(self.up == "fp32", f"wire.compress={self.compress} replaces wire.up for the uplink; leave wire.up at "
                                   f"fp32 (got {self.up})")
        settings = self.uplink()
        assert settings is not None
        try:
            settings.check()
        except ConfigError as exc:  # named by the wire section's keys
            msg = str(exc)
            for key in ("ratio", "chunk", "values", "block"):
                msg = msg.replace(f"compress.{key}", f"wire.compress_{key}")
            msg = msg.replace("compress.error_feedback", "wire.error_feedback").replace("compress.codec", "wire.compress")
            raise ConfigError(msg) from None

    def uplink(self) -> CompressSettings | None:
        """The uplink's `CompressSettings`, None when ``compress`` is none."""
        if self.compress == "none":
            return None
        from fl_geo.core.compress import CompressSettings

        return CompressSettings(codec=self.compress, ratio=self.compress_ratio, chunk=self.compress_chunk,
                                values=self.compress_values, block=self.compress_block,
                                error_feedback=self.error_feedback)


def uplink_json(wire: WireSection) -> str | None:
    """The uplink compression as the JSON a request carries (``wire_compress``), None when off."""
    s = wire.uplink()
    if s is None:
        return None
    return json.dumps({"codec": s.codec, "ratio": s.ratio, "chunk": s.chunk, "values": s.values, "block": s.block,
                       "error_feedback": s.error_feedback}, sort_keys=True)


def uplink_from_json(text: str | None) -> CompressSettings | None:
    """`CompressSettings` from a request's ``wire_compress`` (checked: `ConfigError` when out of range)."""
    if text is None:
        return None
    from fl_geo.core.compress import CompressSettings

    values = json.loads(text)
    if not isinstance(values, dict) or set(values) != {"codec", "ratio", "chunk", "values", "block", "error_feedback"}:
        raise ConfigError(f"wire_compress must hold codec, ratio, chunk, values, block, error_feedback; got {text:.120}")
    settings = CompressSettings(**values)
    settings.check()
    return settings
