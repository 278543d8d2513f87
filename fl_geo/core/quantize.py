"""Blockwise int8 / 4-bit / 2-bit quantisation of pseudo-gradients (issue 6, item 3).

Streaming DiLoCo shows that the outer gradients a worker exchanges survive coarse quantisation:
what is averaged and then scaled by an outer learning rate does not need fp32 mantissas. Here a
fragment's Δ_p (a flat fp32 vector) is cut into blocks of ``block`` elements, and each block is
sent as one fp32 scale plus one signed integer code per element:

    scale_b = max_{i∈b} |x_i| / q_max,   code_i = round(x_i / scale_b) ∈ [−q_max, q_max],
    x̂_i = code_i · scale_b,

with q_max = 2^(bits−1) − 1: 127 for ``int8``, 7 for ``int4`` and 1 for ``int2`` (ternary
{−1, 0, 1}·scale_b), symmetric: zero is exact, the grid has no extra negative level. A block of zeros has scale 0 and codes 0. The error per element is at most
scale_b / 2, so a block's largest element is exact and the relative error is bounded by the
block's dynamic range; small blocks (the default 128) keep an outlier from flattening its
neighbours. Rounding is to nearest (ties to even), deterministic, so runs stay reproducible.

Payload layout (two arrays; `fl_geo.runtime.compressed` puts them in an ``ArrayRecord`` under
these names):

* ``codes``: ``int8``, one per element (``int4``: ``uint8``, two per byte, element 2k in the low
  nibble and 2k+1 in the high one, each stored as code + 8 ∈ [1, 15]; an odd tail pads with 8.
  ``int2``: ``uint8``, four per byte, element 4k+j in bits 2j..2j+1, each stored as
  code + 2 ∈ [1, 3]; a tail short of a whole byte pads with 2);
* ``scales``: ``float32``, one per block, finite and ≥ 0.

**``sign``** (1 bit per element) is the one kind off that grid: code_i = +1 where x_i ≥ 0 and −1
elsewhere, and scale_b = mean_{i∈b} |x_i| (over the block's real elements), so
x̂_i = code_i · scale_b. Of all vectors c · sign(x) of a block, that scale is the one closest to x in
L2 (the derivative of Σ(|x_i| − c)² vanishes at c = mean |x_i|), the scale of EF-signSGD
(Karimireddy et al. 2019). DeMo (Peng et al. 2024) sends the sign of its decoded update too. Codes travel
as ``uint8``, eight per byte, element 8k+j in bit j, 1 for +1 and 0 for −1; the bits past the last
element are 0. There is no per-element error bound (an element is off by | |x_i| − scale_b |).

Two sets of kinds: `QUANT_BITS` (int8, int4) are those the old streaming quantiser offered
(`quantize`, `dequantize`, `q_max`, `quantized_nbytes`; ``streaming.quantize`` refuses any other
and is now an alias of ``wire.compress``), `CODE_BITS` adds int2 and sign for the compression codecs
of `fl_geo.core.compress` (`quantize_codes`, `dequantize_codes`, `code_q_max`, `code_nbytes`).
The int8 and int4 payloads are the same bytes through either entry point.

`dequantize` validates all of it (dtypes, lengths, scales, code range, the padding nibble) and
raises `PayloadError`, so a malformed or hostile reply is rejected like any other
bad payload. Everything is whole-tensor torch: no per-element Python loop.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fl_geo.errors import PayloadError

__all__ = ["CODES", "CODE_BITS", "QUANT_BITS", "SCALES", "code_nbytes", "code_q_max", "dequantize",
           "dequantize_codes", "q_max", "quantize", "quantize_codes", "quantized_nbytes"]

QUANT_BITS = {"int8": 8, "int4": 4}
CODE_BITS = {**QUANT_BITS, "int2": 2, "sign": 1}
CODES, SCALES = "codes", "scales"


def _top(kind: str, block: int, kinds: dict[str, int]) -> int:
    if kind not in kinds:
        raise ValueError(f"unknown quantisation {kind!r}; valid: {', '.join(kinds)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return 1 if kind == "sign" else 2 ** (kinds[kind] - 1) - 1


def q_max(kind: str, block: int) -> int:
    """The largest code of a wire ``kind`` (127 or 7); raises ValueError for an unknown kind
    (int2 included: the streaming wire does not carry it) or a bad block."""
    return _top(kind, block, QUANT_BITS)


def code_q_max(kind: str, block: int) -> int:
    """The largest code of ``kind`` in `CODE_BITS` (127, 7, 1 or sign's 1); ValueError as `q_max`."""
    return _top(kind, block, CODE_BITS)


def code_nbytes(kind: str, numel: int, block: int) -> int:
    """Payload bytes of ``numel`` elements of any `CODE_BITS` kind: ⌈numel·bits/8⌉ code bytes plus
    one fp32 scale per block (no container overhead)."""
    code_q_max(kind, block)
    return math.ceil(numel * CODE_BITS[kind] / 8) + 4 * math.ceil(numel / block)


def quantized_nbytes(kind: str, numel: int, block: int) -> int:
    """Payload bytes of ``numel`` elements (codes + scales, without container overhead): what
    the virtual clock charges for one quantised fragment."""
    q_max(kind, block)
    return code_nbytes(kind, numel, block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-D fp32) zero-padded to whole blocks, as a (blocks, block) view."""
    n = x.numel()
    pad = (-n) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def _pack_fields(fields: torch.Tensor, bits: int, pad_field: int) -> torch.Tensor:
    """``uint8`` fields of ``bits`` bits packed 8/bits per byte, low field first; the tail pads
    with ``pad_field``."""
    per = 8 // bits
    pad = (-fields.numel()) % per
    if pad:
        fields = torch.cat([fields, fields.new_full((pad,), pad_field)])
    groups = fields.view(-1, per)
    packed = groups[:, 0].clone()
    for j in range(1, per):
        packed |= groups[:, j] << (bits * j)
    return packed


def _fields(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """Every ``bits``-bit field of packed bytes, padding included (the inverse of `_pack_fields`)."""
    mask = (1 << bits) - 1
    return torch.stack([(raw >> (bits * j)) & mask for j in range(8 // bits)], dim=1).reshape(-1)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Sub-byte codes (int8 in [−q_max, q_max]) as ``uint8``, 8/bits fields per byte, low field
    first, each stored as code + 2^(bits−1); the tail pads with the field that encodes 0."""
    offset = 1 << (bits - 1)
    return _pack_fields((codes.to(torch.int16) + offset).to(torch.uint8), bits, offset)


def quantize(x: torch.Tensor, kind: str, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a flat fp32 tensor into the ``(codes, scales)`` arrays of the module docstring,
    for a wire kind (int8, int4).

    Non-finite input is not refused here: its block's scale becomes NaN/Inf, which the receiver
    rejects, exactly as it rejects a non-finite fp32 payload.
    """
    q_max(kind, block)
    return quantize_codes(x, kind, block)


def _sign_codes(xb: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sign``: (packed bits, scales) of zero-padded blocks ``xb`` holding ``n`` real elements."""
    block = xb.shape[1]
    if xb.shape[0] == 0:  # no elements: no codes, no scales (the int kinds' result too)
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    counts = torch.full((xb.shape[0],), float(block))
    counts[-1] = float(n - block * (xb.shape[0] - 1))  # the last block may be short: its padding is not data
    scales = xb.abs().sum(dim=1) / counts
    return _pack_fields((xb.reshape(-1)[:n] >= 0).to(torch.uint8), 1, 0), scales


def quantize_codes(x: torch.Tensor, kind: str, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """`quantize` for any `CODE_BITS` kind (int2 and sign included); same contract and layout."""
    top = code_q_max(kind, block)
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a 1-D floating tensor, got {x.dtype} {tuple(x.shape)}")
    n = x.numel()
    with torch.no_grad():
        xb = _blocks(x.detach().to("cpu", torch.float32), block)
        if kind == "sign":
            codes, scales = _sign_codes(xb, n)
            return codes.contiguous().numpy(), scales.contiguous().numpy()
        scales = xb.abs().amax(dim=1) / top
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(xb / safe[:, None]).clamp_(-top, top).to(torch.int8).reshape(-1)[:n]
        if kind != "int8":
            codes = _pack(codes, CODE_BITS[kind])
    return codes.contiguous().numpy(), scales.contiguous().numpy()


def dequantize(codes_np: np.ndarray, scales_np: np.ndarray, numel: int, kind: str,
               block: int = 128) -> torch.Tensor:
    """The fp32 tensor of ``numel`` elements that a `quantize` payload (int8, int4) stands for.

    Raises `PayloadError` naming what is wrong: a dtype or length that does not fit
    ``numel``/``kind``/``block``, a non-finite or negative scale, an int8 code of −128 or an int4
    nibble of 0 (levels the encoder never writes), or a padding nibble other than 8.
    """
    q_max(kind, block)
    return dequantize_codes(codes_np, scales_np, numel, kind, block)


def _check_scales(scales_np: np.ndarray, n_blocks: int) -> torch.Tensor:
    if scales_np.dtype != np.dtype("<f4") or scales_np.shape != (n_blocks,):
        raise PayloadError(f"scales must be float32 of shape ({n_blocks},), got {scales_np.dtype} {scales_np.shape}")
    scales = torch.from_numpy(np.ascontiguousarray(scales_np))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise PayloadError("scales must be finite and >= 0 (a non-finite update quantises to a non-finite scale)")
    return scales


def _unpack(raw: torch.Tensor, numel: int, kind: str) -> torch.Tensor:
    """The fp32 codes of a packed sub-byte payload; refuses the field 0 and bad padding."""
    bits = CODE_BITS[kind]
    offset = 1 << (bits - 1)
    fields = _fields(raw, bits)
    unit = "nibble" if bits == 4 else f"{bits}-bit field"
    if bool((fields[numel:] != offset).any()):
        if bits == 4:
            raise PayloadError("the padding nibble of an odd-length int4 payload must encode 0")
        raise PayloadError(f"the padding {unit}s of a {numel}-element {kind} payload must encode 0")
    fields = fields[:numel]
    if bool((fields == 0).any()):
        top = offset - 1
        raise PayloadError(f"{kind} {unit} 0 (code -{offset}) is outside the symmetric grid [-{top}, {top}]")
    return fields.to(torch.float32) - float(offset)


def _unpack_signs(raw: torch.Tensor, numel: int) -> torch.Tensor:
    """The ±1 codes of a ``sign`` payload; refuses padding bits other than 0."""
    bits = _fields(raw, 1)
    if bool((bits[numel:] != 0).any()):
        raise PayloadError(f"the padding bits of a {numel}-element sign payload must be 0")
    return bits[:numel].to(torch.float32) * 2.0 - 1.0


def dequantize_codes(codes_np: np.ndarray, scales_np: np.ndarray, numel: int, kind: str,
                     block: int = 128) -> torch.Tensor:
    """`dequantize` for any `CODE_BITS` kind: the same checks, for int2 a 2-bit field of 0
    (code −2) or padding fields other than 2, and for sign padding bits other than 0, raise
    `PayloadError`."""
    code_q_max(kind, block)
    n_blocks = math.ceil(numel / block)
    want = (np.dtype("i1"), numel) if kind == "int8" else (np.dtype("u1"), math.ceil(numel * CODE_BITS[kind] / 8))
    if codes_np.dtype != want[0] or codes_np.shape != (want[1],):
        raise PayloadError(f"{kind} codes must be {want[0]} of shape ({want[1]},), got "
                           f"{codes_np.dtype} {codes_np.shape}")
    scales = _check_scales(scales_np, n_blocks)
    raw = torch.from_numpy(np.ascontiguousarray(codes_np))
    if kind == "int8":
        if bool((raw == -128).any()):
            raise PayloadError("int8 code -128 is outside the symmetric grid [-127, 127]")
        codes = raw.to(torch.float32)
    elif kind == "sign":
        codes = _unpack_signs(raw, numel)
    else:
        codes = _unpack(raw, numel, kind)
    out = _blocks(codes, block) * scales[:, None]
    return out.reshape(-1)[:numel].contiguous()
