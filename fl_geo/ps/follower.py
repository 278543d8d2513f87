"""One follower parameter server of the sharded Di-PS (framework-free core).

A follower owns one `Shard` of θ (fp32), the fp32 outer-optimizer state for it and the running
weighted sum of this step's accepted updates. It never decides anything: the leader (the Flower
ServerApp) runs the Di-PS control loop and tells it, per update, ``fold`` with a weight or ``drop``,
and, per outer step, the total weight and the clip factor. The same class serves the in-process
case (one or more followers inside the leader, the single-server Di-PS) and the follower processes
behind the gRPC data path (`fl_geo.ps.service`); only the transport differs.

Memory: θ_s, the optimizer buffers and the sum are shard-sized and allocated once (O(1) in the
number of clients). A pushed update is held, in its wire precision (bf16: half an fp32 shard),
only from its arrival until the leader's verdict on it, which comes as soon as every follower has
reported that update's norm: Di-PS's receive "memory pool". Pushes are written chunk by chunk
into that buffer as they stream in (`PushBuffer.write`), so no serialised copy of a whole shard
is kept beside it.

Pseudo-gradient base (docs/algorithms.md §5): ``pseudo_grad`` pushes are Δ and are folded as they are;
``params`` pushes are the worker's θ_i and Δ = θ_s − θ_i is taken against the shard's *current*
θ when the leader handles the update (Di-PS Algorithm 1, line 10), one chunk at a time.

Compressed downlink (``wire.compress_down``, follower processes): the follower keeps its shard of
the public model x̂ (`fl_geo.core.downlink.PublicModel`: x̂_s on the ``wire.down`` grid and its
last deltas, at most one more shard's wire bytes) and advances it once per outer step, so x̂_s's
version is always the shard's. A site's pull names the x̂ version it holds and is answered with
nothing, the chain of deltas since, or x̂_s whole (`read_public`). Each follower compresses its own
shard, so chunks and blocks restart at every shard start (as the uplink's per-shard payloads).
``lineage``: a token drawn when this x̂ began (a fresh follower, a restart, a loaded state): a
site's version counts only within the same lineage, since a leader that resumed from an older
step re-runs versions with other values.
"""

from __future__ import annotations

import copy
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fl_geo.core.compress import Compressor, payload_from_arrays
from fl_geo.core.downlink import DeltaStep, PublicModel
from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.shards import ShardPlan, tensor_sq_sums
from fl_geo.core.state import CHUNK_ELEMS, chunk_ranges, sum_of_squares
from fl_geo.errors import PayloadError

__all__ = ["SEND_MODES", "WIRE_DTYPES", "FollowerError", "FollowerShard", "PublicPull", "PushBuffer",
           "check_wire_and_send"]

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEND_MODES = ("pseudo_grad", "params")
STATE_FORMAT = 1


def check_wire_and_send(wire: str, send: str) -> None:
    """A follower's wire precision and send mode are known names (ValueError otherwise)."""
    if wire not in WIRE_DTYPES:
        raise ValueError(f"unknown wire precision {wire!r}; valid: {', '.join(WIRE_DTYPES)}")
    if send not in SEND_MODES:
        raise ValueError(f"unknown send mode {send!r}; valid: {', '.join(SEND_MODES)}")


class FollowerError(ValueError):
    """A request a follower refuses (unknown job, bad chunk, wrong shard): nothing changed."""


@dataclass(frozen=True)
class PublicPull:
    """A consistent answer to a site's pull of x̂_s: its ``version`` and ``lineage``, and either
    ``full`` (x̂_s, fp32 on the ``precision`` grid; never changed in place, so safe to stream after
    the lock is released) or ``deltas``, the chain from the site's version (empty: up to date)."""

    version: int
    lineage: str
    precision: str
    full: torch.Tensor | None
    deltas: tuple[DeltaStep, ...] = ()

    @property
    def held_from(self) -> int:
        """The version the chain starts from (``version`` when x̂_s goes whole or nothing)."""
        return self.version - len(self.deltas)


