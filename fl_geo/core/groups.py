"""Parameter groups of the flat buffer, and the per-group arithmetic on it: norms, scaling, clipping.

A *group* is a named list of sorted, disjoint ``(begin, end)`` ranges of the flat parameter
buffer (`fl_geo.core.state.ParamSpec` lays it out). `module_groups` builds them for a granularity:
``global`` gives one group ``"model"`` over everything, ``module`` one group per module
(`module_group_names`: ``embed``, ``blocks.0`` …, ``norm`` for fl-geo's decoder;
``gpt_neox.embed_in``, ``gpt_neox.layers.0`` …, ``gpt_neox.final_layer_norm``, ``embed_out`` for a
Hugging Face GPT-NeoX; EDiT's modules, atorch's FSDP units). The modules are derived from the
model's own layer list, found in the parameter names (`layer_container`), for any architecture.
The pseudo-gradient penalty (`fl_geo.core.penalty`) works per group: every per-update quantity is
a scalar per group, i.e. a ``[num_groups]`` tensor, and every operation on them is vectorised over
groups. The same module naming decides the units of the sharded parameter server
(`fl_geo.core.shards`) and the blocks of Streaming DiLoCo's fragments (`fl_geo.core.streaming`),
which is why it lives here, apart from the penalty's policy, and imports nothing but
`fl_geo.core.state`.

An update is a 1-D tensor over the flat buffer or ``(offset, tensor)`` pieces (`Update`); the
range helpers (`restrict`) cut it into groups as views, never copies. `group_norms` reads an
update once and gives per-group L2 norms with the same bits however the buffer is split into
pieces or shards (tensor-aligned chunked sums, see its docstring); `scale_ranges_` and `clip_`
scale groups of a flat buffer in place (Δ̂ = min(1, φ/(‖Δ̄‖+ε))·Δ̄ per group).

Framework-free (no Flower import).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Sequence

import torch

from fl_geo.core.state import CHUNK_ELEMS, ParamSpec, chunk_ranges, sum_of_squares

__all__ = [
    "GRANULARITIES",
    "clip_",
    "group_norms",
    "layer_container",
    "module_group_name",
    "module_group_names",
    "module_groups",
    "restrict",
    "scale_ranges_",
]

GRANULARITIES = ("global", "module")

Ranges = list[tuple[int, int]]
Groups = list[tuple[str, Ranges]]
Pieces = list[tuple[int, torch.Tensor]]
Update = torch.Tensor | Iterable[tuple[int, torch.Tensor]]

_INTEGER = re.compile(r"[0-9]+")


def module_group_name(name: str) -> str:
    """Top-level module of one parameter name, without the rest of the model: the first
    component, plus the second when it is a container index (``blocks.3.attn.wq.weight`` →
    ``blocks.3``, ``embed.weight`` → ``embed``).

    Only right for models whose layer list is a top-level attribute (fl-geo's decoder); the spec
    functions use `module_group_names`, which finds the layer list at any depth.
    """
    parts = name.split(".")
    if len(parts) >= 2 and _INTEGER.fullmatch(parts[1]):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _container_of(name: str) -> tuple[str, str] | None:
    """``(container, index)`` of the outermost ``<path>.<int>`` in a parameter name (the index
    followed by at least the parameter's own name), else None: ``gpt_neox.layers.3.mlp.w`` →
    ``("gpt_neox.layers", "3")``. An index at the very start (an ``nn.Sequential`` model) is
    not a layer list of a larger model and does not count."""
    parts = name.split(".")
    for k in range(1, len(parts) - 1):
        if _INTEGER.fullmatch(parts[k]):
            return ".".join(parts[:k]), parts[k]
    return None


def layer_container(names: Sequence[str], numels: Sequence[int] | None = None) -> str | None:
    """The dotted path of the model's layer list as its parameter names show it: the
    ``<path>.<int>`` container holding the most elements (``numels``; without them, the most
    names), the first one in the spec on a tie; None when there is none.

    ``blocks`` for fl-geo's decoder, ``gpt_neox.layers`` (GPT-NeoX), ``model.layers`` (Llama,
    Mistral, Qwen), ``transformer.h`` (GPT-2). The server of a public strategy sees only the names
    of the arrays it got, which is why the layer list is read from them; the module tree gives
    the same answer (`fl_geo.inner.layers.decoder_layers`, checked for the Hugging Face presets).
    """
    sizes: dict[str, int] = {}
    for i, name in enumerate(names):
        found = _container_of(name)
        if found is not None:
            sizes[found[0]] = sizes.get(found[0], 0) + (int(numels[i]) if numels is not None else 1)
    if not sizes:
        return None
    return max(sizes, key=lambda c: sizes[c])  # max keeps the first of equals (insertion order)


def module_group_names(names: Sequence[str], numels: Sequence[int] | None = None,
                       layers: str | None = None) -> list[str]:
    """The module of every parameter name: what EDiT calls a module, the sharded parameter
    server a unit, and Streaming DiLoCo's fragments a block (for the layers).

    ``layers``: the dotted path of the layer list (default `layer_container`). A name inside it
    belongs to its layer (``gpt_neox.layers.3``); a name beside it, under the same parent, to
    that sibling module (``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``); any other name
    to its top-level module (``embed_out``, ``lm_head``). For fl-geo's decoder (layer list
    ``blocks`` at the top) this is ``embed``, ``blocks.0`` … ``blocks.{L-1}``, ``norm``.
    """
    container = layer_container(names, numels) if layers is None else layers
    if not container:
        return [name.split(".")[0] for name in names]
    inside = container + "."
    parent = container.rpartition(".")[0]
    beside = parent + "." if parent else ""
    out = []
    for name in names:
        if name.startswith(inside):
            index = name[len(inside):].split(".", 1)[0]
            out.append(f"{container}.{index}" if _INTEGER.fullmatch(index) else container)
        elif beside and name.startswith(beside):
            out.append(beside + name[len(beside):].split(".", 1)[0])
        else:
            out.append(name.split(".")[0])
    return out


def module_groups(spec: ParamSpec, granularity: str = "module") -> Groups:
    """Named groups of flat-buffer ranges ``(begin, end)`` for a granularity.

    ``global``: one group ``"model"`` over the whole buffer. ``module``: one group per
    `module_group_names` entry, in order of first appearance in the spec, with contiguous ranges
    merged (our model gives ``embed``, ``blocks.0`` … ``blocks.{L-1}``, ``norm``, one range each).
    Zero-sized parameters hold no data and are left out.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if granularity == "global":
        return [("model", [(0, spec.numel)] if spec.numel else [])]
    groups: dict[str, Ranges] = {}
    units = module_group_names(spec.names, spec.numels)
    for unit, begin, n in zip(units, spec.offsets, spec.numels, strict=True):
        if n == 0:
            continue
        ranges = groups.setdefault(unit, [])
        if ranges and ranges[-1][1] == begin:
            ranges[-1] = (ranges[-1][0], begin + n)
        else:
            ranges.append((begin, begin + n))
    return list(groups.items())


def _segments(groups: Sequence[tuple[str, Ranges]]) -> list[tuple[int, int, int]]:
    """All non-empty ranges as sorted ``(begin, end, group index)``; overlaps are an error (an
    element in two groups would be normed, scaled and stepped twice)."""
    segments = sorted((b, e, g) for g, (_, ranges) in enumerate(groups) for b, e in ranges
                      if e > b)
    for (_, e0, g0), (b1, _, g1) in zip(segments, segments[1:], strict=False):
        if b1 < e0:
            raise ValueError(f"groups {groups[g0][0]!r} and {groups[g1][0]!r} overlap at {b1}")
    return segments


def _as_pieces(update: Update) -> Pieces:
    """A flat tensor or ``(offset, tensor)`` pieces as flattened pieces (views, no copies)."""
    if isinstance(update, torch.Tensor):
        return [(0, update.reshape(-1))]
    pieces: Pieces = []
    for offset, piece in update:
        if not piece.is_floating_point():
            raise TypeError(f"piece at offset {offset} has non-floating dtype {piece.dtype}")
        pieces.append((int(offset), piece.reshape(-1)))
    return pieces


def restrict(update: Update, ranges: Ranges) -> Pieces:
    """The parts of an update that lie inside ``ranges`` (sorted, disjoint), as views.

    Lets a caller fold one group of an update with its own weight (`Penalty.fold_`).
    """
    starts = [b for b, _ in ranges]
    out: Pieces = []
    for offset, flat in _as_pieces(update):
        stop = offset + flat.numel()
        k = max(bisect_right(starts, offset) - 1, 0)
        while k < len(ranges) and ranges[k][0] < stop:
            lo, hi = max(ranges[k][0], offset), min(ranges[k][1], stop)
            if lo < hi:
                out.append((lo, flat[lo - offset:hi - offset]))
            k += 1
    return out


def _split_at(groups: Sequence[tuple[str, Ranges]], boundaries: Sequence[int]) -> list[tuple[str, Ranges]]:
    """The groups with every range cut at the given offsets (tensor starts)."""
    cuts = sorted(set(int(b) for b in boundaries))
    out = []
    for name, ranges in groups:
        pieces: Ranges = []
        for b, e in ranges:
            k = bisect_right(cuts, b)
            start = b
            while k < len(cuts) and cuts[k] < e:
                pieces.append((start, cuts[k]))
                start = cuts[k]
                k += 1
            pieces.append((start, e))
        out.append((name, pieces))
    return out


def group_norms(update: Update, groups: Sequence[tuple[str, Ranges]],
                boundaries: Sequence[int] | None = None) -> torch.Tensor:
    """Per-group L2 norms of an update, as a float64 tensor of ``len(groups)``.

    ``update``: a 1-D tensor over the flat buffer, or ``(offset, tensor)`` pieces as
    `fl_geo.runtime.wire.decode` returns them (any order, any floating dtype); elements outside every
    group are ignored. Arithmetic as `fl_geo.runtime.wire.check_finite_and_norm`: per chunk of
    `CHUNK_ELEMS` an fp32 sum of squares (`sum_of_squares`), fp16/bf16 chunks first converted into
    a chunk-sized scratch (never a whole-piece fp32 copy), chunk sums accumulated in fp64.
    A NaN/±Inf element, or an fp32 overflow of a chunk's sum, makes its group's norm NaN/+Inf:
    nothing is raised, the caller rejects (a non-finite norm never passes `Penalty.observe`).

    ``boundaries`` (the spec's tensor offsets, as `Penalty` passes them): every range is cut at
    them, so each tensor is read in chunks from its own first element and its sum is added to its
    group in tensor order. A norm then has the same bits however the buffer is split into
    pieces or shards (`fl_geo.core.shards.tensor_sq_sums`, the sharded parameter server).
    """
    if boundaries is not None:
        groups = _split_at(groups, boundaries)
    segments = _segments(groups)
    starts = [b for b, _, _ in segments]
    sums = [0.0] * len(groups)
    scratch: torch.Tensor | None = None
    for offset, flat in sorted(_as_pieces(update), key=lambda p: p[0]):
        stop = offset + flat.numel()
        k = max(bisect_right(starts, offset) - 1, 0)
        while k < len(segments) and segments[k][0] < stop:
            begin, end, g = segments[k]
            lo, hi = max(begin, offset), min(end, stop)
            part = 0.0
            for b, e in chunk_ranges(lo - offset, hi - offset):
                chunk = flat[b:e]
                if chunk.dtype not in (torch.float32, torch.float64):
                    if scratch is None or scratch.device != chunk.device:
                        scratch = torch.empty(CHUNK_ELEMS, dtype=torch.float32,
                                              device=chunk.device)
                    chunk = scratch[: e - b].copy_(chunk)
                part += sum_of_squares(chunk)
            sums[g] += part
            k += 1
    return torch.tensor(sums, dtype=torch.float64).sqrt()


def scale_ranges_(buffer: torch.Tensor, groups: Sequence[tuple[str, Ranges]],
                  factors: torch.Tensor) -> None:
    """Multiply each group's ranges of a flat buffer by its factor, in place (factor 1: skipped,
    so the common case costs no pass over the data)."""
    if factors.numel() != len(groups):
        raise ValueError(f"need one factor per group: {factors.numel()} for {len(groups)}")
    for (_, ranges), f in zip(groups, factors.tolist(), strict=True):
        if f != 1.0:
            for b, e in ranges:
                buffer[b:e].mul_(f)


def clip_(update: torch.Tensor, groups: Sequence[tuple[str, Ranges]], phi: float | torch.Tensor,
          eps: float = 1e-6, boundaries: Sequence[int] | None = None) -> torch.Tensor:
    """Δ̂ = min(1, φ/(‖Δ̄‖+ε))·Δ̄ per group, in place on a flat buffer; returns the factors.

    One group over everything is Di-PS's global clip (φ = 1, there without ε); one group per
    module is EDiT's (φ = 10; atorch clips each FSDP unit). ``phi`` is one float for every group
    or a ``[num_groups]`` tensor (the relative clip's per-group thresholds, +∞: leave the group).
    The norms take one read of the buffer, the scaling one more read-write of the groups that are
    actually clipped.
    """
    eps = float(eps)
    if isinstance(phi, torch.Tensor):
        phi = phi.to(torch.float64).reshape(-1)
        if phi.numel() != len(groups) or not bool((phi > 0).all()) or bool(torch.isnan(phi).any()):
            raise ValueError(f"per-group clip thresholds φ must be {len(groups)} values > 0, got {phi.tolist()}")
    else:
        phi = float(phi)
        if not (phi > 0 and math.isfinite(phi)):
            raise ValueError(f"clip threshold φ must be finite and > 0, got {phi}")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    norms = group_norms(update, groups, boundaries)
    if not bool(torch.isfinite(norms).all()):
        bad = [groups[i][0] for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist()]
        raise ValueError(f"cannot clip a non-finite averaged update (groups {bad})")
    factors = torch.clamp(phi / (norms + eps), max=1.0)
    scale_ranges_(update, groups, factors)
    return factors
