"""The server side of the compressed downlink (``wire.compress_down``, docs/compression.md).

One `Downlink` per model that sites train from: the global model in the synchronous and
asynchronous loops, each local server's model in HALoS. It holds the public model x̂
(`fl_geo.core.downlink.PublicModel`: one model-sized buffer and its last deltas, at most one more
model's wire bytes) and one int per node: the x̂ version the node was last sent. A job's message
carries, by rule:

- nothing new (an empty ``"arrays"``) when the node already holds the current x̂;
- the deltas from the node's version to the current one when all of them are kept (their bytes
  sum below one whole model), each a compressed payload (`fl_geo.runtime.compressed.chain_record`);
- else x̂ whole in ``wire.down`` precision: a node never sent anything, one whose last job failed
  (it may not have applied what it was sent), and every node after a server resume (the per-node
  versions are not checkpointed: node ids change, and the checkpoint may predate what a site
  holds; x̂ is exactly what the deltas would have built, so training does not change, only bytes).

The site trains from x̂, not from the server's x, and its Δ = x̂ − θ_site is folded into x as
any Δ is: it is the change training made to the point it started from, and x − x̂ (the part of
x not yet sent) is kept by the server in x and goes out with a later delta.

``counts``: how many messages took each path (``full``, ``delta``, ``same``), which the loops
report, so a run shows how often the cheap path was actually taken (rarely in asynchronous runs
whose model moves several versions during one job).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from flwr.app import ArrayRecord

from fl_geo.core.compress import Compressor, CompressSettings
from fl_geo.core.compress import payload_nbytes as codec_nbytes
from fl_geo.core.downlink import PublicModel, max_chain
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.compressed import chain_record
from fl_geo.runtime.wire import encode, payload_nbytes
from fl_geo.runtime.wire_settings import settings_json
from fl_geo.timing.scenario import payload_bytes

__all__ = ["Downlink", "DownMessage", "ShardedDownPlan"]

# (the model record, None when the model travels elsewhere; the request fields; bytes; deltas)
DownMessage = tuple[ArrayRecord | None, dict[str, Any], int, int | None]


class Downlink:
    """x̂ of one source model, and what each node holds of it.

    ``key``: a value that changes whenever the source model x changes (its version); x̂ is advanced
    once per key, at the first message after the change.
    """

    def __init__(self, settings: CompressSettings, spec: ParamSpec, wire_down: str, x0: torch.Tensor,
                 key: Hashable) -> None:
        self.spec = spec
        self.wire_down = wire_down
        self.public = PublicModel(Compressor(settings), x0, wire_down, payload_bytes(wire_down, spec.numel))
        self.json = settings_json(settings)
        self.key = key
        self.held: dict[int, int] = {}
        self.counts = {"full": 0, "delta": 0, "same": 0}
        self._full: tuple[int, ArrayRecord] | None = None  # x̂ encoded, for its version

    def refresh(self, x: torch.Tensor, key: Hashable) -> None:
        """Advance x̂ towards ``x`` when ``key`` differs from the last one (once per change of x)."""
        if key != self.key:
            self.public.advance(x)
            self.key = key

    def message(self, node: int, x: torch.Tensor, key: Hashable) -> DownMessage:
        """``node``'s model record, the request fields that describe it, its bytes (as every payload
        is counted, .npy headers included) and the deltas it holds (None: x̂ whole), for the clock."""
        self.refresh(x, key)
        pub = self.public
        plan = pub.plan(self.held.get(node))
        fields: dict[str, Any] = {"wire_compress_down": self.json, "down_version": pub.version}
        if plan is None:
            if self._full is None or self._full[0] != pub.version:
                self._full = (pub.version, encode(pub.params, self.spec, self.wire_down))
            arrays, deltas = self._full[1], None
            self.counts["full"] += 1
        else:
            arrays = chain_record([(s.version, s.payload) for s in plan])
            fields["down_from"] = pub.version - len(plan)
            deltas = len(plan)
            self.counts["delta" if plan else "same"] += 1
        self.held[node] = pub.version
        return arrays, fields, payload_nbytes(arrays), deltas

    def forget(self, node: int) -> None:
        """The node's last job failed: it may not hold what it was sent; its next message is x̂ whole."""
        self.held.pop(node, None)

    def metrics(self, prefix: str = "comm/down_") -> dict[str, float]:
        """Cumulative messages per path: ``comm/down_full``, ``comm/down_delta``, ``comm/down_same``."""
        return {f"{prefix}{k}": float(v) for k, v in self.counts.items()}

    def state_dict(self) -> dict[str, Any]:
        """x̂, its version and the source key it was last advanced for (a checkpoint keeps them, so
        a resumed run trains exactly as one that never stopped)."""
        return {**self.public.state_dict(), "key": self.key, "counts": dict(self.counts)}

    def prepare_load(self, state: dict[str, Any]) -> Callable[[], None]:
        """Validate a `state_dict` (ValueError when it does not fit) and return what installs it;
        every node then gets x̂ whole first."""
        counts = state.get("counts") if isinstance(state, dict) else None
        if not isinstance(counts, dict) or set(counts) != set(self.counts):
            raise ValueError("downlink state lacks its path counts")
        scratch = PublicModel(self.public.compressor, self.public.params, self.wire_down, self.public.full_nbytes)
        scratch.load_state_dict(state)  # validates

        def install() -> None:
            self.public = scratch
            self.key = state.get("key")
            self.counts = {k: int(v) for k, v in counts.items()}
            self.held.clear()
            self._full = None

        return install


