"""The LPS side of HALoS's inter-tier IPC: `LpsService`, the regional ServerApp's Unix-socket
endpoint for its bridge (fl_geo/halos/apps.py runs it in a background thread; the frames are
fl_geo/halos/ipc.py's). One exchange per connection: the bridge hands θ_g down and takes the
region's next update U_k up; a malformed, oversized or trickling request is answered with an
error and never holds the service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import stat
import threading
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord

from fl_geo.core.state import ParamSpec
from fl_geo.halos.ipc import IpcError, payload_limit, recv_frame, send_frame, unix_path
from fl_geo.runtime.wire import PayloadError, decode_into, payload_nbytes

log = logging.getLogger("fl_geo")

__all__ = ["LpsService"]

class LpsService:
    """The regional ServerApp's Unix-socket endpoint for its bridge (one exchange per connection).

    Runs in a daemon thread and never touches the LPS: it validates what arrives (keys, shapes,
    precision ``wire.down``, finiteness) into a fresh fp32 tensor, queues it on `inbox` for the
    training loop's merge, and waits up to ``reply_timeout_s`` for the loop to put the next update
    (already encoded in ``wire.up``, or compressed with ``halos.compress``) on `outbox`. A rejected frame is answered with an error frame
    naming the cause, and the loop is not disturbed. The socket file is created with mode 0600
    (only this user's bridge can connect) and removed on `close`.

    **Resync** (``"resync": true``: a resumed global server's first θ_g, or θ_g sent again after
    this region's exchange failed): `epoch` counts them.
    Each update on `outbox` carries the epoch of the loop that made it, and the reply to a resync
    exchange (and every later one) is the first update of the new epoch: one made before the loop
    merged the resync was computed against a merge point the restarted global server never
    sent, so it is dropped here (logged), never sent up. Counting on both sides, not clearing the
    queue, is what makes this safe against the loop queueing an update while the service reads.
    """

    def __init__(self, address: str, spec: ParamSpec, precision_down: str, reply_timeout_s: float,
                 request_timeout_s: float | None = None) -> None:
        """``request_timeout_s``: how long one bridge may take to send its whole request (None: 60 s
        plus 1 s per 100 MB of the largest frame). The service serves one connection at a time,
        so this is what bounds the wait a slow or stuck bridge can impose on the next one."""
        self.address = address
        self.path = unix_path(address)
        self.spec = spec
        # the largest request frame: one model (wire.down) with a .npy header per parameter
        self.max_payload_bytes = payload_limit(spec.numel, len(spec.names))
        self.request_timeout_s = (60.0 + self.max_payload_bytes / 100e6 if request_timeout_s is None
                                  else request_timeout_s)
        self.precision_down = precision_down
        self.reply_timeout_s = reply_timeout_s
        # (θ_g or None, stop, global version, resync) for the loop; (U_k, counters, epoch) from it
        self.inbox: queue.Queue[tuple[torch.Tensor | None, bool, int, bool]] = queue.Queue()
        self.outbox: queue.Queue[tuple[ArrayRecord, dict[str, int], int]] = queue.Queue()
        self.epoch = 0  # resync exchanges received
        self.dropped = 0  # updates made before a resync, not sent
        self.dropped_bytes = 0  # their payload bytes (the loop counted them when it queued them)
        self.exchanges = 0
        self.rejected = 0
        self.last_contact = time.monotonic()
        self.counters: dict[str, int] = {}  # the loop's counters, sent with an acknowledgement
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise IpcError(f"{self.path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(self.path)
                raise IpcError(f"another LPS already listens on {self.address}")
            except OSError:
                os.unlink(self.path)  # stale socket of a previous run
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(4)
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="halos-lps-ipc", daemon=True)
        self._thread.start()
        log.info("HALoS LPS service listening on %s", self.address)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._handle(conn)
                except Exception as exc:  # a broken connection must not kill the service
                    log.warning("HALoS LPS service: exchange failed: %s", exc)

    def _error(self, conn: socket.socket, reason: str) -> None:
        self.rejected += 1
        log.warning("HALoS LPS service: %s", reason)
        send_frame(conn, {"op": "error", "error": reason})

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self.request_timeout_s)  # reading the request: the bridge sends at once
        try:
            header, record = recv_frame(conn, self.max_payload_bytes, timeout_s=self.request_timeout_s)
        except IpcError as exc:
            conn.settimeout(5.0)  # the read may have left a near-zero timeout: room for the answer
            self._error(conn, f"malformed request: {exc}")
            return
        except TimeoutError:
            conn.settimeout(5.0)
            self._error(conn, f"request not complete within {self.request_timeout_s:g} s")
            return
        if header.get("op") != "exchange":
            self._error(conn, f"unknown op {header.get('op')!r}")
            return
        stop = header.get("stop", False)
        if not isinstance(stop, bool):
            self._error(conn, f"'stop' must be a bool, got {stop!r}")
            return
        resync = header.get("resync", False)
        if not isinstance(resync, bool):
            self._error(conn, f"'resync' must be a bool, got {resync!r}")
            return
        theta: torch.Tensor | None = None
        if record is not None:
            try:
                theta = decode_into(record, self.spec, self.precision_down)
            except (PayloadError, ValueError) as exc:
                self._error(conn, f"global model rejected: {exc}")
                return
            if not bool(torch.isfinite(theta).all()):
                self._error(conn, "global model rejected: non-finite values")
                return
        elif stop or resync:
            self._error(conn, f"{'stop' if stop else 'resync'} without the global model to merge")
            return
        self.last_contact = time.monotonic()
        self.exchanges += 1
        if resync:
            self.epoch += 1
        self.inbox.put((theta, stop, int(header.get("global_version", 0)), resync))
        if stop:
            send_frame(conn, {"op": "result", **self.counters})
            return
        deadline = time.monotonic() + self.reply_timeout_s
        while True:  # wait for the loop's next update, but not past close(): the bridge must hear
            try:
                update, counters, epoch = self.outbox.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
                if epoch >= self.epoch:
                    break
                self.dropped += 1
                self.dropped_bytes += payload_nbytes(update)
                log.info("HALoS LPS service: an update made before the last resync was dropped (epoch %d < %d)",
                         epoch, self.epoch)
            except queue.Empty:
                if self._closed.is_set():
                    self._error(conn, "the regional ServerApp is shutting down (its run ended or failed)")
                    return
                if time.monotonic() >= deadline:
                    self._error(conn, f"no update within {self.reply_timeout_s:g} s (workers stalled?)")
                    return
        conn.settimeout(self.reply_timeout_s)
        send_frame(conn, {"op": "result", **counters}, update)
        self.last_contact = time.monotonic()
