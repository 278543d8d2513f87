"""A datacenter client's side of the sharded parameter server's data path (Di-PS dual workflow).

With ``ps.transport=grpc`` a train message carries control only: the job id, the followers'
addresses, the shard bounds and the order to push in. The client pulls each parameter shard from
its follower (in parallel: the followers are separate links/servers), trains, and pushes each
update shard in the wire precision (in the leader's order). Transfers retry while a follower is
being restarted (`fl_geo.ps.client.FollowerClient`), so inner training never depends on a
follower being up at the moment it finishes.

Every pull and push carries the job's token (``ps_token``, minted by the leader: this job, these
shards, this model version, an expiry; `fl_geo.ps.auth`). The client holds no other credential.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fl_geo.ps.follower import WIRE_DTYPES

__all__ = ["has_followers", "pull_model", "push_update"]

MAX_PULL_ROUNDS = 8


def has_followers(cfg: Any) -> bool:
    """True when this job's model comes from, and its update goes to, follower PSs."""
    return "ps_addresses" in cfg


def _layout(cfg: Any) -> tuple[list[str], list[tuple[int, int]]]:
    addresses = [str(a) for a in json.loads(str(cfg["ps_addresses"]))]
    shards = [(int(b), int(e)) for b, e in json.loads(str(cfg["ps_shards"]))]
    if len(addresses) != len(shards) or not shards:
        raise ValueError(f"job config names {len(addresses)} followers for {len(shards)} shards")
    return addresses, shards


def _client(address: str, cfg: Any) -> Any:
    from fl_geo.ps.client import FollowerClient

    ca = str(cfg.get("ps_tls_ca", ""))
    return FollowerClient(address, retry_s=float(cfg.get("ps_retry_s", 120.0)), root_certificates=ca.encode() if ca else None)


def _token(cfg: Any) -> str | None:
    """The job's data path token (None from a leader that does not authenticate)."""
    token = cfg.get("ps_token")
    return str(token) if token else None


def pull_model(cfg: Any, out: torch.Tensor) -> int:
    """θ from every follower into ``out`` (fp32, whole model); returns the model version.

    Shards are pulled in parallel. Followers step together on the leader's word, so a pull that
    straddles a step sees two versions: the older shards are pulled again until all agree."""
    addresses, shards = _layout(cfg)
    if shards[-1][1] != out.numel():
        raise ValueError(f"shards cover {shards[-1][1]} elements, the model has {out.numel()}")
    wire = str(cfg["wire_down"])
    versions = [-1] * len(shards)

    def pull(i: int) -> None:
        begin, end = shards[i]
        with _client(addresses[i], cfg) as client:
            version, theta = client.pull(0, end - begin, wire=wire, token=_token(cfg))
        out[begin:end].copy_(theta)
        versions[i] = int(version)

    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        todo = list(range(len(shards)))
        for _ in range(MAX_PULL_ROUNDS):
            list(pool.map(pull, todo))
            newest = max(versions)
            todo = [i for i, v in enumerate(versions) if v != newest]
            if not todo:
                return newest
    raise RuntimeError(f"followers kept stepping while this client pulled (versions {versions})")


def push_update(cfg: Any, flat: torch.Tensor) -> int:
    """Send Δ (or θ_i) shard by shard in the leader's order; returns the bytes pushed."""
    addresses, shards = _layout(cfg)
    dtype = WIRE_DTYPES[str(cfg["wire_up"])]
    order = [int(i) for i in json.loads(str(cfg.get("ps_push_order", json.dumps(list(range(len(shards)))))))]
    if sorted(order) != list(range(len(shards))):
        raise ValueError(f"push order {order} is not a permutation of the {len(shards)} shards")
    job, chunk = str(cfg["ps_job"]), int(cfg.get("ps_chunk_bytes", 4 << 20))
    sent = 0
    for i in order:
        begin, end = shards[i]
        piece = flat[begin:end].to(dtype)  # one shard in wire precision at a time
        with _client(addresses[i], cfg) as client:
            client.push(job, i, piece, chunk_bytes=chunk, token=_token(cfg))
        sent += piece.numel() * piece.element_size()
    return sent
