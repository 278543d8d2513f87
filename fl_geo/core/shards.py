"""How a sharded parameter server splits the model (Di-PS §4.1: followers own contiguous layers).

A `ShardPlan` cuts the flat fp32 buffer laid out by a `ParamSpec` into F contiguous shards made of
whole *units* (layers: ``embed``, ``blocks.0`` …, ``norm``, as `fl_geo.core.groups.module_group_names`
names them). Units are the indivisible communication units of Di-PS Appendix A; shards are balanced
by element count, so each follower holds about 1/F of θ, of the fp32 outer-optimizer state and of
the running sum.

Norms are what make F matter: the leader decides on an update from the norms its followers report.
Every norm here is built from **per-tensor fp64 sums of squares**, each taken in fp32 chunks that
start at the tensor's first element. A tensor lies wholly in one shard, so its sum is the same bits
whatever F is, and the leader combines the sums in tensor order. That is why the same seed gives a
bit-identical model with 1, 2 or 4 followers. `global_norm` (√Σ over tensors, the default) is the
model's L2 norm; `sum_of_shard_norms` is Di-PS §4.2's literal G = Σ_i ‖Δ^i‖₂ over followers, which
by definition changes with F.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_geo.core.groups import module_group_names
from fl_geo.core.state import CHUNK_ELEMS, ParamSpec, chunk_ranges, sum_of_squares

__all__ = [
    "NORM_RULES",
    "Shard",
    "ShardPlan",
    "combine_norm",
    "global_norm",
    "sum_of_shard_norms",
    "tensor_sq_sums",
]

NORM_RULES = ("global", "sum_of_shards")


@dataclass(frozen=True)
class Shard:
    """One follower's part: flat range ``[begin, end)``, the spec tensors and units inside it."""

    index: int
    begin: int
    end: int
    tensors: tuple[int, ...]  # indices into the ParamSpec, in order
    units: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.end - self.begin


def _units(spec: ParamSpec) -> list[tuple[str, list[int]]]:
    """Contiguous runs of spec tensors that share a unit name, in spec order."""
    out: list[tuple[str, list[int]]] = []
    for i, unit in enumerate(module_group_names(spec.names, spec.numels)):
        if out and out[-1][0] == unit:
            out[-1][1].append(i)
        else:
            out.append((unit, [i]))
    return out


