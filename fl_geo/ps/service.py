"""The follower's gRPC service (``flgeo.Follower``: ``Push``, ``Pull``, ``Control``).

Operation overlapping (Di-PS §4.1): a push is received by the gRPC handler thread and put on a
bounded queue; a consumer thread turns each frame into a tensor and copies it into the follower's
`PushBuffer`, so receiving frame k+1 overlaps with copying frame k. A pull is the mirror image: a
producer thread reads θ chunk by chunk ahead of the handler that sends them.

Control requests carry an id and the service answers a repeated id from a small cache instead of
executing it twice, so a client's retry of ``mean_sq_sums`` (which divides the running sum in
place) or ``fold`` after a lost reply is safe. A ``step`` is acknowledged only after the
follower's checkpoint is on disk, so a restarted follower resumes from every step the leader saw
acknowledged. The service holds no model code: a follower's state and arithmetic are
`fl_geo.ps.follower.FollowerShard`.

Authentication (`fl_geo.ps.auth`; the rules are `fl_geo.ps.access.FollowerAccess`'s), when the
service has the shared key: a push's header frame must carry a job token for that job and this
shard, a pull a job token for this shard (or the leader's MAC), and every control request the
leader's MAC. Each stream is checked once, on its header, never per data frame. A job that the
leader folded or dropped (or whose pending push a ``reset_window(drop_pending)`` discarded) is
*closed*: its token can neither push nor pull again, so a replayed token cannot overwrite or
re-add an update. Every refusal is logged and leaves the follower's state as it was. Without a
key (in-process tests) the data path is open, and says so in the log.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.ps.access import FollowerAccess
from fl_geo.ps.auth import AuthError, DataPathAuth
from fl_geo.ps.follower import WIRE_DTYPES, FollowerError, FollowerShard, PublicPull, PushBuffer
from fl_geo.ps.frames import (
    CONTROL_OPS,
    DEFAULT_CHUNK_BYTES,
    FOLLOWER_SERVICE,
    INCARNATION,
    QUEUE_FRAMES,
    RequestError,
    bad_request,
    check_keys,
    decode_frame,
    elems_per_frame,
    int_field,
    json_frame,
    number_field,
    parse_json,
    put_or_stop,
    str_field,
    tensor_bytes,
    wire_field,
)
from fl_geo.ps.payload_frames import payload_layout, payloads_frames, read_payload

__all__ = ["FollowerService"]

T = TypeVar("T")
log = logging.getLogger("fl_geo")


# ---- follower service ---------------------------------------------------------------------------

@dataclass
class _PushState:
    """What the handler and consumer threads of one push share."""

    error: RequestError | None = None
    received: int = 0


@dataclass
class _ControlCall:
    """One control request id: running (``done`` unset) or answered (reply or error kept)."""

    done: threading.Event = field(default_factory=threading.Event)
    reply: bytes | None = None
    error: RequestError | None = None


class FollowerService:
    """The gRPC face of one `FollowerShard` (service ``flgeo.Follower``).

    ``lock`` serialises every FollowerShard call: the class is not thread-safe, and the calls
    are short (one chunk copy, one chunk read, or a leader operation), so one lock costs little
    next to moving the bytes and keeps the reasoning simple. Measured: a push of 4 MiB frames
    spends well under 1 ms per frame inside the lock.
    """

    def __init__(self, follower: FollowerShard, store: CheckpointStore | None = None, *,
                 incarnation: str = INCARNATION, queue_frames: int = QUEUE_FRAMES,
                 remember: int = 1024, auth: DataPathAuth | None = None) -> None:
        self.follower = follower
        self.access = FollowerAccess(auth, follower.index)  # credentials and closed jobs
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
            return self._push_stream(iter(request_iterator), context.peer())
        except RequestError as exc:
            context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from None  # abort raises

    def _push_stream(self, frames: Iterator[bytes], peer: str = "unknown peer") -> bytes:
        f = self.follower
        first = next(frames, None)
        if first is None:
            raise bad_request("empty push stream (no header frame)")
        header = parse_json(first, "push header")
        check_keys(header, "push header", ("job", "shard", "dtype", "numel"), ("meta", "token", "payload"))
        job = str_field(header, "job", "push header")
        shard = int_field(header, "shard", "push header")
        claims = self.access.check_token(header.get("token"), job, f"push of job {job!r}", peer)
        wire = wire_field(header["dtype"], "push header")
        numel = int_field(header, "numel", "push header")
        meta = header.get("meta") or {}
        if not isinstance(meta, dict):
            raise bad_request(f"push header: meta must be a JSON object, got {type(meta).__name__}")
        if shard != f.index:
            raise bad_request(f"push of job {job!r} is for shard {shard}, this follower holds shard {f.index}")
        if wire != f.wire:
            raise bad_request(f"push of job {job!r} is {wire}, this follower's wire precision is {f.wire}")
        if numel != f.numel:
            raise bad_request(f"push of job {job!r} announces {numel} elements, shard {f.index} has {f.numel}")
        if "payload" in header or f.compressor is not None:
            return self._push_compressed(header, frames, job, claims, meta, peer)

        token = object()
        with self.lock:
            self.access.check_open(job, f"push of job {job!r}", peer)
            try:
                buf = f.open_push(job, meta)
            except FollowerError as exc:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            self._owners[job] = token  # a newer stream of the same job takes over from us
            self.access.opened(job, claims)
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
                    state.error = RequestError(grpc.StatusCode.CANCELLED, f"push {job} was cancelled")
            finally:
                q.put(None)
                consumer.join()
            with self.lock:
                if self._owners.get(job) is not token:
                    raise RequestError(grpc.StatusCode.ABORTED,
                                        f"push {job} was replaced by a newer push of the same job")
                if state.error is not None:
                    raise state.error
                try:
                    f.close_push(job)  # a short push is removed by close_push itself
                except FollowerError as exc:
                    raise bad_request(str(exc)) from None
                complete = True
            return json_frame({"ok": True, "job": job, "received": state.received})
        finally:
            with self.lock:
                if self._owners.get(job) is token:
                    del self._owners[job]
                    if not complete and f.pending.get(job) is buf:
                        f.drop(job)  # a broken push leaves nothing behind

    def _push_compressed(self, header: dict[str, Any], frames: Iterator[bytes], job: str, claims: Any,
                         meta: dict[str, Any], peer: str) -> bytes:
        """A ``wire.compress`` push (`fl_geo.ps.payload_frames`): at most the bytes this follower's
        own settings give for its shard are read, then the whole payload is decoded and checked
        under the lock (`FollowerShard.push_payload`): a malformed one is INVALID_ARGUMENT and
        leaves the shard, its running sum and its pending pushes as they were."""
        f = self.follower
        if f.compressor is None:
            raise bad_request(f"push of job {job!r} is a compressed payload, follower {f.index} takes {f.wire} "
                              "shards (wire.compress is off)")
        if "payload" not in header:
            raise bad_request(f"push of job {job!r} is an uncompressed shard, follower {f.index} takes "
                              f"{f.compressor.settings.describe()} payloads (wire.compress)")
        total = f.compressor.nbytes(f.numel)
        try:
            arrays = read_payload(header["payload"], frames, job, total)
        except grpc.RpcError:
            raise RequestError(grpc.StatusCode.CANCELLED, f"push {job} was cancelled") from None
        with self.lock:
            self.access.check_open(job, f"push of job {job!r}", peer)
            if job not in f.pending and len(f.pending) >= f.max_pending:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"follower {f.index} already holds {len(f.pending)} unhandled pushes")
            try:
                f.push_payload(job, arrays, meta)
            except FollowerError as exc:
                log.warning("follower %d refused the push of job %s from %s: %s", f.index, job, peer, exc)
                raise bad_request(str(exc)) from None
            self.access.opened(job, claims)
        return json_frame({"ok": True, "job": job, "received": f.numel, "payload_bytes": total})

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
                    raise bad_request(f"push {job}: {exc}") from None
                n = chunk.numel()
                if state.received + n > f.numel:
                    raise bad_request(f"push {job} carries more than the shard's {f.numel} elements "
                               f"(a frame of {n} after {state.received})")
                with self.lock:
                    if self._owners.get(job) is not token or f.pending.get(job) is not buf:
                        raise RequestError(grpc.StatusCode.ABORTED,
                                            f"push {job} was replaced or dropped while it streamed")
                    buf.write(state.received, chunk)
                state.received += n
            except RequestError as exc:
                state.error = exc
            except FollowerError as exc:
                state.error = bad_request(str(exc))
            except Exception as exc:  # noqa: BLE001 - reported to the client, keep draining
                state.error = RequestError(grpc.StatusCode.INTERNAL, f"push {job}: {exc!r}")

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
            leader = self.access.is_leader("Pull", request, context)
            req = parse_json(request, "pull request")
            check_keys(req, "pull request", ("begin", "end"),
                       ("wire", "expect_version", "chunk_bytes", "token", "public", "held", "lineage"))
            claims = None if leader else self.access.check_token(req.get("token"), None, "pull", context.peer())
            if req.get("public") is not None and req["public"] is not True:
                raise bad_request(f"pull request: public must be true when given, got {req['public']!r}")
            if req.get("public"):  # wire.compress_down: a site asks for x̂_s, not θ_s
                if f.public is None:
                    raise bad_request(f"pull request: follower {f.index} keeps no public model (the run's "
                                      "wire.compress_down is off)")
                public = self._public_request(req, claims, context)
            else:
                public = None
                if "held" in req or "lineage" in req:
                    raise bad_request("pull request: held and lineage go with public=true")
                begin, end = int_field(req, "begin", "pull request"), int_field(req, "end", "pull request")
                if not begin <= end <= f.numel:
                    raise bad_request(f"pull [{begin}, {end}) outside shard {f.index} of {f.numel} elements")
                wire = f.wire if req.get("wire") is None else wire_field(req["wire"], "pull request")
                expect = req.get("expect_version")
                if expect is not None:
                    expect = int_field(req, "expect_version", "pull request")
                dtype = WIRE_DTYPES[wire]
                chunk_bytes = req.get("chunk_bytes") or DEFAULT_CHUNK_BYTES
                try:
                    step = elems_per_frame(chunk_bytes, dtype.itemsize)
                except ValueError as exc:
                    raise bad_request(f"pull request: {exc}") from None
                with self.lock:
                    version = f.version
                    if claims is not None:
                        self.access.check_pull_scope(claims, version, context.peer())
                if expect is not None and expect != version:
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"follower {f.index} is at version {version}, the pull expects {expect}")
        except RequestError as exc:
            context.abort(exc.code, exc.message)
            return
        if public is not None:
            yield from public
            return

        q: queue.Queue[bytes | RequestError | None] = queue.Queue(self.queue_frames)
        stop = threading.Event()

        def produce() -> None:
            try:
                for b in range(begin, end, step):
                    e = min(end, b + step)
                    with self.lock:
                        if f.version != version:
                            put_or_stop(q, RequestError(grpc.StatusCode.ABORTED,
                                                  f"follower {f.index} stepped from version {version} to "
                                                  f"{f.version} during the pull; retry"), stop)
                            return
                        chunk = f.read(b, e, wire)
                    frame = tensor_bytes(chunk)  # serialised here, outside the lock
                    if not put_or_stop(q, frame, stop):
                        return
                put_or_stop(q, None, stop)
            except Exception as exc:  # noqa: BLE001 - reported to the client, never swallowed
                put_or_stop(q, RequestError(grpc.StatusCode.INTERNAL, f"pull failed: {exc!r}"), stop)

        producer = threading.Thread(target=produce, name="pull", daemon=True)
        producer.start()
        try:
            yield json_frame({"version": version, "numel": end - begin, "dtype": wire})
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, RequestError):
                    context.abort(item.code, item.message)
                yield item
        finally:
            stop.set()  # the client may have gone: release the producer
            producer.join()

    def _public_request(self, req: dict[str, Any], claims: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A site's pull of x̂_s (``wire.compress_down``, ``public: true``): the request must cover
        the whole shard and may name the version and lineage the site holds (``held``, ``lineage``). Checked and
        answered from one snapshot taken under the lock (`FollowerShard.read_public`), so a step
        during the stream cannot tear it; returns the frames: a header ``{version, numel, dtype,
        lineage, public}``, ``public`` being ``full`` (x̂_s follows in ``dtype``), ``delta``
        (``from`` and ``deltas``, each delta's payload layout; their bytes follow back to back)
        or ``same`` (nothing follows)."""
        f = self.follower
        begin, end = int_field(req, "begin", "pull request"), int_field(req, "end", "pull request")
        if (begin, end) != (0, f.numel):
            raise bad_request(f"pull request: a public-model pull covers the whole shard [0, {f.numel}), "
                              f"not [{begin}, {end})")
        if req.get("wire") is not None and wire_field(req["wire"], "pull request") != f.wire_down:
            raise bad_request(f"pull request: the public model travels at wire.down {f.wire_down}, not {req['wire']}")
        held = req.get("held")
        if held is not None:
            held = int_field(req, "held", "pull request")
        lineage = str_field(req, "lineage", "pull request") if req.get("lineage") is not None else None
        chunk_bytes = req.get("chunk_bytes") or DEFAULT_CHUNK_BYTES
        try:
            step = elems_per_frame(chunk_bytes, WIRE_DTYPES[f.wire_down].itemsize)
        except ValueError as exc:
            raise bad_request(f"pull request: {exc}") from None
        with self.lock:
            snap = f.read_public(held, lineage)
            if claims is not None:
                self.access.check_pull_scope(claims, snap.version, context.peer())
        if req.get("expect_version") is not None and int_field(req, "expect_version", "pull request") != snap.version:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"follower {f.index} is at version {snap.version}, the pull expects {req['expect_version']}")
        header = {"version": snap.version, "numel": f.numel, "dtype": snap.precision, "lineage": snap.lineage}
        return self._public_frames(snap, header, step, chunk_bytes)

    @staticmethod
    def _public_frames(snap: PublicPull, header: dict[str, Any], step: int, chunk_bytes: int) -> Iterator[bytes]:
        if snap.full is not None:
            yield json_frame({**header, "public": "full"})
            dtype = WIRE_DTYPES[snap.precision]
            for b in range(0, snap.full.numel(), step):
                yield tensor_bytes(snap.full[b:b + step].to(dtype).contiguous())
        elif snap.deltas:
            yield json_frame({**header, "public": "delta", "from": snap.held_from,
                              "deltas": [payload_layout(d.payload) for d in snap.deltas]})
            yield from payloads_frames([d.payload for d in snap.deltas], chunk_bytes)
        else:
            yield json_frame({**header, "public": "same", "from": snap.version})

    # -- Control -------------------------------------------------------------------------------
    def _control(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            if not self.access.is_leader("Control", request, context):
                raise self.access.refuse(AuthError("control request without a leader credential", forged=True),
                                         "control request", context.peer())
            req = parse_json(request, "control request")
            check_keys(req, "control request", ("op",), ("args", "id", "incarnation"))
            op, args, rid = req["op"], req.get("args") or {}, req.get("id")
            if op not in CONTROL_OPS:
                raise bad_request(f"unknown control op {op!r}; valid: {', '.join(CONTROL_OPS)}")
            if not isinstance(args, dict):
                raise bad_request(f"control {op}: args must be a JSON object")
            if rid is not None and (not isinstance(rid, str) or not rid):
                raise bad_request("control request: id must be a non-empty string")
            expected = req.get("incarnation")
            if expected is not None and expected != self.incarnation and op not in ("health", "version"):
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"follower {self.follower.index} restarted (incarnation {self.incarnation}, the leader "
                    f"expects {expected}): its running sum and pending pushes are gone")
            return self._once(rid, lambda: self._execute(op, args))
        except RequestError as exc:
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
                # Forget the oldest *answered* ids beyond `remember`; a running call is kept (its
                # retries wait on it) but no longer stops the trimming, so one call stuck behind
                # a slow peer cannot make the cache grow without bound: it holds at most
                # `remember` ids, more only while more calls than that are in flight at once
                # (bounded by the gRPC server's worker threads).
                excess = len(self._calls) - self._remember
                if excess > 0:
                    for old_id in [i for i, c in self._calls.items() if c.done.is_set()][:excess]:
                        del self._calls[old_id]
        if not owner:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.reply  # type: ignore[return-value]
        try:
            call.reply = fn()
            return call.reply
        except RequestError as exc:
            call.error = exc
            raise
        except Exception as exc:
            call.error = RequestError(grpc.StatusCode.INTERNAL, f"{exc!r}")
            raise
        finally:
            call.done.set()

    def _execute(self, op: str, args: dict[str, Any]) -> bytes:
        f = self.follower
        what = f"control {op}"
        try:
            if op in ("health", "version", "theta_sq_sums"):
                check_keys(args, what, ())
                if op == "health":
                    out = self.health()
                elif op == "version":
                    out = {"version": self._locked(lambda: f.version)}
                else:
                    with self.lock:
                        out = {"sq_sums": f.theta_sq_sums(), "version": f.version}
            elif op in ("has", "norms", "drop"):
                check_keys(args, what, ("job",))
                job = str_field(args, "job", what)
                if op == "has":
                    out = {"has": self._locked(lambda: f.has(job))}
                elif op == "norms":
                    with self.lock:
                        out = {"sq_sums": f.norms(job), "version": f.version}
                else:
                    with self.lock:
                        f.drop(job)
                        self.access.close([job])
                    out = {"ok": True}
            elif op == "fold":
                check_keys(args, what, ("job", "weight"), ("rescale",))
                job, weight = str_field(args, "job", what), number_field(args, "weight", what)
                rescale = number_field(args, "rescale", what) if "rescale" in args else 1.0
                with self.lock:
                    f.fold(job, weight, rescale)
                    self.access.close([job])
                out = {"ok": True}
            elif op == "mean_sq_sums":
                check_keys(args, what, ("total_weight",))
                total = number_field(args, "total_weight", what)
                out = {"sq_sums": self._locked(lambda: f.mean_sq_sums(total))}
            elif op == "step":
                check_keys(args, what, ("clip_factor",), ("lr",))
                clip = number_field(args, "clip_factor", what, minimum=0.0)
                lr = None if args.get("lr") is None else number_field(args, "lr", what, minimum=0.0)
                out = {"version": self._step(clip, lr)}
            else:  # reset_window
                check_keys(args, what, (), ("drop_pending",))
                drop = args.get("drop_pending", False)
                if not isinstance(drop, bool):
                    raise bad_request(f"{what}: drop_pending must be a bool, got {drop!r}")
                with self.lock:
                    dropped = list(f.pending) if drop else []
                    f.reset_window(drop_pending=drop)
                    self.access.close(dropped)
                out = {"ok": True}
        except FollowerError as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return json_frame(out)

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
                    raise RequestError(grpc.StatusCode.INTERNAL,
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
