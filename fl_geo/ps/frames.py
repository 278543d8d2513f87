"""Frames of the sharded Di-PS data path: how a tensor travels as a stream of gRPC messages.

gRPC without generated code: every method carries raw ``bytes`` (identity serialisers) under the
services ``flgeo.Follower`` (``Push``, ``Pull``, ``Control``) and ``flgeo.Leader``
(``Heartbeat``), so no protoc step and no new dependency.

A ``Push`` request stream and a ``Pull`` response stream start with one header frame (UTF-8 JSON)
followed by raw data frames: the tensor's bits in its wire dtype, little-endian, ``chunk_bytes``
per frame (4 MiB by default, the last one shorter). Data moves as the integer view of its bits
(int16 for bf16/fp16, int32 for fp32), so every value - NaN payloads included - arrives bit for
bit, and bf16 (which NumPy cannot name) needs no conversion. 4 MiB frames are large enough that
the per-frame Python work (one ``bytes`` object, one ``copy_``) is a small part of moving the
frame, and small enough to keep the read-ahead queues at a few tens of MiB. This module also
holds the checks of a JSON header's fields, shared by the service and the client, and the
errors both raise.
"""

from __future__ import annotations

import json
import math
import queue
import secrets
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import numpy as np
import torch

from fl_geo.ps.follower import WIRE_DTYPES

__all__ = [
    "CONTROL_OPS",
    "DEFAULT_CHUNK_BYTES",
    "FOLLOWER_SERVICE",
    "INCARNATION",
    "LEADER_SERVICE",
    "DataPathError", "decode_frame", "encode_frames", "wire_name"]


FOLLOWER_SERVICE = "flgeo.Follower"
LEADER_SERVICE = "flgeo.Leader"
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20  # gRPC's per-message limit on both ends (frames are far smaller)
MAX_CHUNK_BYTES = 32 << 20
QUEUE_FRAMES = 8  # read-ahead per stream: 8 × 4 MiB = 32 MiB in flight at most
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})
CONTROL_OPS = ("health", "has", "norms", "fold", "drop", "mean_sq_sums", "step", "reset_window",
               "version", "theta_sq_sums")
# A random id per process: the leader tells a restarted follower (new incarnation, state from its
# checkpoint, sums and pending pushes lost) from one that merely missed heartbeats.
INCARNATION = secrets.token_hex(8)

# Integer views that carry each wire dtype's bits: (torch view dtype, little-endian NumPy dtype).
BIT_VIEWS = {
    torch.float32: (torch.int32, np.dtype("<i4")),
    torch.bfloat16: (torch.int16, np.dtype("<i2")),
    torch.float16: (torch.int16, np.dtype("<i2")),
}
_WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"

# torch.frombuffer on an immutable `bytes` frame warns that the tensor could write into it; ours
# are only ever read (the source of one copy), so it is noise. torch issues it once per process
# (TORCH_WARN_ONCE), so spend that once here, silenced, instead of filtering warnings globally.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0", dtype=torch.int16)


class DataPathError(RuntimeError):
    """A data-path call that failed for good: a non-retryable status, a protocol violation, or
    retryable failures for longer than the client's ``retry_s``."""

    def __init__(self, op: str, address: str, detail: str,
                 code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{op} at {address} failed: {detail}")
        self.op = op
        self.address = address
        self.detail = detail
        self.code = code


class RequestError(Exception):
    """A request the service refuses with a gRPC status (raised inside handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def bad_request(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---- frames ---------------------------------------------------------------------------------------

def wire_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bf16"``; ValueError for a dtype that is not a wire dtype."""
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not a wire dtype; valid: {', '.join(WIRE_DTYPES)}") from None


def elems_per_frame(chunk_bytes: int, itemsize: int) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise ValueError(f"chunk_bytes must be an int, got {chunk_bytes!r}")
    if not itemsize <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must lie in [{itemsize}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    return chunk_bytes // itemsize


def encode_frames(tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The data frames of a 1-D wire-dtype tensor: little-endian bits, ``chunk_bytes`` each.

    One copy per frame (into the ``bytes`` object gRPC needs); the tensor itself is not copied,
    only made contiguous if it is not."""
    flat = tensor.detach().reshape(-1).contiguous()
    view_dtype, np_dtype = BIT_VIEWS[flat.dtype]
    bits = flat.view(view_dtype).numpy()
    step = elems_per_frame(chunk_bytes, np_dtype.itemsize)
    for b in range(0, bits.size, step):
        # astype is a no-op on little-endian hosts and a byte swap elsewhere
        yield bits[b:b + step].astype(np_dtype, copy=False).tobytes()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bits of a contiguous 1-D wire-dtype tensor as one ``bytes``."""
    view_dtype, np_dtype = BIT_VIEWS[t.dtype]
    return t.view(view_dtype).numpy().astype(np_dtype, copy=False).tobytes()


def decode_frame(frame: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A data frame as a 1-D tensor of ``dtype`` that reads the frame's memory (no copy on
    little-endian hosts). Raises ValueError for an empty frame or a partial element."""
    view_dtype, np_dtype = BIT_VIEWS[dtype]
    if not frame:
        raise ValueError("empty data frame")
    if len(frame) % np_dtype.itemsize:
        raise ValueError(f"data frame of {len(frame)} bytes is not a whole number of "
                         f"{np_dtype.itemsize}-byte {wire_name(dtype)} elements")
    if _LITTLE_ENDIAN:
        return torch.frombuffer(frame, dtype=dtype)
    native = np.frombuffer(frame, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    return torch.from_numpy(native).view(dtype)


def json_frame(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# The longest JSON frame (push header, pull or control request) a follower parses: they hold a
# few ids and numbers, so 1 MiB is generous; gRPC's own limit (MAX_MESSAGE_BYTES) would let a
# 64 MiB JSON document through to the parser and into memory as nested Python objects.
MAX_JSON_FRAME_BYTES = 1 << 20


def parse_json(frame: bytes, what: str) -> dict[str, Any]:
    """A JSON object frame; INVALID_ARGUMENT for one over `MAX_JSON_FRAME_BYTES` (refused before
    parsing), not UTF-8 JSON, or not an object."""
    if len(frame) > MAX_JSON_FRAME_BYTES:
        raise bad_request(f"{what} of {len(frame)} bytes exceeds {MAX_JSON_FRAME_BYTES}")
    try:
        obj = json.loads(frame.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"{what} is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def check_keys(obj: dict[str, Any], what: str, required: Iterable[str],
                optional: Iterable[str] = ()) -> None:
    required = set(required)
    if missing := sorted(required - set(obj)):
        raise bad_request(f"{what} lacks {missing}")
    if unknown := sorted(set(obj) - required - set(optional)):
        raise bad_request(f"{what} has unknown keys {unknown}")


def int_field(obj: dict[str, Any], key: str, what: str, *, minimum: int = 0) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_request(f"{what}: {key} must be an int >= {minimum}, got {value!r}")
    return value


def number_field(obj: dict[str, Any], key: str, what: str, *, minimum: float | None = None) -> float:
    """A finite number (JSON lets NaN and Infinity through: one in a fold weight, a clip factor
    or a step's lr would make the shard non-finite), at least ``minimum`` when given."""
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{what}: {key} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise bad_request(f"{what}: {key} must be >= {minimum}, got {value!r}")
    return float(value)


def str_field(obj: dict[str, Any], key: str, what: str) -> str:
    value = obj[key]
    if not isinstance(value, str) or not value:
        raise bad_request(f"{what}: {key} must be a non-empty string, got {value!r}")
    return value


def wire_field(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in WIRE_DTYPES:
        raise bad_request(f"{what}: dtype {value!r} is not a wire dtype; valid: {', '.join(WIRE_DTYPES)}")
    return value


def put_or_stop(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up once ``stop`` is set (the other side went away)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
