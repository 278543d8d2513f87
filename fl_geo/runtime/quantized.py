"""Quantised fragments on the wire: `fl_geo.core.quantize`'s two arrays in a Flower ``ArrayRecord``.

The record holds exactly the arrays ``codes`` and ``scales`` (layout and error bounds:
`fl_geo.core.quantize`). Reading one checks the key set and that each array decodes before the
core checks dtypes, lengths and code ranges; anything wrong raises `PayloadError`, so a malformed
or hostile reply is rejected like any other bad payload.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord

from fl_geo.core.quantize import CODES, SCALES, dequantize, q_max, quantize
from fl_geo.errors import PayloadError

__all__ = ["dequantize_record", "quantize_record"]


def quantize_record(x: torch.Tensor, kind: str, block: int = 128) -> ArrayRecord:
    """Quantise a flat fp32 tensor into a two-array record (``codes``, ``scales``).

    Non-finite input is not refused here: its block's scale becomes NaN/Inf, which the receiver
    rejects, exactly as it rejects a non-finite fp32 payload.
    """
    codes, scales = quantize(x, kind, block)
    return ArrayRecord({CODES: Array(codes), SCALES: Array(scales)})


def dequantize_record(record: ArrayRecord, numel: int, kind: str, block: int = 128) -> torch.Tensor:
    """The fp32 tensor of ``numel`` elements a `quantize_record` payload stands for; raises
    `PayloadError` for keys other than ``codes``/``scales``, an unreadable array, or anything
    `fl_geo.core.quantize.dequantize` refuses."""
    q_max(kind, block)
    keys = set(record.keys())
    if keys != {CODES, SCALES}:
        raise PayloadError(f"a {kind} payload holds exactly {{'{CODES}', '{SCALES}'}}, got {sorted(keys)}")
    try:
        codes_np, scales_np = record[CODES].numpy(), record[SCALES].numpy()
    except Exception as exc:  # noqa: BLE001 - a corrupt .npy is bad input, whatever numpy raises
        raise PayloadError(f"unreadable {kind} payload: {exc}") from None
    return dequantize(codes_np, scales_np, numel, kind, block)
