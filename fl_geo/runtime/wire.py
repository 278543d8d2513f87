"""Codec between flat tensors and Flower ``ArrayRecord`` payloads, with strict validation.

Layout: one ``Array`` per parameter of the `ParamSpec`, keyed by the parameter name and shaped
like it, so a receiver can check keys and shapes without trusting the sender. Each ``Array`` is a
standard ``.npy`` byte string (``stype="numpy.ndarray"``): our fp32/fp16 payloads are
byte-identical to what ``Array(ndarray)`` produces, so plain Flower strategies can read them.

Precision marker: the ``Array`` dtype itself. ``fp32`` → ``float32``, ``fp16`` → ``float16``,
``bf16`` → ``int16``. NumPy (hence ``Array``) has no bfloat16, so bf16 ships as the int16 *view*
of its bits and is viewed back on decode: a bit-exact round trip. Keys stay the bare parameter
names (no suffix). The decoder never infers the precision from the payload: the caller passes
the precision it expects (from its config) and every Array's dtype must match it, so fp32 sent
where bf16 was agreed is rejected rather than misread.

Decoding is zero-copy: ``Array.numpy()`` would run ``np.load`` and copy every array; instead the
``.npy`` header is parsed and the tensor is a read-only view of ``Array.data``. The same
functions serve both directions: replies (client → server pseudo-gradients) and the full-model
broadcast (server → client, usually ``fp32``); `decode_into` assembles a decoded payload into a
flat fp32 buffer for the latter.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from functools import lru_cache
from io import BytesIO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy_format

from fl_geo.core.accumulate import describe_non_finite
from fl_geo.core.state import CHUNK_ELEMS, ParamSpec, chunk_ranges, sum_of_squares
from fl_geo.errors import PayloadError

__all__ = [
    "PRECISIONS",
    "PayloadError",
    "array_of",
    "check_finite_and_norm",
    "decode",
    "decode_into",
    "encode",
    "payload_nbytes",
    "tensor_of",
]

NUMPY_STYPE = "numpy.ndarray"  # flwr.common.constant.SType.NUMPY

# precision -> (dtype of the tensor, dtype on the wire). bf16 travels as its int16 bit pattern.
PRECISIONS: dict[str, tuple[torch.dtype, np.dtype]] = {
    "fp32": (torch.float32, np.dtype("<f4")),
    "fp16": (torch.float16, np.dtype("<f2")),
    "bf16": (torch.bfloat16, np.dtype("<i2")),
}
_TORCH_WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.int16}
_NPY_MAGIC = b"\x93NUMPY"
# The longest .npy header decode accepts. np.save writes about 128 bytes for any shape a model
# has (a 64-byte multiple, padded with spaces); the format allows up to 4 GiB (version 2), and
# NumPy's parser is a Python literal parse, so a header padded to megabytes would cost a copy
# and a slow parse per array before any check could refuse it. Refused from the length field.
MAX_NPY_HEADER_BYTES = 4096


def _precision(precision: str) -> tuple[torch.dtype, np.dtype]:
    if sys.byteorder != "little":  # the views below reinterpret little-endian bytes natively
        raise RuntimeError("fl_geo.runtime.wire assumes a little-endian host")
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(
            f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}"
        ) from None


@lru_cache(maxsize=4096)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The exact header ``np.save`` writes for a C-ordered array (cached per dtype/shape)."""
    fp = BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    try:
        npy_format.write_array_header_1_0(fp, header)
    except ValueError:  # header longer than 64 KiB: format 2.0, as np.save does
        fp = BytesIO()
        npy_format.write_array_header_2_0(fp, header)
    return fp.getvalue()