class ShardedDownPlan:
    """The leader's account of the compressed downlink on the sharded parameter server's data path.

    There the followers keep x̂ shard by shard and answer each site's pull themselves
    (`fl_geo.ps.follower.FollowerShard.read_public`); the leader holds no model. It keeps one int
    per node, the version the node's last successful job pulled, and from it plans what each job
    will be sent, by the followers' own rule: per shard the chain since that version while it is
    kept (`fl_geo.core.downlink.max_chain` deltas), else x̂_s whole. The plan gives the
    bytes counted (the proxy's payloads) and the deltas the clock charges (the modelled model's
    payloads; a job whose chain some shard no longer keeps is charged the whole model). What a
    site actually pulls can be less (it pulled a newer version in a failed job, or the
    followers stepped before its pull); the counts are the plan's.
    """

    def __init__(self, settings: CompressSettings, shard_numels: list[int], wire_down: str) -> None:
        self.json = settings_json(settings)
        self.delta_nbytes = [codec_nbytes(settings, n) for n in shard_numels]
        self.full_nbytes = [payload_bytes(wire_down, n) for n in shard_numels]
        self.depth = [max_chain(b, f) for b, f in zip(self.delta_nbytes, self.full_nbytes, strict=True)]
        self.held: dict[int, int] = {}
        self.counts = {"full": 0, "delta": 0, "same": 0}
        self.epoch = 0  # followers' restarts so far: a pull from before one holds a dead lineage
        self._sent_in: dict[int, int] = {}  # node -> the epoch its job in flight was sent in

    def message(self, node: int, version: int) -> DownMessage:
        """The fields of ``node``'s job at ``version`` (no record: the model comes from the
        followers), its planned bytes, and the deltas charged (None: the whole model)."""
        held = self.held.get(node)
        gap = None if held is None or held > version else version - held
        nbytes = sum(gap * b if gap is not None and gap <= d else f
                     for b, f, d in zip(self.delta_nbytes, self.full_nbytes, self.depth, strict=True))
        deltas = gap if gap is not None and gap <= min(self.depth) else None
        self.counts["full" if deltas is None else "delta" if deltas else "same"] += 1
        self._sent_in[node] = self.epoch
        return None, {"wire_compress_down": self.json, "down_version": version}, nbytes, deltas

    def pulled(self, node: int, version: int) -> None:
        """``node``'s job succeeded with the model of ``version``: the node holds that x̂ (unless
        the job was sent before a follower restarted: what it pulled then is of a dead lineage)."""
        if self._sent_in.pop(node, None) == self.epoch:
            self.held[node] = version
        else:
            self.held.pop(node, None)

    def forget(self, node: int | None = None) -> None:
        """A node's job failed (it may hold anything), or (None) the followers restarted: every
        node gets x̂ whole next."""
        if node is None:
            self.held.clear()
            self.epoch += 1
        else:
            self.held.pop(node, None)

    def metrics(self, prefix: str = "comm/down_") -> dict[str, float]:
        """Cumulative planned messages per path (``comm/down_full``, ``_delta``, ``_same``)."""
        return {f"{prefix}{k}": float(v) for k, v in self.counts.items()}
