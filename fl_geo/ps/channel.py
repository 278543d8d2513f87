"""gRPC channels and servers of the data path: message limits, keepalive and TLS.

Both ends raise gRPC's per-message limit to `MAX_MESSAGE_BYTES` (frames are far smaller) and use
the same keepalive settings; `TlsFiles` names the CA, certificate and key a TLS data path uses
(the deployment's certificates), so a client and a follower cannot disagree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from fl_geo.ps.frames import MAX_MESSAGE_BYTES

__all__ = ["TlsFiles"]


def channel_options() -> list[tuple[str, int]]:
    """Large messages, and quick reconnects: gRPC's default reconnect backoff (1 s growing to
    120 s) would keep a channel refusing calls long after a restarted follower is back."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def server_options() -> list[tuple[str, int]]:
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


def open_channel(address: str, root_certificates: bytes | None) -> grpc.Channel:
    """A TLS channel when a CA is given, else plaintext (loopback or an explicit opt-in)."""
    if root_certificates:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root_certificates),
                                   options=channel_options())
    return grpc.insecure_channel(address, options=channel_options())


def bind_server(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
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
