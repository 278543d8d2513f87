"""Value codes of the compression codecs: a flat fp32 vector as fp32, bf16 or blockwise int codes.

`fl_geo.core.compress` sends a whole pseudo-gradient this way (the dense codecs ``fp32``, ``bf16``,
``int8``, ``int4``, ``int2``) and the values a sparse codec keeps (`fl_geo.core.sparse`). Each
payload is a frozen dataclass: header ints that the receiver already knows from its settings
(kind, element count, block), and the arrays that travel. ``nbytes`` is the arrays' bytes, no
container overhead, so a byte count can be checked against its formula:

===========  ========================================  ==============================
kind         arrays                                    bytes for m values
===========  ========================================  ==============================
``fp32``     ``values`` ``float32``                    4·m
``bf16``     ``values`` ``int16`` (the bf16 bit view)  2·m
``intB``     ``codes`` + ``scales`` (quantize.py)      ⌈m·B/8⌉ + 4·⌈m/block⌉
``sign``     ``codes`` + ``scales`` (quantize.py)      ⌈m/8⌉ + 4·⌈m/block⌉
===========  ========================================  ==============================

bf16 travels as its int16 bit pattern, as on the existing wire (NumPy has no bfloat16); fp32 → bf16
rounds to nearest even, a relative error of at most 2⁻⁸ per element (half an ulp of its 8-bit
significand). The int codes are
`fl_geo.core.quantize`'s blockwise symmetric grid: |x − x̂| ≤ scale_b / 2 per element. ``sign``
sends one bit per element and the block's mean magnitude (the L2-best scale for a sign code).

`decode_values` checks the payload against what the receiver expects (type, kind, count, block,
dtypes, shapes, finiteness; the int codes through quantize.py's checks) and raises `PayloadError`
with one line naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fl_geo.core.quantize import CODE_BITS, code_nbytes, dequantize_codes, quantize_codes
from fl_geo.errors import PayloadError

__all__ = ["VALUE_KINDS", "CodedValues", "DenseValues", "Values", "decode_values", "encode_values",
           "values_nbytes"]

VALUE_KINDS = ("fp32", "bf16", *CODE_BITS)
_DENSE_DTYPES = {"fp32": np.dtype("<f4"), "bf16": np.dtype("<i2")}


@dataclass(frozen=True)
class DenseValues:
    """``numel`` values in ``kind`` fp32 or bf16 (bf16 as its int16 bit pattern)."""

    kind: str
    numel: int
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes that travel: the one array."""
        return int(self.values.nbytes)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"values": self.values}


@dataclass(frozen=True)
class CodedValues:
    """``numel`` values as blockwise codes of ``kind`` (int8, int4, int2, sign), ``block`` per scale."""

    kind: str
    numel: int
    block: int
    codes: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes that travel: the codes and the scales."""
        return int(self.codes.nbytes + self.scales.nbytes)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"codes": self.codes, "scales": self.scales}


Values = DenseValues | CodedValues


def values_nbytes(kind: str, numel: int, block: int) -> int:
    """Bytes of ``numel`` values of ``kind`` (the table of the module docstring)."""
    if kind == "fp32":
        return 4 * numel
    if kind == "bf16":
        return 2 * numel
    return code_nbytes(kind, numel, block)


def encode_values(x: torch.Tensor, kind: str, block: int) -> Values:
    """``x`` (1-D fp32, any device) as a payload of ``kind``; the arrays are on the CPU."""
    if kind == "fp32":
        arr = x.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()
        return DenseValues(kind, x.numel(), arr)
    if kind == "bf16":
        bits = x.detach().to(torch.bfloat16).view(torch.int16).to("cpu").contiguous().numpy()
        return DenseValues(kind, x.numel(), bits)
    codes, scales = quantize_codes(x, kind, block)
    return CodedValues(kind, x.numel(), block, codes, scales)


def _check_dense(v: DenseValues, numel: int) -> torch.Tensor:
    want = _DENSE_DTYPES[v.kind]
    arr = v.values
    if not isinstance(arr, np.ndarray) or arr.dtype != want or arr.shape != (numel,):
        got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise PayloadError(f"{v.kind} values must be {want} of shape ({numel},), got {got}")
    out = torch.from_numpy(np.ascontiguousarray(arr))
    if v.kind == "bf16":
        out = out.view(torch.bfloat16)
    out = out.to(torch.float32, copy=True)  # never a view of the payload's array
    if not bool(torch.isfinite(out).all()):
        raise PayloadError(f"{v.kind} values must be finite")
    return out


def _check_coded(v: CodedValues, numel: int, block: int) -> torch.Tensor:
    if v.block != block:
        raise PayloadError(f"{v.kind} payload has block {v.block!r}, this decoder expects {block}")
    for name in ("codes", "scales"):
        if not isinstance(getattr(v, name), np.ndarray):
            raise PayloadError(f"{v.kind} {name} must be a numpy array, got {type(getattr(v, name)).__name__}")
    return dequantize_codes(v.codes, v.scales, numel, v.kind, block)


def decode_values(v: object, kind: str, numel: int, block: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 vector of ``numel`` elements that ``v`` stands for, on ``device`` (default CPU).

    ``kind``, ``numel`` and ``block`` are what the receiver expects; a payload of another type,
    kind, count or block, a wrong dtype or shape, non-finite fp32/bf16 values, or anything
    quantize.py's `dequantize_codes` refuses (scales, code range, padding, truncated codes)
    raises `PayloadError`.
    """
    want_type = DenseValues if kind in _DENSE_DTYPES else CodedValues
    if not isinstance(v, want_type):
        raise PayloadError(f"{kind} values must be a {want_type.__name__}, got {type(v).__name__}")
    if v.kind != kind:
        raise PayloadError(f"values are {v.kind!r}, this decoder expects {kind!r}")
    if v.numel != numel:
        raise PayloadError(f"{kind} values hold {v.numel!r} elements, this decoder expects {numel}")
    out = _check_dense(v, numel) if isinstance(v, DenseValues) else _check_coded(v, numel, block)
    return out if device is None else out.to(device)

