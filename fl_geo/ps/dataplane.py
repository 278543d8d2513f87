"""The data path of the sharded Di-PS: gRPC between clients, followers and the leader.

Di-PS (§4.1, "Dual-workflow Mechanism") keeps the model's bytes off the control path: the Flower
ServerApp (the *leader*) sends and receives only small control messages, while datacenter
clients push update shards to, and pull parameter shards from, the *followers* directly. This
module is that data path, plus the follower side of the leader's control requests and the
heartbeats of §4.3 ("Failure Tolerance of Di-PS"); `fl_geo.ps.supervisor` runs and
restarts the follower processes. It does not import Flower and
holds no model code: a follower's state and arithmetic are `fl_geo.ps.follower.FollowerShard`.

gRPC without generated code: every method carries raw ``bytes`` (identity serialisers) under the
services ``flgeo.Follower`` (``Push``, ``Pull``, ``Control``) and ``flgeo.Leader``
(``Heartbeat``), so no protoc step and no new dependency.

**Frames.** A ``Push`` request stream and a ``Pull`` response stream start with one header frame
(UTF-8 JSON) followed by raw data frames: the tensor's bits in its wire dtype, little-endian,
``chunk_bytes`` per frame (4 MiB by default, the last one shorter). Data moves as the integer
view of its bits (int16 for bf16/fp16, int32 for fp32), so every value - NaN payloads included -
arrives bit for bit, and bf16 (which NumPy cannot name) needs no conversion. 4 MiB frames are
large enough that the per-frame Python work (one ``bytes`` object, one ``copy_``) is a small
part of moving the frame, and small enough to keep the read-ahead queues at a few tens of MiB.

**Operation overlapping** (Di-PS §4.1): a push is received by the gRPC handler thread and put on
a bounded queue; a consumer thread turns each frame into a tensor and copies it into the
follower's `PushBuffer`, so receiving frame k+1 overlaps with copying frame k. A pull is the
mirror image: a producer thread reads θ chunk by chunk ahead of the handler that sends them.
The client side does the same for pushes (frames serialised ahead of gRPC's sender).

**Failure handling.** `FollowerClient` retries UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED with
exponential backoff for up to ``retry_s``: a follower being restarted by the `FollowerSupervisor`
on the same port does not fail a client's transfer, it delays it. Pushes are re-sent whole (a
follower's ``open_push`` replaces a partial push). Control requests carry an id and the follower
answers a repeated id from a small cache instead of executing it twice, so retrying
``mean_sq_sums`` (which divides the running sum in place) or ``fold`` after a lost reply is safe.
A follower's ``step`` is acknowledged only after its checkpoint is on disk, so a restarted
follower resumes from every step the leader saw acknowledged.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import secrets
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.ps.follower import WIRE_DTYPES, FollowerError, FollowerShard, PushBuffer

__all__ = [
    "CONTROL_OPS",
    "DEFAULT_CHUNK_BYTES",
    "FOLLOWER_SERVICE",
    "INCARNATION",
    "LEADER_SERVICE",
    "DataPathError",
    "FollowerClient",
    "FollowerServer",
    "FollowerService",
    "LeaderHeartbeatService",
    "TlsFiles",
    "decode_frame",
    "encode_frames",
    "wire_name",
]

log = logging.getLogger("fl_geo")

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
_BITS = {
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

T = TypeVar("T")


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


class _RequestError(Exception):
    """A request the service refuses with a gRPC status (raised inside handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(message: str) -> _RequestError:
    return _RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---- frames ---------------------------------------------------------------------------------------

def wire_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bf16"``; ValueError for a dtype that is not a wire dtype."""
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not a wire dtype; valid: {', '.join(WIRE_DTYPES)}") from None


def _elems_per_frame(chunk_bytes: int, itemsize: int) -> int:
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
    view_dtype, np_dtype = _BITS[flat.dtype]
    bits = flat.view(view_dtype).numpy()
    step = _elems_per_frame(chunk_bytes, np_dtype.itemsize)
    for b in range(0, bits.size, step):
        # astype is a no-op on little-endian hosts and a byte swap elsewhere
        yield bits[b:b + step].astype(np_dtype, copy=False).tobytes()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bits of a contiguous 1-D wire-dtype tensor as one ``bytes``."""
    view_dtype, np_dtype = _BITS[t.dtype]
    return t.view(view_dtype).numpy().astype(np_dtype, copy=False).tobytes()


def decode_frame(frame: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A data frame as a 1-D tensor of ``dtype`` that reads the frame's memory (no copy on
    little-endian hosts). Raises ValueError for an empty frame or a partial element."""
    view_dtype, np_dtype = _BITS[dtype]
    if not frame:
        raise ValueError("empty data frame")
    if len(frame) % np_dtype.itemsize:
        raise ValueError(f"data frame of {len(frame)} bytes is not a whole number of "
                         f"{np_dtype.itemsize}-byte {wire_name(dtype)} elements")
    if _LITTLE_ENDIAN:
        return torch.frombuffer(frame, dtype=dtype)
    native = np.frombuffer(frame, dtype=np_dtype).astype(np_dtype.newbyteorder("="))
    return torch.from_numpy(native).view(dtype)


def _json_frame(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _parse_json(frame: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(frame.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"{what} is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _bad(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_keys(obj: dict[str, Any], what: str, required: Iterable[str],
                optional: Iterable[str] = ()) -> None:
    required = set(required)
    if missing := sorted(required - set(obj)):
        raise _bad(f"{what} lacks {missing}")
    if unknown := sorted(set(obj) - required - set(optional)):
        raise _bad(f"{what} has unknown keys {unknown}")


def _int(obj: dict[str, Any], key: str, what: str, *, minimum: int = 0) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(f"{what}: {key} must be an int >= {minimum}, got {value!r}")
    return value


def _number(obj: dict[str, Any], key: str, what: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{what}: {key} must be a number, got {value!r}")
    return float(value)


def _str(obj: dict[str, Any], key: str, what: str) -> str:
    value = obj[key]
    if not isinstance(value, str) or not value:
        raise _bad(f"{what}: {key} must be a non-empty string, got {value!r}")
    return value


def _wire(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in WIRE_DTYPES:
        raise _bad(f"{what}: dtype {value!r} is not a wire dtype; valid: {', '.join(WIRE_DTYPES)}")
    return value


def _channel_options() -> list[tuple[str, int]]:
    """Large messages, and quick reconnects: gRPC's default reconnect backoff (1 s growing to
    120 s) would keep a channel refusing calls long after a restarted follower is back."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def _server_options() -> list[tuple[str, int]]:
    """No SO_REUSEPORT: a restarted follower rebinds its old port, and must fail loudly rather
    than share it with a leftover process that is still listening."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


@dataclass(frozen=True)
class TlsFiles:
    """TLS for the data path: the CA that signed the followers' (and leader's) certificate, and,
    on the serving side, that certificate and its key (PEM files, e.g. `fl-geo deploy certs`:
    ``ca.crt``, ``server.crt``, ``server.key``). Clients need only the CA's PEM text, which the
    leader sends with each job, so no file has to be copied to the sites."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"data path TLS {name} file {path} does not exist")

    def ca_pem(self) -> bytes:
        return Path(self.ca).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs the certificate and its key")
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem())


def _channel(address: str, root_certificates: bytes | None) -> grpc.Channel:
    """A TLS channel when a CA is given, else plaintext (loopback or an explicit opt-in)."""
    if root_certificates:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root_certificates),
                                   options=_channel_options())
    return grpc.insecure_channel(address, options=_channel_options())


def _bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """``add_insecure_port`` (``add_secure_port`` with credentials) that always raises on
    failure (older grpcio returned 0)."""
    try:
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    return bound


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up once ``stop`` is set (the other side went away)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


# ---- follower service ---------------------------------------------------------------------------

@dataclass
class _PushState:
    """What the handler and consumer threads of one push share."""

    error: _RequestError | None = None
    received: int = 0


@dataclass
class _ControlCall:
    """One control request id: running (``done`` unset) or answered (reply or error kept)."""

    done: threading.Event = field(default_factory=threading.Event)
    reply: bytes | None = None
    error: _RequestError | None = None


class FollowerService:
    """The gRPC face of one `FollowerShard` (service ``flgeo.Follower``).

    ``lock`` serialises every FollowerShard call: the class is not thread-safe, and the calls
    are short (one chunk copy, one chunk read, or a leader operation), so one lock costs little
    next to moving the bytes and keeps the reasoning simple. Measured: a push of 4 MiB frames
    spends well under 1 ms per frame inside the lock.
    """

    def __init__(self, follower: FollowerShard, store: CheckpointStore | None = None, *,
                 incarnation: str = INCARNATION, queue_frames: int = QUEUE_FRAMES,
                 remember: int = 1024) -> None:
        self.follower = follower
        self.store = store
        self.incarnation = incarnation
        self.queue_frames = queue_frames
        self.lock = threading.Lock()
        self._save_lock = threading.Lock()  # orders checkpoint writes by step
        self._owners: dict[str, object] = {}  # job -> token of the push stream writing it
        self._calls: collections.OrderedDict[str, _ControlCall] = collections.OrderedDict()
        self._calls_lock = threading.Lock()
        self._remember = remember

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to add to a ``grpc.Server``."""
        return grpc.method_handlers_generic_handler(FOLLOWER_SERVICE, {
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Pull": grpc.unary_stream_rpc_method_handler(self._pull),
            "Control": grpc.unary_unary_rpc_method_handler(self._control),
        })

    def health(self) -> dict[str, Any]:
        """What ``health`` answers and heartbeats carry.

        Read without the lock (each value is one atomic read under the GIL): liveness must not
        wait behind a fold or a step of a multi-GiB shard, which hold the lock for seconds."""
        f = self.follower
        return {"index": f.index, "version": f.version, "incarnation": self.incarnation,
                "pending": len(f.pending), "numel": f.numel, "wire": f.wire}

    # -- Push ----------------------------------------------------------------------------------
    def _push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            return self._push_stream(iter(request_iterator))
        except _RequestError as exc:
            context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from None  # abort raises

    def _push_stream(self, frames: Iterator[bytes]) -> bytes:
        f = self.follower
        first = next(frames, None)
        if first is None:
            raise _bad("empty push stream (no header frame)")
        header = _parse_json(first, "push header")
        _check_keys(header, "push header", ("job", "shard", "dtype", "numel"), ("meta",))
        job = _str(header, "job", "push header")
        shard = _int(header, "shard", "push header")
        wire = _wire(header["dtype"], "push header")
        numel = _int(header, "numel", "push header")
        meta = header.get("meta") or {}
        if not isinstance(meta, dict):
            raise _bad(f"push header: meta must be a JSON object, got {type(meta).__name__}")
        if shard != f.index:
            raise _bad(f"push of job {job!r} is for shard {shard}, this follower holds shard {f.index}")
        if wire != f.wire:
            raise _bad(f"push of job {job!r} is {wire}, this follower's wire precision is {f.wire}")
        if numel != f.numel:
            raise _bad(f"push of job {job!r} announces {numel} elements, shard {f.index} has {f.numel}")

        token = object()
        with self.lock:
            try:
                buf = f.open_push(job, meta)
            except FollowerError as exc:
                raise _RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            self._owners[job] = token  # a newer stream of the same job takes over from us
        state = _PushState()
        q: queue.Queue[bytes | None] = queue.Queue(self.queue_frames)
        consumer = threading.Thread(target=self._consume, args=(q, job, token, buf, state),
                                    name=f"push-{job}", daemon=True)
        consumer.start()
        complete = False
        try:
            try:
                for frame in frames:
                    if state.error is not None:
                        break
                    q.put(frame)  # the consumer drains even after an error: never blocks forever
            except grpc.RpcError:  # the client went away mid-stream
                if state.error is None:
                    state.error = _RequestError(grpc.StatusCode.CANCELLED, f"push {job} was cancelled")
            finally:
                q.put(None)
                consumer.join()
            with self.lock:
                if self._owners.get(job) is not token:
                    raise _RequestError(grpc.StatusCode.ABORTED,
                                        f"push {job} was replaced by a newer push of the same job")
                if state.error is not None:
                    raise state.error
                try:
                    f.close_push(job)  # a short push is removed by close_push itself
                except FollowerError as exc:
                    raise _bad(str(exc)) from None
                complete = True
            return _json_frame({"ok": True, "job": job, "received": state.received})
        finally:
            with self.lock:
                if self._owners.get(job) is token:
                    del self._owners[job]
                    if not complete and f.pending.get(job) is buf:
                        f.drop(job)  # a broken push leaves nothing behind

    def _consume(self, q: queue.Queue[bytes | None], job: str, token: object, buf: PushBuffer,
                 state: _PushState) -> None:
        """Consumer thread: frame → tensor → ``PushBuffer.write`` until the end marker."""
        f = self.follower
        while True:
            frame = q.get()
            if frame is None:
                return
            if state.error is not None:
                continue  # drain, so the handler's put never blocks
            try:
                try:
                    chunk = decode_frame(frame, f.dtype)
                except ValueError as exc:
                    raise _bad(f"push {job}: {exc}") from None
                n = chunk.numel()
                if state.received + n > f.numel:
                    raise _bad(f"push {job} carries more than the shard's {f.numel} elements "
                               f"(a frame of {n} after {state.received})")
                with self.lock:
                    if self._owners.get(job) is not token or f.pending.get(job) is not buf:
                        raise _RequestError(grpc.StatusCode.ABORTED,
                                            f"push {job} was replaced or dropped while it streamed")
                    buf.write(state.received, chunk)
                state.received += n
            except _RequestError as exc:
                state.error = exc
            except FollowerError as exc:
                state.error = _bad(str(exc))
            except Exception as exc:  # noqa: BLE001 - reported to the client, keep draining
                state.error = _RequestError(grpc.StatusCode.INTERNAL, f"push {job}: {exc!r}")

    # -- Pull ----------------------------------------------------------------------------------
    def _pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """θ[begin:end] as a header and data frames.

        Consistency: every chunk is read under the lock and checked against the version the
        stream started with; a step in between fails the pull with ABORTED (the client retries
        from the start). The alternative, one snapshot under the lock, would cost a copy of the
        range per concurrent pull (N clients × shard bytes) to protect against a race that the
        leader's protocol makes rare (clients pull after a step, not during one)."""
        f = self.follower
        try:
            req = _parse_json(request, "pull request")
            _check_keys(req, "pull request", ("begin", "end"), ("wire", "expect_version", "chunk_bytes"))
            begin, end = _int(req, "begin", "pull request"), _int(req, "end", "pull request")
            if not begin <= end <= f.numel:
                raise _bad(f"pull [{begin}, {end}) outside shard {f.index} of {f.numel} elements")
            wire = f.wire if req.get("wire") is None else _wire(req["wire"], "pull request")
            expect = req.get("expect_version")
            if expect is not None:
                expect = _int(req, "expect_version", "pull request")
            dtype = WIRE_DTYPES[wire]
            chunk_bytes = req.get("chunk_bytes") or DEFAULT_CHUNK_BYTES
            try:
                step = _elems_per_frame(chunk_bytes, dtype.itemsize)
            except ValueError as exc:
                raise _bad(f"pull request: {exc}") from None
            with self.lock:
                version = f.version
            if expect is not None and expect != version:
                raise _RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"follower {f.index} is at version {version}, the pull expects {expect}")
        except _RequestError as exc:
            context.abort(exc.code, exc.message)
            return

        q: queue.Queue[bytes | _RequestError | None] = queue.Queue(self.queue_frames)
        stop = threading.Event()

        def produce() -> None:
            try:
                for b in range(begin, end, step):
                    e = min(end, b + step)
                    with self.lock:
                        if f.version != version:
                            _put(q, _RequestError(grpc.StatusCode.ABORTED,
                                                  f"follower {f.index} stepped from version {version} to "
                                                  f"{f.version} during the pull; retry"), stop)
                            return
                        chunk = f.read(b, e, wire)
                    frame = _tensor_bytes(chunk)  # serialised here, outside the lock
                    if not _put(q, frame, stop):
                        return
                _put(q, None, stop)
            except Exception as exc:  # noqa: BLE001 - reported to the client, never swallowed
                _put(q, _RequestError(grpc.StatusCode.INTERNAL, f"pull failed: {exc!r}"), stop)

        producer = threading.Thread(target=produce, name="pull", daemon=True)
        producer.start()
        try:
            yield _json_frame({"version": version, "numel": end - begin, "dtype": wire})
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, _RequestError):
                    context.abort(item.code, item.message)
                yield item
        finally:
            stop.set()  # the client may have gone: release the producer
            producer.join()

    # -- Control -------------------------------------------------------------------------------
    def _control(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = _parse_json(request, "control request")
            _check_keys(req, "control request", ("op",), ("args", "id", "incarnation"))
            op, args, rid = req["op"], req.get("args") or {}, req.get("id")
            if op not in CONTROL_OPS:
                raise _bad(f"unknown control op {op!r}; valid: {', '.join(CONTROL_OPS)}")
            if not isinstance(args, dict):
                raise _bad(f"control {op}: args must be a JSON object")
            if rid is not None and (not isinstance(rid, str) or not rid):
                raise _bad("control request: id must be a non-empty string")
            expected = req.get("incarnation")
            if expected is not None and expected != self.incarnation and op not in ("health", "version"):
                raise _RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"follower {self.follower.index} restarted (incarnation {self.incarnation}, the leader "
                    f"expects {expected}): its running sum and pending pushes are gone")
            return self._once(rid, lambda: self._execute(op, args))
        except _RequestError as exc:
            context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from None

    def _once(self, rid: str | None, fn: Callable[[], bytes]) -> bytes:
        """Run ``fn`` once per request id; a repeated id (a client retry after a lost reply or a
        deadline) waits for and returns the first execution's answer."""
        if rid is None:
            return fn()
        with self._calls_lock:
            call = self._calls.get(rid)
            owner = call is None
            if owner:
                call = self._calls[rid] = _ControlCall()
                while len(self._calls) > self._remember:
                    old_id, old = next(iter(self._calls.items()))
                    if not old.done.is_set():
                        break
                    del self._calls[old_id]
        if not owner:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.reply  # type: ignore[return-value]
        try:
            call.reply = fn()
            return call.reply
        except _RequestError as exc:
            call.error = exc
            raise
        except Exception as exc:
            call.error = _RequestError(grpc.StatusCode.INTERNAL, f"{exc!r}")
            raise
        finally:
            call.done.set()

    def _execute(self, op: str, args: dict[str, Any]) -> bytes:
        f = self.follower
        what = f"control {op}"
        try:
            if op in ("health", "version", "theta_sq_sums"):
                _check_keys(args, what, ())
                if op == "health":
                    out = self.health()
                elif op == "version":
                    out = {"version": self._locked(lambda: f.version)}
                else:
                    with self.lock:
                        out = {"sq_sums": f.theta_sq_sums(), "version": f.version}
            elif op in ("has", "norms", "drop"):
                _check_keys(args, what, ("job",))
                job = _str(args, "job", what)
                if op == "has":
                    out = {"has": self._locked(lambda: f.has(job))}
                elif op == "norms":
                    with self.lock:
                        out = {"sq_sums": f.norms(job), "version": f.version}
                else:
                    self._locked(lambda: f.drop(job))
                    out = {"ok": True}
            elif op == "fold":
                _check_keys(args, what, ("job", "weight"), ("rescale",))
                job, weight = _str(args, "job", what), _number(args, "weight", what)
                rescale = _number(args, "rescale", what) if "rescale" in args else 1.0
                self._locked(lambda: f.fold(job, weight, rescale))
                out = {"ok": True}
            elif op == "mean_sq_sums":
                _check_keys(args, what, ("total_weight",))
                total = _number(args, "total_weight", what)
                out = {"sq_sums": self._locked(lambda: f.mean_sq_sums(total))}
            elif op == "step":
                _check_keys(args, what, ("clip_factor",), ("lr",))
                clip = _number(args, "clip_factor", what)
                lr = None if args.get("lr") is None else _number(args, "lr", what)
                out = {"version": self._step(clip, lr)}
            else:  # reset_window
                _check_keys(args, what, (), ("drop_pending",))
                drop = args.get("drop_pending", False)
                if not isinstance(drop, bool):
                    raise _bad(f"{what}: drop_pending must be a bool, got {drop!r}")
                self._locked(lambda: f.reset_window(drop_pending=drop))
                out = {"ok": True}
        except FollowerError as exc:
            raise _RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return _json_frame(out)

    def _locked(self, fn: Callable[[], T]) -> T:
        with self.lock:
            return fn()

    def _step(self, clip_factor: float, lr: float | None) -> int:
        """Step, then make it durable before answering.

        The state is cloned under the lock and written outside it, so pushes of the next window
        keep streaming while the checkpoint is hashed and fsynced (Di-PS overlaps checkpointing
        with communication); the cost is one transient copy of θ_s and the optimizer state.
        ``_save_lock`` is taken first so checkpoints land in step order."""
        with self._save_lock:
            with self.lock:
                version = self.follower.step(clip_factor, lr)
                snapshot = _clone_state(self.follower.state_dict()) if self.store is not None else None
            if snapshot is not None:
                try:
                    self.store.save(version, snapshot)  # type: ignore[union-attr]
                except Exception as exc:
                    raise _RequestError(grpc.StatusCode.INTERNAL,
                                        f"step {version} applied but its checkpoint failed: {exc!r}") from exc
        return version


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of tensors in a (nested) state dict; other values are immutable scalars."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value):
            out[key] = value.detach().clone()
        elif isinstance(value, dict):
            out[key] = _clone_state(value)
        else:
            out[key] = value
    return out


# ---- leader heartbeats -----------------------------------------------------------------------------

class LeaderHeartbeatService:
    """The leader's side of follower heartbeats (service ``flgeo.Leader``, method ``Heartbeat``).

    Records, per (follower index, incarnation), the monotonic time of the last heartbeat and
    what it said, so a supervisor can tell a live follower from a leftover process of an earlier
    incarnation that still sends. `serve` runs it on its own gRPC server; `handler` lets the
    leader add it to a server it already runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], tuple[float, dict[str, Any]]] = {}
        self._server: grpc.Server | None = None
        self.port: int | None = None

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(LEADER_SERVICE, {
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat),
        })

    def _heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            beat = _parse_json(request, "heartbeat")
            _check_keys(beat, "heartbeat", ("index", "incarnation", "version", "pending"))
            index = _int(beat, "index", "heartbeat")
            incarnation = _str(beat, "incarnation", "heartbeat")
            _int(beat, "version", "heartbeat")
            _int(beat, "pending", "heartbeat")
        except _RequestError as exc:
            context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from None
        with self._lock:
            self._seen[(index, incarnation)] = (time.monotonic(), beat)
        return _json_frame({"ok": True})

    def last_seen(self, index: int, incarnation: str | None = None) -> float | None:
        """Monotonic time of the newest heartbeat of ``index`` (of that incarnation if given)."""
        with self._lock:
            times = [t for (i, inc), (t, _) in self._seen.items()
                     if i == index and (incarnation is None or inc == incarnation)]
        return max(times) if times else None

    def latest(self, index: int) -> dict[str, Any] | None:
        """The newest heartbeat of ``index`` (any incarnation) as sent."""
        with self._lock:
            beats = [(t, b) for (i, _), (t, b) in self._seen.items() if i == index]
        return max(beats, key=lambda tb: tb[0])[1] if beats else None

    def serve(self, port: int = 0, host: str = "127.0.0.1", credentials: grpc.ServerCredentials | None = None) -> int:
        """Start a gRPC server for this service alone; returns its port."""
        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="leader-hb"),
                             options=_server_options())
        server.add_generic_rpc_handlers((self.handler(),))
        self.port = _bind(server, host, port, credentials)
        server.start()
        self._server = server
        return self.port

    def stop(self, grace: float = 0.5) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None


# ---- follower server (process side) ---------------------------------------------------------------

class FollowerServer:
    """A `FollowerService` on its own gRPC server, plus the heartbeat thread of §4.3.

    The heartbeat thread sends ``{index, incarnation, version, pending}`` to the leader every
    ``heartbeat_s`` with a short deadline and never blocks on it: while the leader is down the
    follower keeps serving clients and keeps trying (Di-PS: components reconnect non-blockingly
    until the leader is back)."""

    def __init__(self, follower: FollowerShard, store: CheckpointStore | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, leader: str | None = None,
                 heartbeat_s: float = 1.0, max_workers: int = 16,
                 incarnation: str = INCARNATION, tls: TlsFiles | None = None) -> None:
        self.service = FollowerService(follower, store, incarnation=incarnation)
        self.tls = tls
        self.host = host
        self.requested_port = port
        self.leader = leader
        self.heartbeat_s = heartbeat_s
        self.max_workers = max_workers
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the follower server is not started")
        return f"{self.host}:{self.port}"

    def start(self) -> FollowerServer:
        # A pool larger than the expected concurrent pushes/pulls: each stream holds a worker
        # for its duration, and the leader's control calls must not queue behind them.
        server = grpc.server(ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="follower"),
                             options=_server_options())
        server.add_generic_rpc_handlers((self.service.handler(),))
        self.port = _bind(server, self.host, self.requested_port,
                          self.tls.server_credentials() if self.tls is not None else None)
        server.start()
        self._server = server
        if self.leader:
            self._beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
            self._beat.start()
        return self

    def _heartbeats(self) -> None:
        channel = _channel(self.leader, self.tls.ca_pem() if self.tls is not None else None)  # type: ignore[arg-type]
        call = channel.unary_unary(f"/{LEADER_SERVICE}/Heartbeat")
        failing = False
        try:
            while not self._stop.is_set():
                h = self.service.health()
                beat = {k: h[k] for k in ("index", "incarnation", "version", "pending")}
                try:
                    call(_json_frame(beat), timeout=max(0.5, self.heartbeat_s))
                    if failing:
                        log.info("follower %d: leader %s reachable again", h["index"], self.leader)
                    failing = False
                except grpc.RpcError as exc:
                    if not failing:
                        log.warning("follower %d: heartbeat to leader %s failed (%s); still trying",
                                    h["index"], self.leader, exc.code())
                    failing = True
                self._stop.wait(self.heartbeat_s)
        finally:
            channel.close()

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None

    def __enter__(self) -> FollowerServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)


# ---- client -----------------------------------------------------------------------------------------

class _ReadAhead:
    """Iterate ``source`` in a thread, ``depth`` items ahead (client-side push serialisation
    overlaps gRPC's sending of the previous frame). `close` releases the thread early."""

    _END = object()

    def __init__(self, source: Iterator[bytes], depth: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(source,), name="push-frames", daemon=True)
        self._thread.start()

    def _run(self, source: Iterator[bytes]) -> None:
        try:
            for item in source:
                if not _put(self._q, item, self._stop):
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._error = exc
        _put(self._q, self._END, self._stop)

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                item = self._q.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return  # closed: do not leave gRPC's sender thread waiting here
                continue
            if item is self._END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class FollowerClient:
    """Client of one follower, for datacenter clients (push, pull) and the leader (control).

    Every call retries UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED with backoff (0.1 s doubling
    to 2 s) for up to ``retry_s`` in all, so a follower restart delays a transfer instead of
    failing it; any other status raises `DataPathError` at once. A call's deadline grows with
    its size (``timeout_s + bytes / min_rate``) so a big transfer over a slow link is not cut
    off, while a hung follower is still detected.

    Retrying against a follower that was restarted in between would run a window operation on
    fresh state (``mean_sq_sums`` of an empty sum is zeros, silently). The leader therefore pins
    the incarnation it expects (``client.incarnation = client.health()["incarnation"]``); every
    control call but ``health``/``version`` then fails with FAILED_PRECONDITION on any other
    incarnation, and the leader voids the window and re-pins."""

    def __init__(self, address: str, *, retry_s: float = 120.0, timeout_s: float = 30.0,
                 min_rate: float = 10e6, read_ahead: int = 4, incarnation: str | None = None,
                 root_certificates: bytes | None = None) -> None:
        self.address = address
        self.incarnation = incarnation
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.read_ahead = read_ahead
        self._channel = _channel(address, root_certificates)
        self._push = self._channel.stream_unary(f"/{FOLLOWER_SERVICE}/Push")
        self._pull = self._channel.unary_stream(f"/{FOLLOWER_SERVICE}/Pull")
        self._control = self._channel.unary_unary(f"/{FOLLOWER_SERVICE}/Control")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FollowerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_rate

    def _retry(self, op: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                detail = exc.details() if hasattr(exc, "details") else str(exc)
                name = code.name if code is not None else "UNKNOWN"
                if code not in RETRYABLE:
                    raise DataPathError(op, self.address, f"{name}: {detail}", code) from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DataPathError(op, self.address, f"still {name} after retrying for "
                                        f"{self.retry_s:g} s: {detail}", code) from None
                log.debug("%s at %s: %s (%s); retrying in %.1f s", op, self.address, name, detail, delay)
                time.sleep(min(delay, left))
                delay = min(2 * delay, 2.0)

    def push(self, job: str, shard_index: int, tensor: torch.Tensor,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stream a whole shard (1-D, in the follower's wire dtype) as ``job``; returns the
        follower's reply ``{ok, job, received}`` once the push is complete there."""
        flat = tensor.detach().reshape(-1).contiguous()
        dtype = wire_name(flat.dtype)
        _elems_per_frame(chunk_bytes, flat.element_size())  # fail here, not in a thread
        header = _json_frame({"job": job, "shard": shard_index, "dtype": dtype, "numel": flat.numel(),
                              **({"meta": meta} if meta else {})})
        nbytes = flat.numel() * flat.element_size()

        def attempt() -> dict[str, Any]:
            frames = _ReadAhead(encode_frames(flat, chunk_bytes), self.read_ahead)
            try:
                reply = self._push(_chain(header, frames), timeout=self._timeout(nbytes))
            finally:
                frames.close()
            return json.loads(reply)

        return self._retry("push", attempt)

    def pull(self, begin: int, end: int, wire: str | None = None, *, expect_version: int | None = None,
             chunk_bytes: int | None = None) -> tuple[int, torch.Tensor]:
        """θ_s[begin:end] (shard-relative) in ``wire`` (default: the follower's); returns
        ``(version, tensor)``. A pull interrupted by a step or a restart starts over."""
        req: dict[str, Any] = {"begin": begin, "end": end}
        if wire is not None:
            req["wire"] = wire
        if expect_version is not None:
            req["expect_version"] = expect_version
        if chunk_bytes is not None:
            req["chunk_bytes"] = chunk_bytes
        request = _json_frame(req)
        itemsize = WIRE_DTYPES[wire].itemsize if wire in WIRE_DTYPES else 4

        def attempt() -> tuple[int, torch.Tensor]:
            stream = self._pull(request, timeout=self._timeout((end - begin) * itemsize))
            try:
                return self._read_pull(stream)
            finally:
                stream.cancel()  # a no-op once the stream has ended

        return self._retry("pull", attempt)

    def _read_pull(self, stream: Iterator[bytes]) -> tuple[int, torch.Tensor]:
        def protocol(detail: str) -> DataPathError:
            return DataPathError("pull", self.address, f"protocol error: {detail}")

        first = next(stream, None)
        if first is None:
            raise protocol("stream ended before the header")
        try:
            header = json.loads(first)
            version, numel, wire = int(header["version"]), int(header["numel"]), header["dtype"]
            dtype = WIRE_DTYPES[wire]
        except (ValueError, KeyError, TypeError) as exc:
            raise protocol(f"bad header {first[:200]!r}: {exc}") from None
        out = torch.empty(numel, dtype=dtype)
        view_dtype, np_dtype = _BITS[dtype]
        dst = out.view(view_dtype).numpy()
        pos = 0
        for frame in stream:
            if len(frame) % np_dtype.itemsize:
                raise protocol(f"frame of {len(frame)} bytes is not whole {wire} elements")
            n = len(frame) // np_dtype.itemsize
            if pos + n > numel:
                raise protocol(f"more than the announced {numel} elements")
            dst[pos:pos + n] = np.frombuffer(frame, dtype=np_dtype)  # one copy, byte order fixed
            pos += n
        if pos != numel:
            raise protocol(f"stream ended after {pos} of {numel} elements")
        return version, out

    def control(self, op: str, **args: Any) -> dict[str, Any]:
        """One leader operation (see `CONTROL_OPS`); the id makes retries execute it once."""
        req: dict[str, Any] = {"op": op, "args": args, "id": uuid.uuid4().hex}
        if self.incarnation is not None:
            req["incarnation"] = self.incarnation
        request = _json_frame(req)
        # a step writes a checkpoint before answering; a deadline is harmless anyway (the retry
        # carries the same id and waits for the first execution), it only bounds each wait
        timeout = max(self.timeout_s, 300.0) if op == "step" else self.timeout_s
        return self._retry(op, lambda: json.loads(self._control(request, timeout=timeout)))

    def health(self) -> dict[str, Any]:
        return self.control("health")


def _chain(first: bytes, rest: Iterable[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest
