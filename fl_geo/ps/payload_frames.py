"""Compressed pushes on the data path (``wire.compress`` with ``ps.followers > 0``).

A site compresses each update shard on its own (`fl_geo.core.compress.compress_shards`) and pushes
each follower the payload of its shard. The push is the ordinary ``Push`` stream with one more
header key, so the message format changes as little as it can:

- header frame: the usual ``job``, ``shard``, ``dtype`` (the follower's ``fp32`` push buffer),
  ``numel``, ``token``, plus ``payload``: the arrays as ``[name, dtype, count]`` in the order
  they travel (``dtype`` a little-endian NumPy type string from `PAYLOAD_DTYPES`);
- data frames: the arrays' bytes, concatenated in that order and cut into ``chunk_bytes`` frames.

The header ints of the codec (chunk, k, block) never travel: the follower holds the run's
settings. Version: a follower that predates this format refuses the ``payload`` key
(INVALID_ARGUMENT, unknown key), and a compressed follower refuses a push without it, so a
mismatch between the two ends is a clean refusal, never a misread shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from fl_geo.core.compress import Payload
from fl_geo.ps.frames import bad_request

__all__ = ["PAYLOAD_DTYPES", "payload_frames", "payload_layout", "payloads_frames", "read_payload", "read_payloads"]

PAYLOAD_DTYPES = frozenset({"|u1", "<u2", "<u4", "|i1", "<i2", "<f4"})
MAX_ARRAYS = 4


def payload_layout(payload: Payload) -> list[list[Any]]:
    """The header's ``payload`` list: ``[name, dtype, count]`` per array, in travel order."""
    return [[name, a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str, int(a.size)]
            for name, a in payload.arrays().items()]


def payload_frames(payload: Payload, chunk_bytes: int) -> Iterator[bytes]:
    """The arrays' little-endian bytes, concatenated, in frames of at most ``chunk_bytes``."""
    blob = b"".join(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
                    for a in payload.arrays().values())
    for b in range(0, len(blob), chunk_bytes):
        yield blob[b:b + chunk_bytes]


def _array_specs(layout: object, what: str, limit: int) -> list[tuple[str, np.dtype, int]]:
    """The ``[name, dtype, count]`` list of one payload, checked (ValueError): 1 to `MAX_ARRAYS`
    arrays, distinct names, known dtypes, counts in [0, ``limit``]."""
    if not isinstance(layout, list) or not 1 <= len(layout) <= MAX_ARRAYS:
        raise ValueError(f"{what}: payload must list 1 to {MAX_ARRAYS} [name, dtype, count] arrays")
    specs: list[tuple[str, np.dtype, int]] = []
    for item in layout:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and item[1] in PAYLOAD_DTYPES and isinstance(item[2], int) and not isinstance(item[2], bool)
                and 0 <= item[2] <= limit):
            raise ValueError(f"{what}: bad payload array {str(item)[:100]}; each is [name, dtype in "
                             f"{sorted(PAYLOAD_DTYPES)}, count]")
        specs.append((item[0], np.dtype(item[1]), item[2]))
    if len({name for name, _, _ in specs}) != len(specs):
        raise ValueError(f"{what}: payload array names repeat")
    return specs


def _nbytes(specs: list[tuple[str, np.dtype, int]]) -> int:
    return sum(dt.itemsize * n for _, dt, n in specs)


def _read_exactly(frames: Iterator[bytes], total: int, what: str) -> bytearray:
    data = bytearray()
    for frame in frames:
        if len(data) + len(frame) > total:
            raise ValueError(f"{what} carries more than the announced {total} payload bytes")
        data += frame
    if len(data) != total:
        raise ValueError(f"{what} ended after {len(data)} of {total} payload bytes")
    return data


def _split(data: bytearray, offset: int, specs: list[tuple[str, np.dtype, int]]) -> dict[str, np.ndarray]:
    arrays, pos = {}, offset
    for name, dt, n in specs:
        arrays[name] = np.frombuffer(data, dtype=dt, count=n, offset=pos).astype(dt.newbyteorder("="))
        pos += dt.itemsize * n
    return arrays


def read_payload(layout: object, frames: Iterator[bytes], job: str, nbytes: int) -> dict[str, np.ndarray]:
    """The arrays of a compressed push, reading at most ``nbytes`` (the receiver's own count of its
    shard's payload: a layout announcing any other total is refused before a frame is read).
    INVALID_ARGUMENT (`bad_request`) for a malformed layout, a short or long stream; what the
    arrays hold is the compressor's to check."""
    what = f"push {job}"
    try:
        specs = _array_specs(layout, what, nbytes)
        total = _nbytes(specs)
        if total != nbytes:
            raise ValueError(f"{what}: the payload announces {total} bytes in {len(specs)} arrays, "
                             f"this shard's payload has {nbytes}")
        return _split(_read_exactly(frames, total, what), 0, specs)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def read_payloads(layouts: object, frames: Iterator[bytes], what: str, nbytes_each: int,
                  max_payloads: int) -> list[dict[str, np.ndarray]]:
    """Several payloads sent back to back (a chain of compressed downlink deltas, `payloads_frames`):
    ``layouts`` lists each one's ``[name, dtype, count]`` arrays; each must announce exactly
    ``nbytes_each`` (the receiver's own count), and at most ``max_payloads`` may come. ValueError
    for a malformed layout or a short or long stream, before any array is returned."""
    if not isinstance(layouts, list) or len(layouts) > max_payloads:
        raise ValueError(f"{what}: deltas must be a list of at most {max_payloads} payload layouts")
    specs = [_array_specs(layout, what, nbytes_each) for layout in layouts]
    for s in specs:
        if _nbytes(s) != nbytes_each:
            raise ValueError(f"{what}: a delta announces {_nbytes(s)} bytes, this shard's payload has {nbytes_each}")
    data = _read_exactly(frames, nbytes_each * len(specs), what)
    return [_split(data, i * nbytes_each, s) for i, s in enumerate(specs)]


def payloads_frames(payloads: list[Payload], chunk_bytes: int) -> Iterator[bytes]:
    """Several payloads' bytes back to back (each as `payload_frames` writes one), in frames of at
    most ``chunk_bytes``."""
    blob = b"".join(b"".join(payload_frames(p, max(1, int(p.nbytes)))) for p in payloads)
    for b in range(0, len(blob), chunk_bytes):
        yield blob[b:b + chunk_bytes]
