"""The ``ps`` section: the sharded parameter server's followers, data path and its security.

The leader (`fl_geo.strategies.sharded`), the followers and supervisor of this package and the
clients' transfers read these values. Their ranges are checked here; the rules that tie the
followers to strategy dips, the penalty's granularity, the outer optimizer and the run's
checkpoint cadence read other sections and are checked in `fl_geo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require
from fl_geo.hosts import is_loopback


@dataclass
class PsSection:
    """Sharded parameter server (Di-PS §4.1; docs/sharded_ps.md): followers own contiguous layers.

    followers = 0 keeps the whole model in the ServerApp (the default). F >= 1 splits θ, the fp32
    outer state and the running sum over F followers; the ServerApp stays the leader (grace window,
    membership, versions, tokens, the penalty decision). Strategy dips only.
    """

    followers: int = 0
    # local: the followers live in the ServerApp's process and clients' updates come in Flower
    # replies (the single-server case, and the virtual-clock tests); grpc: follower processes the
    # leader starts, and clients push/pull shards on the gRPC data path (fl_geo.ps) while
    # Flower messages carry only control.
    transport: str = "local"
    norm: str = "global"  # global: ||update||_2 (F-independent) | sum_of_shards: Di-PS's sum of shard norms
    workdir: str = ""  # follower plan, checkpoints, logs ("" = <run dir>/ps)
    checkpoint_keep: int = 3  # follower checkpoints kept (one after every outer step)
    heartbeat_s: float = 1.0  # followers' heartbeat period; dead after 3 missed beats
    chunk_mib: int = 4  # data-path frame size
    retry_s: float = 120.0  # how long clients and the leader retry a transfer to a follower
    max_pending: int = 64  # unhandled pushes a follower holds before it refuses more
    # Address the follower processes bind and clients reach them at (grpc).
    host: str = "127.0.0.1"
    # TLS on the data path: a directory with ca.crt, server.crt, server.key (`fl-geo deploy certs`
    # makes them; the certificate must name ps.host). Clients get the CA certificate with each job.
    # Without it an address other than loopback needs allow_insecure_remote=true, said out loud.
    tls_certs_dir: str = ""
    allow_insecure_remote: bool = False
    # Authentication of the data path (grpc; fl_geo.ps.auth): the leader/follower shared key.
    # "" = a fresh random key per run, handed to the followers the leader starts. A path: a file
    # of hex (mode 0600), the same one followers started separately read with --key-file.
    # Clients never get the key, only a per-job token that expires token_ttl_s after dispatch.
    key_file: str = ""
    token_ttl_s: float = 86400.0

    def check(self) -> None:
        """Raise `ConfigError` for a follower, transport or data-path setting out of its range."""
        require(self.followers >= 0, f"ps.followers must be >= 0, got {self.followers}")
        require(self.transport in ("local", "grpc"), f"ps.transport must be local or grpc, got '{self.transport}'")
        require(self.norm in ("global", "sum_of_shards"), f"ps.norm must be global or sum_of_shards, got '{self.norm}'")
        require(self.checkpoint_keep >= 1 and self.heartbeat_s > 0 and self.chunk_mib >= 1 and self.retry_s >= 0
                and self.max_pending >= 1,
                "ps: checkpoint_keep >= 1, heartbeat_s > 0, chunk_mib >= 1, retry_s >= 0, max_pending >= 1")
        require(self.token_ttl_s > 0, f"ps.token_ttl_s must be > 0, got {self.token_ttl_s}")
        if self.followers:
            require(self.transport != "grpc" or is_loopback(self.host) or self.tls_certs_dir
                    or self.allow_insecure_remote,
                    f"ps.host={self.host}: give ps.tls_certs_dir (ca.crt, server.crt, server.key) to serve model "
                    "shards over TLS, or set ps.allow_insecure_remote=true for plaintext inside a trusted network")