def encode(flat: torch.Tensor, spec: ParamSpec, precision: str = "fp32") -> ArrayRecord:
    """One ``Array`` per parameter of ``spec`` holding ``flat``'s slice in ``precision``.

    ``flat`` is 1-D with ``spec.numel`` elements, in fp32 or already in the wire dtype. Copies:
    exactly one per parameter (into the immutable ``bytes`` that ``Array`` requires) when
    ``flat`` is already in wire dtype on CPU, plus the unavoidable cast when it is not.
    """
    tdtype, ndtype = _precision(precision)
    if flat.dim() != 1 or flat.numel() != spec.numel:
        raise ValueError(
            f"flat must be 1-D with {spec.numel} elements, got shape {tuple(flat.shape)}"
        )
    if not flat.is_floating_point():
        raise ValueError(f"flat must be a floating tensor, got {flat.dtype}")
    flat = flat.detach()
    descr = npy_format.dtype_to_descr(ndtype)
    arrays: dict[str, Array] = {}
    for name, begin, n, shape in zip(spec.names, spec.offsets, spec.numels, spec.shapes,
                                     strict=True):
        piece = flat[begin:begin + n].to(device="cpu", dtype=tdtype).contiguous()
        raw = piece.view(_TORCH_WIRE[precision]).numpy()  # same memory, NumPy-typed
        data = b"".join((_npy_header(descr, shape), memoryview(raw).cast("B")))
        arrays[name] = Array(dtype=str(ndtype), shape=shape, stype=NUMPY_STYPE, data=data)
    return ArrayRecord(arrays, keep_input=True)


def array_of(values: torch.Tensor | np.ndarray) -> Array:
    """``Array(ndarray)`` without ``np.save``: the same bytes, field for field (the ``.npy`` header
    comes from the per-dtype/shape cache above), in about half the time. A node's inner state is
    dozens of small arrays per train message (AdamW's two moments and step count per parameter),
    where ``np.save``'s own overhead was most of the cost. A tensor is moved to the CPU first;
    anything ``np.save`` would write differently (not C-contiguous, object or structured dtypes)
    goes through Flower's own constructor."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    dtype = values.dtype
    if not values.flags.c_contiguous or dtype.hasobject or dtype.fields is not None:
        return Array(values)
    raw = memoryview(values).cast("B") if values.size else b""
    data = b"".join((_npy_header(npy_format.dtype_to_descr(dtype), tuple(values.shape)), raw))
    return Array(dtype=str(dtype), shape=tuple(values.shape), stype=NUMPY_STYPE, data=data)


def tensor_of(array: Array) -> torch.Tensor:
    """A writable CPU tensor of ``array``'s values, as ``torch.from_numpy(array.numpy())`` gives
    (a copy), without ``np.load`` parsing the header of every array again (the parse is cached
    per header, see `_read_header`). Anything this does not read itself (another ``stype``, a
    header it refuses, Fortran order, a length that does not match, a dtype torch lacks) goes
    through ``Array.numpy()``, so the result and the errors are the ones that gives."""
    data = array.data
    if array.stype != NUMPY_STYPE or not isinstance(data, bytes | bytearray):
        return torch.from_numpy(array.numpy())
    try:
        dtype, fortran, shape, offset = _parse_npy_header(data, "array")
    except PayloadError:
        return torch.from_numpy(array.numpy())
    count = math.prod(shape)
    if fortran and len(shape) > 1 or dtype.hasobject or len(data) != offset + count * dtype.itemsize:
        return torch.from_numpy(array.numpy())
    values = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
    try:
        return torch.from_numpy(values)
    except TypeError:  # a NumPy dtype torch has no tensor of (e.g. uint32 on an older torch)
        return torch.from_numpy(array.numpy())


def _parse_npy_header(data: bytes, key: str) -> tuple[np.dtype, bool, tuple[int, ...], int]:
    """(dtype, fortran_order, shape, data offset) of an ``.npy`` byte string, or PayloadError.

    Only the header bytes (about a hundred; more than `MAX_NPY_HEADER_BYTES` is refused from the
    length field, before any copy) are copied, for NumPy's own parser (``read_magic``/
    ``read_array_header_*``: literal parsing only, never pickle); the array data is never
    touched here. The caller checks the declared shape against the spec and the data length
    against shape x itemsize, so nothing is allocated from what the header claims.
    """
    if len(data) < 10 or data[:6] != _NPY_MAGIC:
        raise PayloadError(f"array {key!r}: not an .npy payload (bad magic or too short)")
    major = data[6]
    if major == 1:
        end = 10 + struct.unpack_from("<H", data, 8)[0]
        read_header = npy_format.read_array_header_1_0
    elif major == 2 and len(data) >= 12:
        end = 12 + struct.unpack_from("<I", data, 8)[0]
        read_header = npy_format.read_array_header_2_0
    else:
        raise PayloadError(f"array {key!r}: unsupported .npy format version {major}")
    if end > MAX_NPY_HEADER_BYTES:
        raise PayloadError(f"array {key!r}: .npy header of {end} bytes exceeds {MAX_NPY_HEADER_BYTES} "
                           "(np.save writes about 128)")
    if len(data) < end:
        raise PayloadError(f"array {key!r}: truncated .npy header")
    try:
        dtype, fortran_order, shape = _read_header(bytes(data[:end]), read_header)
    except ValueError as exc:
        raise PayloadError(f"array {key!r}: malformed .npy header: {exc}") from None
    return dtype, fortran_order, shape, end


@lru_cache(maxsize=4096)
def _read_header(header: bytes, read_header: Callable[..., Any]) -> tuple[np.dtype, bool,
                                                                          tuple[int, ...]]:
    """NumPy's header parser, memoised on the header bytes: a model has a few dozen distinct
    (dtype, shape) headers and every reply repeats them, so the literal parse runs once each."""
    fp = BytesIO(header)
    npy_format.read_magic(fp)
    shape, fortran_order, dtype = read_header(fp, max_header_size=max(10000, len(header)))
    return dtype, bool(fortran_order), tuple(shape)


def _readonly_views(
    plan: list[tuple[int, bytes, int, int]], dtype: torch.dtype
) -> list[tuple[int, torch.Tensor]]:
    """Zero-copy tensors over immutable ``bytes``: ``(begin, data, data offset, count)`` each.

    torch cannot mark a tensor read-only, so it warns when wrapping immutable bytes; that one
    warning is silenced here (once per payload). The tensors `decode` hands out are only ever
    read (normed, folded, copied) and are documented read-only.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable",
                                category=UserWarning)
        return [
            (begin, torch.frombuffer(data, dtype=dtype, count=n, offset=offset) if n
             else torch.empty(0, dtype=dtype))
            for begin, data, offset, n in plan
        ]


