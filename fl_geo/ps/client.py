"""The client side of the data path: pushes, pulls and control requests to one follower.

Datacenter clients push update shards to, and pull parameter shards from, the followers directly
(Di-PS §4.1, "Dual-workflow Mechanism"); the leader uses the same client for its control
requests. Pushes are serialised ahead of gRPC's sender (`_ReadAhead`), so framing frame k+1
overlaps with sending frame k.

Failure handling: `FollowerClient` retries UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED with
exponential backoff for up to ``retry_s``: a follower being restarted by the `FollowerSupervisor`
on the same port does not fail a client's transfer, it delays it. Pushes are re-sent whole (a
follower's ``open_push`` replaces a partial push); control requests are retried with the same id,
which the service answers from its cache.

Credentials (`fl_geo.ps.auth`): a datacenter client passes its job's token to `push` and `pull`
(it goes in the header frame / request, checked once per stream); the leader's client is built
with the shared key and signs every control request and its own pulls (gRPC metadata). A retry
re-sends the same bytes, so it carries the same credential.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from fl_geo.core.compress import Payload
from fl_geo.ps.auth import LEADER_MAC_HEADER, DataPathAuth
from fl_geo.ps.channel import open_channel
from fl_geo.ps.follower import WIRE_DTYPES
from fl_geo.ps.frames import (
    BIT_VIEWS,
    DEFAULT_CHUNK_BYTES,
    FOLLOWER_SERVICE,
    RETRYABLE,
    DataPathError,
    elems_per_frame,
    encode_frames,
    json_frame,
    put_or_stop,
    wire_name,
)
from fl_geo.ps.payload_frames import payload_frames, payload_layout, read_payloads

__all__ = ["FollowerClient"]

T = TypeVar("T")
# A site's pull of the whole model is retried while the followers step under it, at most this
# many times (clients/ps_transfer.py); the leader bounds what a site says it pulled with it.
MAX_PULL_ROUNDS = 8
log = logging.getLogger("fl_geo")


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
                if not put_or_stop(self._q, item, self._stop):
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            self._error = exc
        put_or_stop(self._q, self._END, self._stop)

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
    incarnation, and the leader voids the window and re-pins.

    ``leader_key``: the leader/follower shared key; only the leader's clients have it (control
    calls need it when the followers authenticate). Clients of a job pass its token instead."""

    def __init__(self, address: str, *, retry_s: float = 120.0, timeout_s: float = 30.0,
                 min_rate: float = 10e6, read_ahead: int = 4, incarnation: str | None = None,
                 root_certificates: bytes | None = None, leader_key: bytes | None = None) -> None:
        self.address = address
        self._auth = DataPathAuth(leader_key) if leader_key is not None else None
        self.incarnation = incarnation
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.read_ahead = read_ahead
        self._channel = open_channel(address, root_certificates)
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

    def _leader_metadata(self, method: str, request: bytes) -> list[tuple[str, str]] | None:
        """The leader MAC of one request, as call metadata (None for a client without the key)."""
        if self._auth is None:
            return None
        return [(LEADER_MAC_HEADER, self._auth.sign_leader(method, request))]

    def push(self, job: str, shard_index: int, tensor: torch.Tensor,
             chunk_bytes: int = DEFAULT_CHUNK_BYTES, meta: dict[str, Any] | None = None,
             token: str | None = None) -> dict[str, Any]:
        """Stream a whole shard (1-D, in the follower's wire dtype) as ``job``, with the job's
        ``token`` from the leader; returns the follower's reply ``{ok, job, received}`` once the
        push is complete there. A refused token is PERMISSION_DENIED/UNAUTHENTICATED: no retry."""
        flat = tensor.detach().reshape(-1).contiguous()
        dtype = wire_name(flat.dtype)
        elems_per_frame(chunk_bytes, flat.element_size())  # fail here, not in a thread
        header = json_frame({"job": job, "shard": shard_index, "dtype": dtype, "numel": flat.numel(),
                              **({"meta": meta} if meta else {}), **({"token": token} if token else {})})
        nbytes = flat.numel() * flat.element_size()

        def attempt() -> dict[str, Any]:
            frames = _ReadAhead(encode_frames(flat, chunk_bytes), self.read_ahead)
            try:
                reply = self._push(_chain(header, frames), timeout=self._timeout(nbytes))
            finally:
                frames.close()
            return json.loads(reply)

        return self._retry("push", attempt)

    def push_payload(self, job: str, shard_index: int, numel: int, payload: Payload,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, token: str | None = None) -> dict[str, Any]:
        """Stream one shard's compressed payload (``wire.compress``; `fl_geo.ps.payload_frames`)
        as ``job``; the follower decodes it with its own settings, refusing a malformed one
        (INVALID_ARGUMENT: `DataPathError` at once, no retry)."""
        header = json_frame({"job": job, "shard": shard_index, "dtype": "fp32", "numel": numel,
                             "payload": payload_layout(payload), **({"token": token} if token else {})})
        nbytes = int(payload.nbytes)

        def attempt() -> dict[str, Any]:
            return json.loads(self._push(_chain(header, payload_frames(payload, chunk_bytes)),
                                         timeout=self._timeout(nbytes)))

        return self._retry("push", attempt)

    def pull(self, begin: int, end: int, wire: str | None = None, *, expect_version: int | None = None,
             chunk_bytes: int | None = None, token: str | None = None) -> tuple[int, torch.Tensor]:
        """θ_s[begin:end] (shard-relative) in ``wire`` (default: the follower's); returns
        ``(version, tensor)``. A pull interrupted by a step or a restart starts over. A job's
        client passes its ``token``; the leader's client signs the request instead."""
        req: dict[str, Any] = {"begin": begin, "end": end}
        if token:
            req["token"] = token
        if wire is not None:
            req["wire"] = wire
        if expect_version is not None:
            req["expect_version"] = expect_version
        if chunk_bytes is not None:
            req["chunk_bytes"] = chunk_bytes
        request = json_frame(req)
        itemsize = WIRE_DTYPES[wire].itemsize if wire in WIRE_DTYPES else 4
        metadata = self._leader_metadata("Pull", request)

        def attempt() -> tuple[int, torch.Tensor]:
            stream = self._pull(request, timeout=self._timeout((end - begin) * itemsize), metadata=metadata)
            try:
                return self._read_pull(stream)
            finally:
                stream.cancel()  # a no-op once the stream has ended

        return self._retry("pull", attempt)

    def _read_pull(self, stream: Iterator[bytes]) -> tuple[int, torch.Tensor]:
        first = next(stream, None)
        if first is None:
            raise self._protocol("stream ended before the header")
        try:
            header = json.loads(first)
            version, numel, wire = int(header["version"]), int(header["numel"]), header["dtype"]
            dtype = WIRE_DTYPES[wire]
        except (ValueError, KeyError, TypeError) as exc:
            raise self._protocol(f"bad header {first[:200]!r}: {exc}") from None
        return version, self._read_tensor(stream, numel, dtype, wire)

    def _protocol(self, detail: str) -> DataPathError:
        return DataPathError("pull", self.address, f"protocol error: {detail}")

    def _read_tensor(self, stream: Iterator[bytes], numel: int, dtype: torch.dtype, wire: str) -> torch.Tensor:
        protocol = self._protocol
        out = torch.empty(numel, dtype=dtype)
        view_dtype, np_dtype = BIT_VIEWS[dtype]
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
        return out

    def pull_public(self, numel: int, held: int | None, lineage: str | None, *, wire: str, delta_nbytes: int,
                    max_deltas: int, chunk_bytes: int | None = None, token: str | None = None) -> PublicReply:
        """A site's pull of the follower's public model x̂_s (``wire.compress_down``): it names the
        version and lineage it holds; the answer is x̂_s whole (in ``wire``), the chain of deltas
        from ``held`` (each exactly ``delta_nbytes``, at most ``max_deltas``: the site's own
        counts from the run's settings), or nothing new. Anything else is a protocol error
        (`DataPathError`); what the deltas' arrays hold is the site's codec's to check."""
        req: dict[str, Any] = {"begin": 0, "end": numel, "wire": wire, "public": True}
        if held is not None and lineage:
            req.update(held=held, lineage=lineage)
        if token:
            req["token"] = token
        if chunk_bytes is not None:
            req["chunk_bytes"] = chunk_bytes
        request = json_frame(req)

        def attempt() -> PublicReply:
            stream = self._pull(request, timeout=self._timeout(numel * WIRE_DTYPES[wire].itemsize))
            try:
                return self._read_public(stream, numel, req.get("held"), req.get("lineage"), wire, delta_nbytes,
                                         max_deltas)
            finally:
                stream.cancel()

        return self._retry("pull", attempt)

    def _read_public(self, stream: Iterator[bytes], numel: int, held: int | None, held_lineage: str | None,
                     wire: str, delta_nbytes: int, max_deltas: int) -> PublicReply:
        first = next(stream, None)
        if first is None:
            raise self._protocol("stream ended before the header")
        try:
            header = json.loads(first)
            version, kind, lineage = int(header["version"]), header["public"], header["lineage"]
            ok = (int(header["numel"]) == numel and header["dtype"] == wire and isinstance(lineage, str) and lineage
                  and kind in ("full", "delta", "same") and version >= 0)
        except (ValueError, KeyError, TypeError) as exc:
            raise self._protocol(f"bad public-model header {first[:200]!r}: {exc}") from None
        if not ok:
            raise self._protocol(f"public-model header {first[:200]!r} does not answer a pull of {numel} at {wire}")
        if kind == "full":
            return PublicReply(version, lineage, kind, version, self._read_tensor(stream, numel, WIRE_DTYPES[wire], wire))
        start = header.get("from")
        if lineage != held_lineage:  # nothing new or a chain only makes sense on the copy the site holds
            raise self._protocol(f"a '{kind}' answer of lineage {lineage!r} to a site holding lineage {held_lineage!r}")
        if kind == "same":
            if start != version or held != version or next(stream, None) is not None:
                raise self._protocol(f"'same' answer at version {version} to a site holding {held}")
            return PublicReply(version, lineage, kind, version)
        layouts = header.get("deltas")
        if held is None or start != held or not isinstance(layouts, list) or version - held != len(layouts) or not layouts:
            raise self._protocol(f"a delta chain from {start} to {version} in {len(layouts or [])} payloads "
                                 f"answers a site holding {held}")
        try:
            deltas = read_payloads(layouts, stream, "public-model pull", delta_nbytes, max_deltas)
        except ValueError as exc:
            raise self._protocol(str(exc)) from None
        return PublicReply(version, lineage, kind, held, deltas=deltas)

    def control(self, op: str, **args: Any) -> dict[str, Any]:
        """One leader operation (see `CONTROL_OPS`); the id makes retries execute it once."""
        req: dict[str, Any] = {"op": op, "args": args, "id": uuid.uuid4().hex}
        if self.incarnation is not None:
            req["incarnation"] = self.incarnation
        request = json_frame(req)
        # a step writes a checkpoint before answering; a deadline is harmless anyway (the retry
        # carries the same id and waits for the first execution), it only bounds each wait
        timeout = max(self.timeout_s, 300.0) if op == "step" else self.timeout_s
        metadata = self._leader_metadata("Control", request)
        return self._retry(op, lambda: json.loads(self._control(request, timeout=timeout, metadata=metadata)))

    def health(self) -> dict[str, Any]:
        return self.control("health")


@dataclass(frozen=True)
class PublicReply:
    """A follower's answer to `FollowerClient.pull_public`: x̂_s's ``version`` and ``lineage``;
    ``kind`` ``full`` (``full``: x̂_s in the wire precision), ``delta`` (``deltas``: the payloads'
    arrays from version ``start`` on, in order) or ``same``."""

    version: int
    lineage: str
    kind: str
    start: int
    full: torch.Tensor | None = None
    deltas: list[dict[str, np.ndarray]] = field(default_factory=list)


def _chain(first: bytes, rest: Iterable[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest
