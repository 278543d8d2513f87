"""Local IPC between a HALoS bridge ClientApp and its co-located regional ServerApp (the LPS).

In the Flower-native two-tier layout (docs/flower.md "Two tiers (HALoS) on Flower", docs/deploy.md "HALoS across
regions") a region's bridge SuperNode sits on the *global* SuperLink while the local parameter
server is a long-running ServerApp on the *regional* SuperLink. One process cannot be both, and
ClientApp processes live for one message, so the two meet over a Unix-domain socket that the
regional ServerApp hosts in a background thread (`fl_geo.halos.lps_service.LpsService`).

One connection = one exchange: the bridge sends the global model θ_g (absent on the first
exchange) and a ``stop`` flag; the LPS queues θ_g for its merge and answers with its next update
U_k once it has one (or an acknowledgement for ``stop``, or an error frame that names the cause).

Frame: ``b"FLGH"`` | u32 header length | JSON header | array payloads back to back. The header
lists the arrays (key, dtype, shape, stype, nbytes) of a Flower ``ArrayRecord`` built by
`fl_geo.runtime.wire.encode`, so the payload bytes are carried through untouched and the receiver
validates them with the same codec as any Flower message (keys, shapes, precision, finiteness).
This module imports no torch: the bridge ClientApp starts a fresh process per message and a
torch import would add ~2 s to every global exchange.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from flwr.app import Array, ArrayRecord

__all__ = [
    "IpcError",
    "MAGIC",
    "exchange",
    "payload_limit",
    "recv_frame",
    "send_frame",
    "unix_path",
]

MAGIC = b"FLGH"
_PREFIX = struct.Struct("!4sI")
MAX_HEADER_BYTES = 16 * 1024 * 1024  # JSON header (one entry per parameter tensor)
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024**3  # refuse absurd sizes before allocating
# Per array, what a payload may hold besides its elements: the .npy header (about 128 bytes;
# `fl_geo.runtime.wire.MAX_NPY_HEADER_BYTES` is the most the decoder accepts).
NPY_HEADER_ALLOWANCE = 4096


def payload_limit(numel: int, arrays: int) -> int:
    """The most payload bytes a frame carrying one model of ``numel`` elements in ``arrays``
    arrays can need: every element at fp32 (the widest wire precision) plus an ``.npy`` header
    allowance per array. The LPS service refuses larger frames before reading them, so a
    malformed or hostile frame costs at most one model's worth of memory, not what it claims."""
    return 4 * int(numel) + NPY_HEADER_ALLOWANCE * int(arrays)


class IpcError(RuntimeError):
    """The LPS could not be reached, timed out, or sent something malformed (message says which)."""


def unix_path(address: str) -> str:
    """The filesystem path of a ``unix:///abs/path.sock`` address (the only scheme supported:
    the bridge and the LPS run on one host, and a socket file can be protected by permissions)."""
    if not isinstance(address, str) or not address.startswith("unix://"):
        raise IpcError(f"LPS address {address!r} must look like unix:///path/to/region.sock")
    path = address[len("unix://"):]
    if not path.startswith("/"):
        raise IpcError(f"LPS address {address!r} needs an absolute path (unix:///...)")
    if len(path.encode()) > 100:  # sun_path is 108 bytes on Linux, less elsewhere
        raise IpcError(f"LPS socket path too long for a Unix socket ({len(path)} chars): {path}")
    return path


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``. With ``deadline`` (a `time.monotonic` value) the whole read
    must end by then: a socket timeout bounds each ``recv`` only, so a peer that trickles a
    byte just before each timeout would otherwise hold the reader for ever."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not complete in time ({got} of {n} bytes read)")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"frame not complete in time ({got} of {n} bytes read)") from None
        if k == 0:
            raise IpcError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, header: dict[str, Any], record: ArrayRecord | None = None) -> None:
    """Send ``header`` (JSON-able) and the arrays of ``record`` (their bytes as they are)."""
    arrays: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    if record is not None:
        for key, array in record.items():
            data = bytes(array.data)
            arrays.append({"key": key, "dtype": array.dtype, "shape": list(array.shape),
                           "stype": array.stype, "nbytes": len(data)})
            blobs.append(data)
    head = json.dumps({**header, "arrays": arrays if record is not None else None}).encode()
    sock.sendall(_PREFIX.pack(MAGIC, len(head)) + head)
    for blob in blobs:
        sock.sendall(blob)


