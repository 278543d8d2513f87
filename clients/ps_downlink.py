"""A site's end of the compressed downlink on the sharded parameter server's data path
(``wire.compress_down`` with ``ps.transport=grpc``; docs/compression.md).

Each follower keeps its shard of the public model x̂ and advances it once per outer step
(`fl_geo.ps.follower.FollowerShard.read_public`). The site keeps its copy of x̂ whole, in the
same ``context.state`` record as the single-server downlink (`PUBLIC_KEY`), and per shard the
version and lineage it holds (`SHARD_VERSIONS_KEY`, with the shard bounds they are for). A pull
names them; each follower answers with x̂_s whole, the deltas since, or nothing new, and the site
rebuilds x̂_s exactly as the follower did (g(x̂_s + D(P)) per delta, on its CPU in fp32).

Shards are pulled in parallel. Followers step together on the leader's word, so a pull that
straddles a step sees two versions: the older shards are pulled again, from what was just
received, until all agree. The new copy replaces the kept one only once every shard has decoded
and is finite; a payload the codec refuses (an index out of range, a NaN scale, truncated codes)
or a malformed answer fails the job and leaves the kept copy as it was, so the next pull starts
from the same versions. A kept copy for other shard bounds (another run's plan) is not used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_geo.clients.downlink import PUBLIC_KEY
from fl_geo.core.compress import Compressor, payload_from_arrays, payload_nbytes
from fl_geo.core.downlink import apply_delta, max_chain, on_grid
from fl_geo.errors import PayloadError
from fl_geo.ps.client import MAX_PULL_ROUNDS, FollowerClient
from fl_geo.ps.follower import WIRE_DTYPES
from fl_geo.runtime.protocol import TrainRequest
from fl_geo.runtime.wire_settings import uplink_from_json

__all__ = ["SHARD_VERSIONS_KEY", "pull_public_model"]

SHARD_VERSIONS_KEY = "downlink_shards"  # ConfigRecord {"shards": JSON bounds, "versions": [int], "lineages": [str]}


def _kept(state: RecordDict, shards: list[tuple[int, int]], numel: int) -> tuple[torch.Tensor | None, list, list]:
    """The kept copy of x̂ and, per shard, the version and lineage it holds (None, "" when none)."""
    none: tuple[torch.Tensor | None, list, list] = (None, [None] * len(shards), [""] * len(shards))
    rec = state.config_records.get(SHARD_VERSIONS_KEY)
    if rec is None or PUBLIC_KEY not in state.array_records or rec.get("shards") != json.dumps(shards):
        return none
    base = torch.from_numpy(state.array_records[PUBLIC_KEY]["params"].numpy())
    versions, lineages = list(rec.get("versions", [])), list(rec.get("lineages", []))
    if base.dtype != torch.float32 or base.shape != (numel,) or not len(versions) == len(lineages) == len(shards):
        return none
    return base, [int(v) for v in versions], [str(s) for s in lineages]


def pull_public_model(req: TrainRequest, out: torch.Tensor, state: RecordDict, addresses: list[str],
                      shards: list[tuple[int, int]], client_of: Callable[[str], FollowerClient],
                      token: str | None) -> tuple[int, int]:
    """x̂ from every follower into ``out`` (fp32, whole model), from the copy kept in ``state``;
    returns the version all shards agree on and the payload bytes received (x̂_s whole in the wire
    precision, or each delta's codec payload; every re-pull counted), and keeps the new copy in
    ``state``. ``client_of`` opens a `FollowerClient` for an address (a context manager)."""
    settings = uplink_from_json(req.wire_compress_down, "wire_compress_down")
    if settings is None:
        raise ValueError("the job names no downlink codec (wire_compress_down)")
    compressor = Compressor(settings)
    wire = req.wire_down
    numel = out.numel()
    base, versions, lineages = _kept(state, shards, numel)
    new = torch.empty(numel, dtype=torch.float32)
    if base is not None:
        new.copy_(base)  # the shards that are answered 'same' keep their slice
    received = [0] * len(shards)  # payload bytes per shard, summed over its pulls

    def pull(i: int) -> None:
        begin, end = shards[i]
        n = end - begin
        delta_nbytes = payload_nbytes(settings, n)
        full_nbytes = n * WIRE_DTYPES[wire].itemsize  # x̂_s whole in the wire precision
        held = versions[i]  # None: nothing kept for this shard (x̂_s comes whole)
        with client_of(addresses[i]) as client:
            reply = client.pull_public(n, held, lineages[i] or None, wire=wire, delta_nbytes=delta_nbytes,
                                       max_deltas=max_chain(delta_nbytes, full_nbytes),
                                       token=token)
        if reply.kind == "full":
            assert reply.full is not None
            x = reply.full.to(torch.float32)
            received[i] += full_nbytes
        else:
            received[i] += len(reply.deltas) * delta_nbytes  # each checked to be exactly that size below
            x = new[begin:end].clone()
            for arrays in reply.deltas:
                delta = compressor.decompress(payload_from_arrays(settings, n, arrays), numel=n)
                x = apply_delta(x, delta, wire)
        if not bool(torch.isfinite(x).all()) or not torch.equal(on_grid(x, wire), x):
            raise PayloadError(f"shard {i}'s public model after its pull is not finite or not on the {wire} grid")
        new[begin:end].copy_(x)
        versions[i], lineages[i] = reply.version, reply.lineage

    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        todo = list(range(len(shards)))
        for _ in range(MAX_PULL_ROUNDS):
            list(pool.map(pull, todo))
            newest = max(v for v in versions if v is not None)
            todo = [i for i, v in enumerate(versions) if v != newest]
            if not todo:
                out.copy_(new)
                state[PUBLIC_KEY] = ArrayRecord({"params": Array(new.numpy())})  # `new` is not reused
                state[SHARD_VERSIONS_KEY] = ConfigRecord({"shards": json.dumps(shards), "versions": list(versions),
                                                          "lineages": list(lineages)})
                return newest, sum(received)
    raise RuntimeError(f"followers kept stepping while this client pulled (versions {versions})")
