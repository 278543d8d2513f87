"""The ``wire`` section: the precision model-sized payloads travel in, and the compression of the
uplink (``compress*``) and of the downlink (``compress_down*``).

`fl_geo.runtime.wire` encodes and decodes at these precisions; with ``compress`` set, the uplink
(a site's pseudo-gradient) travels as a `fl_geo.core.compress` payload instead
(`fl_geo.runtime.compressed`, docs/compression.md). The section lives in its own module, not in
``wire.py``, so that the config schema can hold it without importing Flower and torch's codec;
the check of its values lives with it. The downlink's keys mirror the uplink's; its error
feedback is the server's x − x̂ (`fl_geo.core.downlink`), so it has no ``error_feedback`` key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fl_geo.errors import ConfigError, require

if TYPE_CHECKING:
    from fl_geo.core.compress import CompressSettings

WIRE_PRECISIONS = ("fp32", "fp16", "bf16")
# wire.compress: none (the uplink in wire.up precision, as before) or a codec of fl_geo.core.compress
# (fp32 / bf16 are wire.up's own precisions: not offered here)
UPLINK_CODECS = ("none", "int8", "int4", "int2", "sign", "topk", "dct_topk")
# wire.compress_down: the same codecs for the model delta the server sends (fl_geo.core.downlink)
DOWNLINK_CODECS = UPLINK_CODECS


@dataclass
class WireSection:
    """Precision of model-sized payloads on the wire (the outer state is always fp32), and the
    compression of the uplink (client -> server pseudo-gradients of fl-geo's ClientApp).

    ``compress``: none | int8 | int4 | int2 | sign | topk | dct_topk (`UPLINK_CODECS`); the other
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
    error_feedback_decay: float = 1.0  # β: the residual's weight in the next step (1: plain EF)
    compress_down: str = "none"  # the model delta the server sends (none: the whole model at wire.down)
    compress_down_ratio: float = 0.01
    compress_down_chunk: int | None = None
    compress_down_values: str = "int2"
    compress_down_block: int = 128

    def check(self) -> None:
        """Raise `ConfigError` for a precision the codec does not know or a compression setting
        out of range (`CompressSettings.check`)."""
        for side in ("up", "down"):
            val = getattr(self, side)
            require(val in WIRE_PRECISIONS, f"wire.{side} must be one of {WIRE_PRECISIONS}, got '{val}'")
        require(self.compress in UPLINK_CODECS, f"wire.compress must be one of {', '.join(UPLINK_CODECS)}, "
                                                f"got {self.compress!r}")
        require(self.compress_down in DOWNLINK_CODECS,
                f"wire.compress_down must be one of {', '.join(DOWNLINK_CODECS)}, got {self.compress_down!r}")
        if self.compress != "none":
            require(self.up == "fp32", f"wire.compress={self.compress} replaces wire.up for the uplink; leave wire.up "
                                       f"at fp32 (got {self.up})")
            _check_named(self.uplink(), "wire.compress")
        _check_named(self.downlink(), "wire.compress_down")

    def downlink(self) -> CompressSettings | None:
        """The downlink's `CompressSettings` (its error feedback off: it is x − x̂ on the server),
        None when ``compress_down`` is none."""
        if self.compress_down == "none":
            return None
        from fl_geo.core.compress import CompressSettings

        return CompressSettings(codec=self.compress_down, ratio=self.compress_down_ratio,
                                chunk=self.compress_down_chunk, values=self.compress_down_values,
                                block=self.compress_down_block, error_feedback=False)

    def uplink(self) -> CompressSettings | None:
        """The uplink's `CompressSettings`, None when ``compress`` is none."""
        if self.compress == "none":
            return None
        from fl_geo.core.compress import CompressSettings

        return CompressSettings(codec=self.compress, ratio=self.compress_ratio, chunk=self.compress_chunk,
                                values=self.compress_values, block=self.compress_block,
                                error_feedback=self.error_feedback, feedback_decay=self.error_feedback_decay)


def _check_named(settings: CompressSettings | None, key: str) -> None:
    """`CompressSettings.check`, its errors named by the wire section's keys (``key``: the codec's)."""
    if settings is None:
        return
    try:
        settings.check()
    except ConfigError as exc:
        msg = str(exc)
        for name in ("ratio", "chunk", "values", "block"):
            msg = msg.replace(f"compress.{name}", f"{key}_{name}")
        msg = msg.replace("compress.feedback_decay", "wire.error_feedback_decay")
        msg = msg.replace("compress.error_feedback", "wire.error_feedback").replace("compress.codec", key)
        raise ConfigError(msg) from None


def settings_json(s: CompressSettings | None) -> str | None:
    """Compression settings as the JSON a request carries, None when off
    (`fl_geo.core.compress.settings_to_json`)."""
    from fl_geo.core.compress import settings_to_json

    return settings_to_json(s)


def uplink_json(wire: WireSection) -> str | None:
    """The uplink compression as the JSON a request carries (``wire_compress``), None when off."""
    return settings_json(wire.uplink())


def downlink_json(wire: WireSection) -> str | None:
    """The downlink compression as the JSON a request carries (``wire_compress_down``), None when off."""
    return settings_json(wire.downlink())


def uplink_from_json(text: str | None, field: str = "wire_compress") -> CompressSettings | None:
    """`CompressSettings` from a request's ``wire_compress`` (or ``wire_compress_down``: ``field``);
    checked: `ConfigError` when out of range or not the six keys
    (`fl_geo.core.compress.settings_from_json`)."""
    from fl_geo.core.compress import settings_from_json

    return settings_from_json(text, field)