def _check_entry(i: int, entry: Any) -> tuple[str, str, tuple[int, ...], str, int]:
    ok = (isinstance(entry, dict) and isinstance(entry.get("key"), str) and isinstance(entry.get("dtype"), str)
          and isinstance(entry.get("stype"), str) and isinstance(entry.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("nbytes"), int) and entry["nbytes"] >= 0)
    if not ok:
        raise IpcError(f"malformed array entry {i} in frame header: {str(entry)[:200]}")
    return entry["key"], entry["dtype"], tuple(entry["shape"]), entry["stype"], entry["nbytes"]


def recv_frame(sock: socket.socket, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
               timeout_s: float | None = None) -> tuple[dict[str, Any], ArrayRecord | None]:
    """Read one frame: its header and the ``ArrayRecord`` it carries (None when it has none).

    Only the framing is checked here (magic, sizes, entry types); the arrays' content is checked
    by the receiver against its model spec and precision (`fl_geo.runtime.wire.decode`). Sizes
    are checked before anything of that size is allocated or read: the header against
    `MAX_HEADER_BYTES`, the arrays' declared total against ``max_payload_bytes``.
    ``timeout_s``: the whole frame must arrive within it (`TimeoutError` otherwise), however
    slowly the peer trickles bytes; None leaves only the socket's own per-call timeout.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    magic, size = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, deadline))
    if magic != MAGIC:
        raise IpcError(f"not an fl-geo HALoS IPC frame (magic {magic!r})")
    if size > MAX_HEADER_BYTES:
        raise IpcError(f"frame header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(_recv_exact(sock, size, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IpcError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise IpcError("frame header must be a JSON object")
    entries = header.pop("arrays", None)
    if entries is None:
        return header, None
    if not isinstance(entries, list):
        raise IpcError("frame header 'arrays' must be a list")
    parsed = [_check_entry(i, e) for i, e in enumerate(entries)]
    total = sum(p[4] for p in parsed)
    if total > max_payload_bytes:
        raise IpcError(f"frame payload of {total} bytes exceeds the limit of {max_payload_bytes}")
    record = ArrayRecord()
    for key, dtype, shape, stype, nbytes in parsed:
        if key in record:
            raise IpcError(f"array {key!r} appears twice in the frame")
        record[key] = Array(dtype=dtype, shape=shape, stype=stype, data=_recv_exact(sock, nbytes, deadline))
    return header, record


def exchange(address: str, header: dict[str, Any], record: ArrayRecord | None, *,
             connect_timeout_s: float = 60.0, reply_timeout_s: float = 600.0,
             max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[dict[str, Any], ArrayRecord | None]:
    """One request/reply with the LPS at ``address`` (client side, used by the bridge).

    Connecting is retried for ``connect_timeout_s``: the regional ServerApp may still be starting
    when the first global message arrives. The reply may take long (the LPS answers once K more
    worker updates were applied), hence the separate ``reply_timeout_s``: it bounds the whole
    reply, however slowly it arrives. An ``error`` frame from the LPS is raised as `IpcError`
    with its reason.
    """
    path = unix_path(address)
    deadline = time.monotonic() + connect_timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(1.0, min(10.0, connect_timeout_s)))
            sock.connect(path)
            break
        except OSError as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise IpcError(f"LPS at {address} not reachable within {connect_timeout_s:.0f} s ({exc}); "
                               "is the regional ServerApp of this region running with this lps-address?") from None
            time.sleep(0.25)
    try:
        sock.settimeout(reply_timeout_s)
        send_frame(sock, header, record)
        try:
            reply, out = recv_frame(sock, max_payload_bytes, timeout_s=reply_timeout_s)
        except TimeoutError:
            raise IpcError(f"LPS at {address} sent no reply within {reply_timeout_s:.0f} s") from None
    except OSError as exc:
        raise IpcError(f"exchange with the LPS at {address} failed: {exc}") from None
    finally:
        sock.close()
    if reply.get("op") == "error":
        raise IpcError(f"LPS at {address} refused the exchange: {reply.get('error', '?')}")
    if reply.get("op") != "result":
        raise IpcError(f"unexpected reply op {reply.get('op')!r} from the LPS at {address}")
    return reply, out