@dataclass(frozen=True)
class ShardPlan:
    """F contiguous shards of whole units, balanced by element count."""

    spec: ParamSpec
    shards: tuple[Shard, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @classmethod
    def build(cls, spec: ParamSpec, num_shards: int) -> ShardPlan:
        """Cut after the unit whose end is nearest to each k·total/F boundary (a linear pass).

        Every shard gets at least one unit; more followers than units is an error (a follower
        with nothing to hold would still have to take part in every step)."""
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"the number of followers must be an int >= 1, got {num_shards!r}")
        units = _units(spec)
        if num_shards > len(units):
            raise ValueError(
                f"{num_shards} followers but the model has only {len(units)} layers to give them "
                f"({', '.join(u for u, _ in units[:8])}{', …' if len(units) > 8 else ''})")
        ends = []  # flat end offset of each unit
        for _, idx in units:
            last = idx[-1]
            ends.append(spec.offsets[last] + spec.numels[last])
        total = spec.numel
        cuts: list[int] = []  # unit index after which a shard ends
        start = 0
        for k in range(1, num_shards):
            target = total * k / num_shards
            # candidates leave room for the remaining shards (one unit each)
            lo, hi = start, len(units) - (num_shards - k) - 1
            best = min(range(lo, hi + 1), key=lambda u: (abs(ends[u] - target), u))
            cuts.append(best)
            start = best + 1
        cuts.append(len(units) - 1)
        shards = []
        first = 0
        for s, last_unit in enumerate(cuts):
            chosen = units[first:last_unit + 1]
            tensors = tuple(i for _, idx in chosen for i in idx)
            begin = spec.offsets[tensors[0]]
            end = spec.offsets[tensors[-1]] + spec.numels[tensors[-1]]
            shards.append(Shard(s, begin, end, tensors, tuple(u for u, _ in chosen)))
            first = last_unit + 1
        return cls(spec, tuple(shards))

    def to_json(self) -> str:
        """The plan as the leader sends it to clients and followers (validated on load)."""
        return json.dumps({"spec": json.loads(self.spec.to_json()),
                           "shards": [[s.begin, s.end, list(s.tensors), list(s.units)] for s in self.shards]})

    @classmethod
    def from_json(cls, text: str) -> ShardPlan:
        try:
            data = json.loads(text)
            spec = ParamSpec.from_json(json.dumps(data["spec"]))
            shards = tuple(Shard(i, int(b), int(e), tuple(int(t) for t in ts), tuple(str(u) for u in us))
                           for i, (b, e, ts, us) in enumerate(data["shards"]))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed shard plan: {exc}") from exc
        plan = cls(spec, shards)
        plan.validate()
        return plan

    def validate(self) -> None:
        """Shards tile the buffer in order and hold whole tensors."""
        pos, t = 0, 0
        for s in self.shards:
            if s.begin != pos or s.end <= s.begin or not s.tensors:
                raise ValueError(f"shard {s.index} [{s.begin}, {s.end}) does not continue the plan at {pos}")
            if s.tensors != tuple(range(t, t + len(s.tensors))):
                raise ValueError(f"shard {s.index} tensors {s.tensors[:4]} are not the next ones in the spec")
            last = s.tensors[-1]
            if self.spec.offsets[s.tensors[0]] != s.begin or self.spec.offsets[last] + self.spec.numels[last] != s.end:
                raise ValueError(f"shard {s.index} does not hold whole tensors")
            pos, t = s.end, t + len(s.tensors)
        if pos != self.spec.numel or t != len(self.spec.names):
            raise ValueError(f"shards cover {pos} of {self.spec.numel} elements")

    def tensor_ranges(self, shard: int) -> list[tuple[int, int]]:
        """``(begin, end)`` of each tensor of a shard, relative to the shard's start."""
        s = self.shards[shard]
        return [(self.spec.offsets[i] - s.begin, self.spec.offsets[i] + self.spec.numels[i] - s.begin)
                for i in s.tensors]


def tensor_sq_sums(x: torch.Tensor, ranges: Sequence[tuple[int, int]], scratch: torch.Tensor | None = None) -> list[float]:
    """Σ x² per tensor range of a 1-D shard-sized tensor, as Python floats (fp64).

    Each range is read in fp32 chunks of `CHUNK_ELEMS` from its own first element (`sum_of_squares`
    per chunk, chunk sums added in fp64): the result depends only on the tensor's values, never on
    which shard or buffer holds it. bf16/fp16 chunks are converted into ``scratch`` (one chunk of
    fp32), never into a whole-tensor copy. NaN/Inf give a NaN/Inf sum; the caller rejects."""
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    out = []
    for b, e in ranges:
        total = 0.0
        for cb, ce in chunk_ranges(b, e):
            chunk = x[cb:ce]
            if chunk.dtype not in (torch.float32, torch.float64):
                if scratch is None:
                    scratch = torch.empty(CHUNK_ELEMS, dtype=torch.float32)
                chunk = scratch[: ce - cb].copy_(chunk)
            total += sum_of_squares(chunk)
        out.append(total)
    return out


def combine_norm(sq_sums: Sequence[float]) -> float:
    """√Σ of per-tensor sums, added in the given (tensor) order."""
    total = 0.0
    for s in sq_sums:
        total += s
    return math.sqrt(total) if total >= 0 else float("nan")


def global_norm(per_shard: Sequence[Sequence[float]]) -> float:
    """The L2 norm of the whole update from every shard's per-tensor sums (independent of F)."""
    return combine_norm([s for shard in per_shard for s in shard])


def sum_of_shard_norms(per_shard: Sequence[Sequence[float]]) -> float:
    """Di-PS §4.2: G = Σ_i ‖Δ^i‖₂ over the followers (equals `global_norm` for one follower)."""
    total = 0.0
    for shard in per_shard:
        total += combine_norm(shard)
    return total