def decode(
    record: ArrayRecord, spec: ParamSpec, precision: str = "fp32"
) -> list[tuple[int, torch.Tensor]]:
    """Validate ``record`` against ``spec``/``precision`` and return ``(offset, 1-D tensor)``.

    Tensors are in the wire precision (``float32``/``float16``/``bfloat16``) and are **read-only
    views** of the payload bytes: do not write to them (copy first if needed). Everything is
    checked before anything is returned: exact key set, ``stype``, dtype (``Array`` field and
    ``.npy`` header) against ``precision``, shape (field and header) against the spec, and the
    data length. Any mismatch raises `PayloadError` naming the key, expected and received.
    Finiteness is checked separately by `check_finite_and_norm` (one pass over the data).
    """
    tdtype, ndtype = _precision(precision)
    if not isinstance(record, ArrayRecord):
        raise PayloadError(f"expected an ArrayRecord, got {type(record).__name__}")
    keys, expected_keys = set(record.keys()), set(spec.names)
    missing = [n for n in spec.names if n not in keys]
    unexpected = sorted(keys - expected_keys)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s) {unexpected[:5]}")
        raise PayloadError("payload keys do not match the model spec: " + "; ".join(parts))

    plan: list[tuple[int, bytes, int, int]] = []
    for name, begin, n, shape in zip(spec.names, spec.offsets, spec.numels, spec.shapes,
                                     strict=True):
        array = record[name]
        if array.stype != NUMPY_STYPE:
            raise PayloadError(
                f"array {name!r}: stype {array.stype!r}, expected {NUMPY_STYPE!r}"
            )
        if array.dtype != str(ndtype):
            raise PayloadError(
                f"array {name!r}: dtype {array.dtype!r}, expected {str(ndtype)!r} for "
                f"precision {precision}" + (" (bf16 travels as int16)" if precision == "bf16"
                                            else "")
            )
        if tuple(array.shape) != shape:
            raise PayloadError(f"array {name!r}: shape {tuple(array.shape)}, expected {shape}")
        data = array.data
        if not isinstance(data, bytes | bytearray):
            raise PayloadError(f"array {name!r}: data is {type(data).__name__}, not bytes")
        dtype, fortran, hshape, offset = _parse_npy_header(data, name)
        if dtype != ndtype:
            raise PayloadError(
                f"array {name!r}: .npy header dtype {dtype.str!r}, expected {ndtype.str!r} "
                f"for precision {precision}"
            )
        if hshape != shape:
            raise PayloadError(f"array {name!r}: .npy header shape {hshape}, expected {shape}")
        if fortran and len(shape) > 1:
            raise PayloadError(f"array {name!r}: Fortran-ordered data is not accepted")
        expected_len = offset + n * ndtype.itemsize
        if len(data) != expected_len:
            what = "truncated" if len(data) < expected_len else "has trailing bytes"
            raise PayloadError(
                f"array {name!r}: data {what}: {len(data)} bytes, expected {expected_len} "
                f"({n} x {ndtype.itemsize}-byte elements after a {offset}-byte header)"
            )
        plan.append((begin, data, offset, n))
    pieces = _readonly_views(plan, _TORCH_WIRE[precision])
    if precision == "bf16":
        pieces = [(begin, view.view(torch.bfloat16)) for begin, view in pieces]
    return pieces


def decode_into(
    record: ArrayRecord,
    spec: ParamSpec,
    precision: str = "fp32",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a full model (broadcast) into a flat fp32 buffer: validated, one copy per array."""
    pieces = decode(record, spec, precision)
    if out is None:
        out = torch.empty(spec.numel, dtype=torch.float32)
    elif out.dim() != 1 or out.numel() != spec.numel or out.dtype != torch.float32:
        raise ValueError(
            f"out must be 1-D float32 with {spec.numel} elements, got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    for begin, piece in pieces:
        out[begin:begin + piece.numel()].copy_(piece)
    return out


_LOCAL = threading.local()


def _scratch(device: torch.device) -> torch.Tensor:
    """A chunk-sized fp32 scratch per thread and device, reused across calls."""
    cache: dict[torch.device, torch.Tensor] = _LOCAL.__dict__.setdefault("scratch", {})
    buf = cache.get(device)
    if buf is None:
        buf = cache[device] = torch.empty(CHUNK_ELEMS, dtype=torch.float32, device=device)
    return buf


def check_finite_and_norm(
    pieces: Iterable[tuple[int, torch.Tensor]], spec: ParamSpec | None = None
) -> float:
    """L2 norm of a whole payload; PayloadError if any element is NaN or ±Inf.

    One read of the data: per chunk, the sum of squares (`fl_geo.core.state.sum_of_squares`;
    reduced-precision chunks are first converted into a cache-sized fp32 scratch, because
    ``vector_norm(x_bf16, dtype=float32)`` would materialise a full fp32 copy), accumulated in
    fp64 (Python floats) over chunks and pieces. A NaN or ±Inf element makes its chunk's sum NaN
    or +Inf, so finiteness needs no separate pass. Consequence: a finite update whose fp32 chunk
    sum of squares overflows (elements beyond ~1e17) is rejected too, with a message saying so;
    such an update is garbage for training anyway. Accuracy: ~1e-8 relative on any CPU, so a
    norm test or clip decides the same on every machine up to that. ``spec`` only names the offending parameter in the error.
    """
    total = 0.0
    for offset, piece in pieces:
        flat = piece.reshape(-1)
        piece_sq = 0.0
        for b, e in chunk_ranges(0, flat.numel()):
            chunk = flat[b:e]
            if chunk.dtype != torch.float32:
                chunk = _scratch(chunk.device)[: e - b].copy_(chunk)
            piece_sq += sum_of_squares(chunk)
        if not math.isfinite(piece_sq):
            where = f"parameter {spec.name_at(offset)!r}" if spec is not None and flat.numel() \
                else f"piece at offset {offset}"
            raise PayloadError(f"{where}: {describe_non_finite(flat)}; update rejected")
        total += piece_sq
    return math.sqrt(total)


def payload_nbytes(record: ArrayRecord) -> int:
    """Bytes of array data in ``record`` (including the ~128-byte .npy header per array).

    This is what Flower ships for the arrays (chunked, content-addressed); message framing and
    the other records of the message are not counted.
    """
    return sum(len(array.data) for array in record.values())
