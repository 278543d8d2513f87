"""The leader's side of follower heartbeats (Di-PS §4.3, "Failure Tolerance of Di-PS").

Followers report to the leader's ``flgeo.Leader`` service; the supervisor
(`fl_geo.ps.supervisor`) reads when each follower incarnation was last heard from to decide
which follower to restart.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from fl_geo.ps.channel import bind_server, server_options
from fl_geo.ps.frames import (
    LEADER_SERVICE,
    RequestError,
    check_keys,
    int_field,
    json_frame,
    parse_json,
    str_field,
)

__all__ = ["LeaderHeartbeatService"]


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
            beat = parse_json(request, "heartbeat")
            check_keys(beat, "heartbeat", ("index", "incarnation", "version", "pending"))
            index = int_field(beat, "index", "heartbeat")
            incarnation = str_field(beat, "incarnation", "heartbeat")
            int_field(beat, "version", "heartbeat")
            int_field(beat, "pending", "heartbeat")
        except RequestError as exc:
            context.abort(exc.code, exc.message)
            raise AssertionError("unreachable") from None
        with self._lock:
            self._seen[(index, incarnation)] = (time.monotonic(), beat)
        return json_frame({"ok": True})

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
                             options=server_options())
        server.add_generic_rpc_handlers((self.handler(),))
        self.port = bind_server(server, host, port, credentials)
        server.start()
        self._server = server
        return self.port

    def stop(self, grace: float = 0.5) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