@dataclass
class PushBuffer:
    """One update being received: a shard-sized buffer in wire precision and what has arrived."""

    job: str
    data: torch.Tensor
    received: int = 0  # elements written so far (chunks arrive in order)
    complete: bool = False
    sq_sums: list[float] | None = None  # per-tensor Σ Δ² against `norm_version`
    norm_version: int = -1
    meta: dict[str, Any] = field(default_factory=dict)

    def write(self, offset: int, chunk: torch.Tensor) -> None:
        """Copy the next chunk in (in order: offset must equal what has arrived)."""
        if self.complete:
            raise FollowerError(f"push {self.job} is already complete")
        if offset != self.received:
            raise FollowerError(f"push {self.job}: chunk at {offset}, expected {self.received} (chunks come in order)")
        flat = chunk.reshape(-1)
        if flat.dtype != self.data.dtype:
            raise FollowerError(f"push {self.job}: chunk dtype {flat.dtype}, the wire precision is {self.data.dtype}")
        end = offset + flat.numel()
        if end > self.data.numel():
            raise FollowerError(f"push {self.job}: chunk [{offset}, {end}) overruns the shard of {self.data.numel()}")
        self.data[offset:end].copy_(flat)
        self.received = end


class FollowerShard:
    """θ_s, outer state and running sum of one shard; the leader drives every change."""

    def __init__(self, plan: ShardPlan, index: int, optimizer: OuterOptimizer, *,
                 params: torch.Tensor | None = None, wire: str = "bf16", send: str = "pseudo_grad",
                 max_pending: int = 64, compressor: Compressor | None = None,
                 down_compressor: Compressor | None = None, wire_down: str = "fp32") -> None:
        if not 0 <= index < plan.num_shards:
            raise ValueError(f"shard index {index} outside the plan of {plan.num_shards}")
        check_wire_and_send(wire, send)
        self.plan = plan
        self.index = index
        self.shard = plan.shards[index]
        self.numel = self.shard.numel
        if optimizer.numel != self.numel:
            raise ValueError(f"optimizer is for {optimizer.numel} parameters, shard {index} has {self.numel}")
        if params is None:
            params = torch.zeros(self.numel, dtype=torch.float32)
        if params.dtype != torch.float32 or params.dim() != 1 or params.numel() != self.numel:
            raise ValueError(f"shard params must be 1-D fp32 of {self.numel}, got {params.dtype} {tuple(params.shape)}")
        self.params = params  # may be a view into the leader's buffer (in-process followers)
        self.optimizer = optimizer
        self.wire = wire
        self.dtype = WIRE_DTYPES[wire]
        self.send = send
        self.max_pending = max_pending
        # wire.compress on the data path: pushes are payloads of this shard alone, decoded here
        # into an fp32 push buffer (`push_payload`); pseudo-gradients only
        if compressor is not None and (send != "pseudo_grad" or wire != "fp32"):
            raise ValueError("a compressed data path pushes pseudo-gradients into fp32 buffers (wire fp32, "
                             f"send pseudo_grad), got wire {wire}, send {send}")
        self.compressor = compressor
        self.version = 0
        # wire.compress_down: x̂_s, advanced once per step (`read_public`); its own EF is off
        if down_compressor is not None and wire_down not in WIRE_DTYPES:
            raise ValueError(f"unknown downlink precision {wire_down!r}; valid: {', '.join(WIRE_DTYPES)}")
        self.down_compressor = down_compressor
        self.wire_down = wire_down
        self.public: PublicModel | None = None
        self.lineage = ""
        self._new_public()
        self.ranges = plan.tensor_ranges(index)
        self.pending: dict[str, PushBuffer] = {}
        self._acc = torch.empty(self.numel, dtype=torch.float32)
        self._acc_live = False  # the sum is zeroed lazily: the first fold writes w·Δ
        self._folded = 0
        self._scratch = torch.empty(min(CHUNK_ELEMS, self.numel), dtype=torch.float32)
        self._scratch2 = torch.empty(min(CHUNK_ELEMS, self.numel), dtype=torch.float32)

    # ---- data path ----------------------------------------------------------------------------
    def open_push(self, job: str, meta: dict[str, Any] | None = None) -> PushBuffer:
        """Start receiving ``job``'s shard. A second push of the same job replaces the first
        (a client retrying after a broken stream)."""
        if job not in self.pending and len(self.pending) >= self.max_pending:
            raise FollowerError(f"follower {self.index} already holds {len(self.pending)} unhandled pushes")
        buf = self.pending.get(job)
        if buf is None or buf.complete:
            buf = PushBuffer(job, torch.empty(self.numel, dtype=self.dtype))
        buf.received, buf.complete, buf.sq_sums, buf.meta = 0, False, None, dict(meta or {})
        self.pending[job] = buf
        return buf

    def close_push(self, job: str) -> None:
        """Every element has arrived: the push can be normed and folded."""
        buf = self._get(job, complete=False)
        if buf.received != self.numel:
            self.pending.pop(job, None)
            raise FollowerError(f"push {job} ended after {buf.received} of {self.numel} elements")
        buf.complete = True

    def push(self, job: str, data: torch.Tensor, meta: dict[str, Any] | None = None) -> None:
        """A whole shard at once (the in-process transport), validated like a stream."""
        buf = self.open_push(job, meta)
        flat = data.reshape(-1)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        for b, e in chunk_ranges(0, flat.numel()):
            buf.write(b, flat[b:e])
        self.close_push(job)

    def push_payload(self, job: str, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> int:
        """A compressed push (``wire.compress``): this shard's payload arrays, decoded with this
        follower's own settings and checked (keys, dtypes, lengths, index range and order, codes,
        scales; `fl_geo.core.compress`) before anything changes. Refused (FollowerError) on a
        follower without a compressor or for any malformed payload: no push buffer is opened
        or replaced, θ_s and the running sum are untouched. Returns the payload's bytes."""
        if self.compressor is None:
            raise FollowerError(f"follower {self.index} takes uncompressed pushes (wire {self.wire}), "
                                f"job {job!r} sent a compressed payload")
        try:
            payload = payload_from_arrays(self.compressor.settings, self.numel, arrays)
            delta = self.compressor.decompress(payload, numel=self.numel)
        except PayloadError as exc:
            raise FollowerError(f"push {job} to follower {self.index}: {exc}") from None
        if not bool(torch.isfinite(delta).all()):
            raise FollowerError(f"push {job} to follower {self.index} decodes to NaN or Inf")
        self.push(job, delta, meta)
        return int(payload.nbytes)

    def has(self, job: str) -> bool:
        buf = self.pending.get(job)
        return buf is not None and buf.complete

    def read(self, begin: int, end: int, wire: str | None = None) -> torch.Tensor:
        """θ_s[begin:end] in a wire precision (a pull; bf16 conversion per call, not stored)."""
        if not 0 <= begin <= end <= self.numel:
            raise FollowerError(f"read [{begin}, {end}) outside the shard of {self.numel}")
        dtype = WIRE_DTYPES[wire or self.wire]
        x = self.params[begin:end]
        return x.clone() if dtype == torch.float32 else x.to(dtype)

    # ---- control path (the leader) --------------------------------------------------------------
    def theta_sq_sums(self) -> list[float]:
        """Per-tensor Σ θ_s² (the leader's bound on update norms needs ‖θ‖)."""
        return tensor_sq_sums(self.params, self.ranges)

    def norms(self, job: str) -> list[float]:
        """Per-tensor Σ Δ² of a complete push (cached per model version)."""
        buf = self._get(job)
        if buf.sq_sums is None or buf.norm_version != self.version:
            if self.send == "pseudo_grad":
                buf.sq_sums = tensor_sq_sums(buf.data, self.ranges, self._scratch)
            else:
                buf.sq_sums = self._current_base_sq_sums(buf.data)
            buf.norm_version = self.version
        return list(buf.sq_sums)

    def _current_base_sq_sums(self, theta_i: torch.Tensor) -> list[float]:
        """Σ (θ_s − θ_i)² per tensor, chunk by chunk (chunks start at each tensor's start, as in
        `tensor_sq_sums`, so the bits match a materialised Δ)."""
        out = []
        for b, e in self.ranges:
            total = 0.0
            for cb, ce in chunk_ranges(b, e):
                g = self._delta_chunk(theta_i, cb, ce)
                total += sum_of_squares(g)
            out.append(total)
        return out

    def _delta_chunk(self, data: torch.Tensor, b: int, e: int) -> torch.Tensor:
        """Δ[b:e] in fp32 scratch: the push itself, or θ_s − θ_i."""
        out = self._scratch[: e - b]
        if self.send == "pseudo_grad":
            return out.copy_(data[b:e])
        other = self._scratch2[: e - b].copy_(data[b:e])
        return torch.sub(self.params[b:e], other, out=out)

    def fold(self, job: str, weight: float, rescale: float = 1.0) -> None:
        """Σ ← rescale·Σ + weight·Δ_job, then free the push. Arithmetic per element is
        fl(fl(rescale·Σ) + fl(w·Δ)) whatever the shard boundaries (first fold: fl(w·Δ))."""
        weight, rescale = float(weight), float(rescale)
        if not (weight >= 0 and math.isfinite(weight)) or not (rescale >= 0 and math.isfinite(rescale)):
            raise FollowerError(f"fold {job}: weight {weight} and rescale {rescale} must be finite and >= 0")
        buf = self._get(job)
        if rescale != 1.0 and self._acc_live:
            self._acc.mul_(rescale)
        if weight > 0:
            for b, e in self._chunks():
                g = self._delta_chunk(buf.data, b, e)
                dst = self._acc[b:e]
                if self._acc_live:
                    dst.add_(g.mul_(weight))
                else:
                    torch.mul(g, weight, out=dst)
            self._acc_live = True
            self._folded += 1
        del self.pending[job]

    def drop(self, job: str) -> None:
        """Forget a push (rejected, or voided by the leader); unknown jobs are ignored."""
        self.pending.pop(job, None)

    def mean_sq_sums(self, total_weight: float) -> list[float]:
        """Σ w·Δ → Δ̄ = Σ/Σw in place (skipped for Σw ∈ {0, 1}, as `Penalty.normalise_`);
        returns Δ̄'s per-tensor sums of squares for the leader's clip."""
        total = float(total_weight)
        if not (total >= 0 and math.isfinite(total)):
            raise FollowerError(f"total weight {total} must be finite and >= 0")
        if not self._acc_live:
            self._acc.zero_()
            self._acc_live = True
        if total > 0 and total != 1.0:
            self._acc.div_(total)
        return tensor_sq_sums(self._acc, self.ranges)

    def step(self, clip_factor: float = 1.0, lr: float | None = None) -> int:
        """Scale Δ̄ by the leader's clip factor, one outer step, clear the sum; returns the new
        version. ``lr`` overrides the optimizer's lr for this step only (outer_lr_scaling)."""
        factor = float(clip_factor)
        if not (0 <= factor <= 1):
            raise FollowerError(f"clip factor {factor} must lie in [0, 1]")
        if not self._acc_live:
            raise FollowerError("step without a normalised sum (call mean_sq_sums first)")
        if factor != 1.0:
            self._acc.mul_(factor)
        base_lr = getattr(self.optimizer, "lr", None)
        if lr is not None and base_lr is not None:
            self.optimizer.lr = float(lr)
        try:
            self.optimizer.step(self.params, self._acc)
        finally:
            if lr is not None and base_lr is not None:
                self.optimizer.lr = base_lr
        self.version += 1
        if self.public is not None:
            self.public.advance(self.params)  # version + 1, like θ_s's
        self.reset_window()
        return self.version

    # ---- compressed downlink ----------------------------------------------------------------------
    def _new_public(self, state: dict[str, Any] | None = None) -> None:
        """x̂_s = g(θ_s) at this version (or ``state``'s x̂), with a new lineage; nothing without
        a downlink compressor. Raises (FollowerError) before changing anything."""
        if self.down_compressor is None:
            return
        full_nbytes = self.numel * WIRE_DTYPES[self.wire_down].itemsize
        public = PublicModel(self.down_compressor, self.params, self.wire_down, full_nbytes)
        public.version = self.version
        if state is not None:
            try:
                public.load_state_dict(state)
            except ValueError as exc:
                raise FollowerError(f"follower state's public model: {exc}") from None
            if public.version != self.version:
                raise FollowerError(f"follower state's public model is at version {public.version}, θ_s at "
                                    f"{self.version}")
        self.public, self.lineage = public, secrets.token_hex(8)

    def read_public(self, held: int | None, lineage: str | None = None) -> PublicPull:
        """What a site holding x̂_s at version ``held`` of ``lineage`` is sent (`PublicModel.plan`):
        nothing new, the chain of deltas since ``held``, or x̂_s whole (a site that holds nothing,
        another lineage, or a version whose chain is no longer kept). Call under the lock that
        serialises steps; the answer stays valid after it (x̂_s is replaced, never written)."""
        if self.public is None:
            raise FollowerError(f"follower {self.index} keeps no public model (wire.compress_down is off)")
        pub = self.public
        plan = pub.plan(held if lineage == self.lineage else None)
        if plan is None:
            return PublicPull(pub.version, self.lineage, self.wire_down, pub.params)
        return PublicPull(pub.version, self.lineage, self.wire_down, None, tuple(plan))

    def reset_window(self, drop_pending: bool = False) -> None:
        """Empty the running sum (after a step, or when the leader voids a window)."""
        self._acc_live = False
        self._folded = 0
        if drop_pending:
            self.pending.clear()

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """θ_s, the optimizer state and the version: what a restarted follower resumes from.
        Taken between steps (the sum and pending pushes are not part of it)."""
        return {
            "format": STATE_FORMAT,
            "index": self.index,
            "begin": self.shard.begin,
            "end": self.shard.end,
            "version": self.version,
            "params": self.params,
            "optimizer": self.optimizer.state_dict(),
            **({"public": self.public.state_dict()} if self.public is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate everything against this shard before changing anything."""
        for key in ("format", "index", "begin", "end", "version", "params", "optimizer"):
            if key not in state:
                raise FollowerError(f"follower state lacks {key!r}")
        if state["format"] != STATE_FORMAT:
            raise FollowerError(f"follower state format {state['format']} is not {STATE_FORMAT}")
        if (state["index"], state["begin"], state["end"]) != (self.index, self.shard.begin, self.shard.end):
            raise FollowerError(
                f"state is for shard {state['index']} [{state['begin']}, {state['end']}), this follower holds "
                f"shard {self.index} [{self.shard.begin}, {self.shard.end})")
        p = state["params"]
        if not torch.is_tensor(p) or p.dtype != torch.float32 or p.numel() != self.numel:
            raise FollowerError(f"state params are not fp32 of {self.numel} elements")
        if not bool(torch.isfinite(p).all()):
            raise FollowerError("state params hold NaN or Inf")
        optimizer = copy.copy(self.optimizer)  # same class and hyperparameters, fresh buffers
        optimizer._state, optimizer._scratch = {}, []
        optimizer.load_state_dict(dict(state["optimizer"]))  # raises before anything is swapped
        public = state.get("public")
        if self.public is not None and public is not None:
            if not isinstance(public, dict):
                raise FollowerError("follower state's public model is not a dict")
            scratch = PublicModel(self.public.compressor, self.public.params, self.wire_down, self.public.full_nbytes)
            try:
                scratch.load_state_dict(public)
            except ValueError as exc:
                raise FollowerError(f"follower state's public model: {exc}") from None
            if scratch.version != int(state["version"]):
                raise FollowerError(f"follower state's public model is at version {scratch.version}, θ_s at "
                                    f"{state['version']}")
        self.params.copy_(p.reshape(-1))
        self.optimizer = optimizer
        self.version = int(state["version"])
        # x̂_s as saved, or (the supervisor's first checkpoint, a run without it) g(θ_s) afresh
        self._new_public(public if isinstance(public, dict) else None)
        self.reset_window(drop_pending=True)

    # ---- helpers -------------------------------------------------------------------------------
    def _get(self, job: str, complete: bool = True) -> PushBuffer:
        buf = self.pending.get(job)
        if buf is None:
            raise FollowerError(f"follower {self.index} holds no push for job {job!r}")
        if complete and not buf.complete:
            raise FollowerError(f"push {job} to follower {self.index} is incomplete ({buf.received}/{self.numel})")
        return buf

    def _chunks(self) -> list[tuple[int, int]]:
        """Chunk ranges aligned at every tensor start (as the norms), so no chunk spans two."""
        return [c for b, e in self.ranges for c in chunk_ranges(b, e)]


def assemble(followers: Sequence[FollowerShard]) -> torch.Tensor:
    """The whole θ from in-process followers, in plan order (for evaluation and tests)."""
    return torch.cat([f.params for f in followers])
