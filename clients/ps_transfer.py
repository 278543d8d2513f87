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
from flwr.app import RecordDict

from fl_geo.ps.client import MAX_PULL_ROUNDS
from fl_geo.ps.follower import WIRE_DTYPES
from fl_geo.ps.frames import DEFAULT_CHUNK_BYTES
from fl_geo.runtime.protocol import JobRequest, TrainRequest

__all__ = ["has_followers", "pull_model", "push_update"]



def has_followers(req: JobRequest) -> bool:
    """True when this job's model comes from, and its update goes to, follower PSs."""
    return getattr(req, "ps_addresses", None) is not None


def _layout(req: TrainRequest) -> tuple[list[str], list[tuple[int, int]]]:
    if req.ps_addresses is None or req.ps_shards is None:
        raise ValueError("the job names follower PSs without their shards (ps_addresses and ps_shards go together)")
    addresses = [str(a) for a in json.loads(req.ps_addresses)]
    shards = [(int(b), int(e)) for b, e in json.loads(req.ps_shards)]
    if len(addresses) != len(shards) or not shards:
        raise ValueError(f"job config names {len(addresses)} followers for {len(shards)} shards")
    return addresses, shards


def _client(address: str, req: TrainRequest) -> Any:
    """A follower client; without ``ps_retry_s`` it retries as long as `FollowerClient` does."""
    from fl_geo.ps.client import FollowerClient

    ca = req.ps_tls_ca or ""
    retry = {} if req.ps_retry_s is None else {"retry_s": req.ps_retry_s}
    return FollowerClient(address, root_certificates=ca.encode() if ca else None, **retry)


def _token(req: TrainRequest) -> str | None:
    """The job's data path token (None from a leader that does not authenticate)."""
    return req.ps_token or None


def pull_model(req: TrainRequest, out: torch.Tensor, state: RecordDict | None = None) -> tuple[int, int]:
    """θ from every follower into ``out`` (fp32, whole model); returns the model version and the
    payload bytes received (every shard's pull in the wire precision, re-pulls included). With
    ``wire_compress_down`` the followers' public model x̂ instead, rebuilt from the copy kept in
    ``state`` (`fl_geo.clients.ps_downlink`).

    Shards are pulled in parallel. Followers step together on the leader's word, so a pull that
    straddles a step sees two versions: the older shards are pulled again until all agree."""
    addresses, shards = _layout(req)
    if shards[-1][1] != out.numel():
        raise ValueError(f"shards cover {shards[-1][1]} elements, the model has {out.numel()}")
    if req.wire_compress_down is not None:
        from fl_geo.clients.ps_downlink import pull_public_model

        return pull_public_model(req, out, state if state is not None else RecordDict(), addresses, shards,
                                 lambda address: _client(address, req), _token(req))
    wire = req.wire_down
    versions = [-1] * len(shards)
    received = [0] * len(shards)

    def pull(i: int) -> None:
        begin, end = shards[i]
        with _client(addresses[i], req) as client:
            version, theta = client.pull(0, end - begin, wire=wire, token=_token(req))
        out[begin:end].copy_(theta)
        versions[i] = int(version)
        received[i] += (end - begin) * WIRE_DTYPES[wire].itemsize

    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        todo = list(range(len(shards)))
        for _ in range(MAX_PULL_ROUNDS):
            list(pool.map(pull, todo))
            newest = max(versions)
            todo = [i for i, v in enumerate(versions) if v != newest]
            if not todo:
                return newest, sum(received)
    raise RuntimeError(f"followers kept stepping while this client pulled (versions {versions})")


def push_update(req: TrainRequest, flat: torch.Tensor, state: RecordDict | None = None) -> int:
    """Send Δ (or θ_i) shard by shard in the leader's order; returns the bytes pushed. With
    ``wire_compress`` each shard goes as its own compressed payload (`_push_compressed`)."""
    addresses, shards = _layout(req)
    if req.wire_compress is not None:
        return _push_compressed(req, flat, state if state is not None else RecordDict())
    dtype = WIRE_DTYPES[req.wire_up]
    order = _order(req, len(shards))
    job = req.ps_job
    chunk = _chunk_bytes(req)
    sent = 0
    for i in order:
        begin, end = shards[i]
        piece = flat[begin:end].to(dtype)  # one shard in wire precision at a time
        with _client(addresses[i], req) as client:
            client.push(job, i, piece, chunk_bytes=chunk, token=_token(req))
        sent += piece.numel() * piece.element_size()
    return sent


def _order(req: TrainRequest, num_shards: int) -> list[int]:
    order = list(range(num_shards)) if req.ps_push_order is None else [int(i) for i in json.loads(req.ps_push_order)]
    if sorted(order) != list(range(num_shards)):
        raise ValueError(f"push order {order} is not a permutation of the {num_shards} shards")
    if req.ps_job is None:
        raise ValueError("the job pushes to follower PSs but names no ps_job")
    return order


def _chunk_bytes(req: TrainRequest) -> int:
    return DEFAULT_CHUNK_BYTES if req.ps_chunk_bytes is None else req.ps_chunk_bytes


def _push_compressed(req: TrainRequest, flat: torch.Tensor, state: RecordDict) -> int:
    """``wire.compress`` on the data path: Δ + e compressed shard by shard (chunks restart at every
    shard, so each follower decodes its own shard alone; `compress_shards`), each payload pushed to
    its follower in the leader's order; returns the payloads' bytes.

    The error-feedback residual is the site's one model-sized fp32 array under `EF_RESIDUAL_KEY`
    (the same record, persisted and rewound like the unsharded uplink's: `fl_geo.clients.uplink`),
    sliced by shard. It is replaced only once every shard was pushed: a push a follower refuses
    (or that fails for good) fails the job, whose update the leader then drops, and leaves the
    residual as it was. A non-finite Δ is refused before anything is sent."""
    from fl_geo.clients.uplink import kept_residual, store_residual
    from fl_geo.core.compress import Compressor, compress_shards
    from fl_geo.runtime.wire_settings import uplink_from_json

    if req.send != "pseudo_grad":
        raise ValueError(f"wire.compress sends pseudo-gradients; this job sends {req.send}")
    _, shards = _layout(req)
    settings = uplink_from_json(req.wire_compress)
    assert settings is not None
    compressor = Compressor(settings)
    payloads, residual = compress_shards(compressor, flat, shards, kept_residual(state, settings, flat))
    addresses, chunk, job = json.loads(req.ps_addresses or "[]"), _chunk_bytes(req), req.ps_job
    sent = 0
    for i in _order(req, len(shards)):
        begin, end = shards[i]
        with _client(addresses[i], req) as client:
            client.push_payload(str(job), i, end - begin, payloads[i], chunk_bytes=chunk, token=_token(req))
        sent += int(payloads[i].nbytes)
    store_residual(state, residual)
    return sent
