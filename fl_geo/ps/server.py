"""A follower process's server: the `FollowerService` on its own gRPC server, plus its heartbeats.

This is what ``python -m fl_geo.ps.follower_main`` runs; `fl_geo.ps.supervisor` starts, watches
and restarts those processes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.ps.auth import DataPathAuth
from fl_geo.ps.channel import TlsFiles, bind_server, open_channel, server_options
from fl_geo.ps.follower import FollowerShard
from fl_geo.ps.frames import INCARNATION, LEADER_SERVICE, json_frame
from fl_geo.ps.service import FollowerService

__all__ = ["FollowerServer"]

log = logging.getLogger("fl_geo")


# ---- follower server (process side) ---------------------------------------------------------------

class FollowerServer:
    """A `FollowerService` on its own gRPC server, plus the heartbeat thread of §4.3.

    The heartbeat thread sends ``{index, incarnation, version, pending}`` to the leader every
    ``heartbeat_s`` with a short deadline and never blocks on it: while the leader is down the
    follower keeps serving clients and keeps trying (Di-PS: components reconnect non-blockingly
    until the leader is back).

    ``auth`` (the leader/follower shared key) makes the service verify job tokens and the
    leader's MAC (`fl_geo.ps.service`); without it the data path is open (tests in one process)."""

    def __init__(self, follower: FollowerShard, store: CheckpointStore | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, leader: str | None = None,
                 heartbeat_s: float = 1.0, max_workers: int = 16,
                 incarnation: str = INCARNATION, tls: TlsFiles | None = None,
                 auth: DataPathAuth | None = None) -> None:
        self.service = FollowerService(follower, store, incarnation=incarnation, auth=auth)
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
                             options=server_options())
        server.add_generic_rpc_handlers((self.service.handler(),))
        self.port = bind_server(server, self.host, self.requested_port,
                          self.tls.server_credentials() if self.tls is not None else None)
        server.start()
        self._server = server
        if self.leader:
            self._beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
            self._beat.start()
        return self

    def _heartbeats(self) -> None:
        channel = open_channel(self.leader, self.tls.ca_pem() if self.tls is not None else None)  # type: ignore[arg-type]
        call = channel.unary_unary(f"/{LEADER_SERVICE}/Heartbeat")
        failing = False
        try:
            while not self._stop.is_set():
                h = self.service.health()
                beat = {k: h[k] for k in ("index", "incarnation", "version", "pending")}
                try:
                    call(json_frame(beat), timeout=max(0.5, self.heartbeat_s))
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
