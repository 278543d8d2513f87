"""Blockwise int8 / 4-bit quantisation of pseudo-gradient fragments (issue 6, item 3).

Streaming DiLoCo shows that the outer gradients a worker exchanges survive coarse quantisation:
what is averaged and then scaled by an outer learning rate does not need fp32 mantissas. Here a
fragment's Δ_p (a flat fp32 vector) is cut into blocks of ``block`` elements, and each block is
sent as one fp32 scale plus one signed integer code per element:

    scale_b = max_{i∈b} |x_i| / q_max,   code_i = round(x_i / scale_b) ∈ [−q_max, q_max],
    x̂_i = code_i · scale_b,

with q_max = 127 for ``int8`` and 7 for ``int4`` (symmetric: zero is exact, the grid has no
extra negative level). A block of zeros has scale 0 and codes 0. The error per element is at most
scale_b / 2, so a block's largest element is exact and the relative error is bounded by the
block's dynamic range; small blocks (the default 128) keep an outlier from flattening its
neighbours. Rounding is to nearest (ties to even), deterministic, so runs stay reproducible.

Payload layout (two arrays; `fl_geo.runtime.quantized` puts them in an ``ArrayRecord`` under
these names):

* ``codes``: ``int8``, one per element (``int4``: ``uint8``, two per byte, element 2k in the low
  nibble and 2k+1 in the high one, each stored as code + 8 ∈ [1, 15]; an odd tail pads with 8);
* ``scales``: ``float32``, one per block, finite and ≥ 0.

`dequantize` validates all of it (dtypes, lengths, scales, code range, the padding nibble) and
raises `PayloadError`, so a malformed or hostile reply is rejected like any other
bad payload. Everything is whole-tensor torch: no per-element Python loop.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fl_geo.errors import PayloadError

__all__ = ["CODES", "QUANT_BITS", "SCALES", "dequantize", "q_max", "quantize", "quantized_nbytes"]

QUANT_BITS = {"int8": 8, "int4": 4}
CODES, SCALES = "codes", "scales"


def q_max(kind: str, block: int) -> int:
    """The largest code of ``kind`` (127 or 7); raises ValueError for an unknown kind or a bad block."""
    if kind not in QUANT_BITS:
        raise ValueError(f"unknown quantisation {kind!r}; valid: {', '.join(QUANT_BITS)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    return 2 ** (QUANT_BITS[kind] - 1) - 1


def quantized_nbytes(kind: str, numel: int, block: int) -> int:
    """Payload bytes of ``numel`` elements (codes + scales, without container overhead): what
    the virtual clock charges for one quantised fragment."""
    q_max(kind, block)
    code_bytes = numel if kind == "int8" else (numel + 1) // 2
    return code_bytes + 4 * math.ceil(numel / block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-D fp32) zero-padded to whole blocks, as a (blocks, block) view."""
    n = x.numel()
    pad = (-n) % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def quantize(x: torch.Tensor, kind: str, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a flat fp32 tensor into the ``(codes, scales)`` arrays of the module docstring.

    Non-finite input is not refused here: its block's scale becomes NaN/Inf, which the receiver
    rejects, exactly as it rejects a non-finite fp32 payload.
    """
    top = q_max(kind, block)
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a 1-D floating tensor, got {x.dtype} {tuple(x.shape)}")
    n = x.numel()
    with torch.no_grad():
        xb = _blocks(x.detach().to("cpu", torch.float32), block)
        scales = xb.abs().amax(dim=1) / top
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(xb / safe[:, None]).clamp_(-top, top).to(torch.int8).reshape(-1)[:n]
        if kind == "int4":
            nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
            pairs = nibbles.view(-1, 2)
            codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return codes.contiguous().numpy(), scales.contiguous().numpy()


def dequantize(codes_np: np.ndarray, scales_np: np.ndarray, numel: int, kind: str,
               block: int = 128) -> torch.Tensor:
    """The fp32 tensor of ``numel`` elements that a `quantize` payload stands for.

    Raises `PayloadError` naming what is wrong: a dtype or length that does not fit
    ``numel``/``kind``/``block``, a non-finite or negative scale, an int8 code of −128 or an int4
    nibble of 0 (levels the encoder never writes), or a padding nibble other than 8.
    """
    q_max(kind, block)
    n_blocks = math.ceil(numel / block)
    want_codes = (np.dtype("i1"), numel) if kind == "int8" else (np.dtype("u1"), (numel + 1) // 2)
    if codes_np.dtype != want_codes[0] or codes_np.shape != (want_codes[1],):
        raise PayloadError(f"{kind} codes must be {want_codes[0]} of shape ({want_codes[1]},), got "
                           f"{codes_np.dtype} {codes_np.shape}")
    if scales_np.dtype != np.dtype("<f4") or scales_np.shape != (n_blocks,):
        raise PayloadError(f"scales must be float32 of shape ({n_blocks},), got {scales_np.dtype} {scales_np.shape}")
    scales = torch.from_numpy(np.ascontiguousarray(scales_np))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise PayloadError("scales must be finite and >= 0 (a non-finite update quantises to a non-finite scale)")
    raw = torch.from_numpy(np.ascontiguousarray(codes_np))
    if kind == "int8":
        if bool((raw == -128).any()):
            raise PayloadError("int8 code -128 is outside the symmetric grid [-127, 127]")
        codes = raw.to(torch.float32)
    else:
        nibbles = torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)
        if numel % 2 and int(nibbles[-1]) != 8:
            raise PayloadError("the padding nibble of an odd-length int4 payload must encode 0")
        nibbles = nibbles[:numel]
        if bool((nibbles == 0).any()):
            raise PayloadError("int4 nibble 0 (code -8) is outside the symmetric grid [-7, 7]")
        codes = nibbles.to(torch.float32) - 8.0
    out = _blocks(codes, block) * scales[:, None]
    return out.reshape(-1)[:numel].contiguous()
