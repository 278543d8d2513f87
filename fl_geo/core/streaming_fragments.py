"""Streaming DiLoCo's fragment layout: which flat-buffer ranges make up fragment p.

:class:`Fragments` assigns the model's transformer blocks to P fragments (strided, block i to
fragment ``i mod P``) and gathers / scatters one fragment of a flat fp32 buffer
(`fl_geo.core.state`) as a contiguous 1-D tensor; :func:`fragment_spec` gives that gathered
tensor's own `ParamSpec` and :func:`fragment_record` the name it travels under. This is the
*where* of a sync; the outer step and the merge (`fl_geo.core.streaming`) and the schedules
(`fl_geo.core.streaming_schedule`) only ever see fragment-shaped tensors, so the layout is kept
apart from both. Framework-free (no Flower import).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fl_geo.core.groups import layer_container, module_group_names
from fl_geo.core.state import ParamSpec

__all__ = ["Fragments", "fragment_record", "fragment_spec"]

Ranges = list[tuple[int, int]]


def _blocks_from_names(spec: ParamSpec, blocks: Sequence[Sequence[str]]) -> list[int | None]:
    """Per spec entry, the index of the block listing it (None: in no block); validated."""
    known = set(spec.names)
    block_of: dict[str, int] = {}
    for index, names in enumerate(blocks):
        if isinstance(names, str) or not list(names):
            raise ValueError(f"block {index} must be a non-empty list of parameter names, got {names!r}")
        for name in names:
            if name not in known:
                raise ValueError(f"block {index} names {name!r}, which is not a parameter of the model")
            if name in block_of:
                raise ValueError(f"parameter {name!r} is in blocks {block_of[name]} and {index}")
            block_of[name] = index
    return [block_of.get(name) for name in spec.names]


class Fragments:
    """Strided assignment of transformer blocks to P fragments, as flat-buffer ranges.

    A *block* is one layer of the model's layer list, found in the parameter names at any depth
    (`fl_geo.core.groups.layer_container`: ``blocks.3`` in fl-geo's decoder, ``gpt_neox.layers.3``,
    ``model.layers.3``, ``transformer.h.3`` in Hugging Face models). Blocks are numbered 0 … L−1
    in the order they first appear in the spec (for a model built with ``nn.ModuleList`` that is
    depth order, i.e. the container index), and block i goes to fragment ``i mod P``. The strided pattern (Streaming DiLoCo)
    makes every fragment span the whole depth, so each sync touches shallow and deep layers
    alike and no fragment is "the embedding end" of the network.

    Parameters outside the blocks go with the first or last fragment (docs/algorithms.md §7):

    * those before the first block in the spec (the embedding) go with fragment 0;
    * those after the last block (the final norm, and an untied head if the model has one) go
      with fragment P − 1;
    * those between two blocks (none in our model) go with the fragment of the nearest block
      before them, since they run right after it in the forward pass.

    Our model ties the head to ``embed.weight``, so there is no separate head entry and the
    whole embedding/unembedding matrix lives in fragment 0. If a spec listed a tied head under a
    second name after the last block, the two copies would sit in different fragments and drift
    apart; build the spec from the de-duplicated parameters in that case.

    P must satisfy 1 ≤ P ≤ L so that no fragment is empty of blocks.
    """

    def __init__(self, spec: ParamSpec, num_fragments: int,
                 blocks: Sequence[Sequence[str]] | None = None) -> None:
        if isinstance(num_fragments, bool) or not isinstance(num_fragments, int):
            raise ValueError(f"num_fragments must be an int, got {num_fragments!r}")
        if blocks is None:  # the layers of the model's layer list, in order of appearance
            container = layer_container(spec.names, spec.numels)
            order: dict[str, int] = {}
            units = module_group_names(spec.names, spec.numels, container)
            for unit in units:
                if container and unit.startswith(container + ".") and unit not in order:
                    order[unit] = len(order)
            block_of = [order.get(unit) for unit in units]
            num_blocks = len(order)
            where = f"layers of {container}" if container else "layers (no <list>.<int> layer list in the parameter names)"
        else:
            block_of = _blocks_from_names(spec, blocks)
            num_blocks = len(blocks)
            where = "blocks given"
        if not 1 <= num_fragments <= num_blocks:
            raise ValueError(
                f"num_fragments (streaming.fragments) must be in [1, {num_blocks}]: the model has "
                f"{num_blocks} {where}, got {num_fragments}"
            )
        self.spec = spec
        self.num_fragments = num_fragments
        self.num_blocks = num_blocks

        positions = [i for i, b in enumerate(block_of) if b is not None]
        first, last = positions[0], positions[-1]
        assignment: list[int] = []
        current = 0  # fragment of the nearest block before the current parameter
        for i, block in enumerate(block_of):
            if block is not None:
                current = block % num_fragments
                assignment.append(current)
            elif i < first:
                assignment.append(0)
            elif i > last:
                assignment.append(num_fragments - 1)
            else:
                assignment.append(current)

        names: list[list[str]] = [[] for _ in range(num_fragments)]
        ranges: list[Ranges] = [[] for _ in range(num_fragments)]
        for name, begin, n, p in zip(spec.names, spec.offsets, spec.numels, assignment,
                                     strict=True):
            names[p].append(name)
            if n == 0:  # holds no data: named, but contributes no range
                continue
            own = ranges[p]
            if own and own[-1][1] == begin:  # spec order is offset order: merge neighbours
                own[-1] = (own[-1][0], begin + n)
            else:
                own.append((begin, begin + n))
        self._names = [tuple(n) for n in names]
        self._ranges = [tuple(r) for r in ranges]
        self._numels = [sum(e - b for b, e in r) for r in ranges]

    @classmethod
    def from_spec(cls, spec: ParamSpec, num_fragments: int) -> Fragments:
        """The strided partition of ``spec`` into ``num_fragments`` fragments (see the class)."""
        return cls(spec, num_fragments)

    @classmethod
    def from_blocks(cls, spec: ParamSpec, num_fragments: int,
                    blocks: Sequence[Sequence[str]]) -> Fragments:
        """Like `from_spec`, with the blocks given as parameter-name groups in depth order
        (a user's model: ``[[names of block 0], [names of block 1], …]``). Block i goes to
        fragment ``i mod P``; names in no block follow the class's rules. A name that is not in
        the spec, or in two blocks, raises ValueError."""
        return cls(spec, num_fragments, blocks)

    def _check_p(self, p: int) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_fragments:
            raise ValueError(f"fragment index must be an int in [0, {self.num_fragments}), "
                             f"got {p!r}")
        return p

    def ranges(self, p: int) -> list[tuple[int, int]]:
        """Half-open flat ranges ``(begin, end)`` of fragment p, sorted and merged."""
        return list(self._ranges[self._check_p(p)])

    def numel(self, p: int) -> int:
        """Number of fp32 elements in fragment p (the size of its gathered tensor)."""
        return self._numels[self._check_p(p)]

    def names(self, p: int) -> list[str]:
        """Names of the parameters in fragment p, in spec order (zero-sized ones included)."""
        return list(self._names[self._check_p(p)])

    def of_block(self, i: int) -> int:
        """Fragment of block i (``i mod P``)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_blocks:
            raise ValueError(f"block index must be an int in [0, {self.num_blocks}), got {i!r}")
        return i % self.num_fragments

    def _check_flat(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.spec.numel:
            raise ValueError(f"flat must be 1-D with {self.spec.numel} elements, got shape "
                             f"{tuple(flat.shape)}")

    def gather(self, flat: torch.Tensor, p: int) -> torch.Tensor:
        """A new 1-D tensor with fragment p's elements of ``flat``, concatenated in range order.

        One copy (``torch.cat`` of views); the result never aliases ``flat``, so the caller may
        step or send it while ``flat`` keeps training.
        """
        self._check_flat(flat)
        return torch.cat([flat[b:e] for b, e in self._ranges[self._check_p(p)]])

    def scatter_(self, flat: torch.Tensor, p: int, values: torch.Tensor) -> torch.Tensor:
        """Inverse of `gather`: write ``values`` into fragment p's ranges of ``flat`` (in place).

        Returns ``flat``. Elements outside fragment p are untouched.
        """
        self._check_flat(flat)
        p = self._check_p(p)
        if values.dim() != 1 or values.numel() != self._numels[p]:
            raise ValueError(f"values must be 1-D with {self._numels[p]} elements for fragment "
                             f"{p}, got shape {tuple(values.shape)}")
        with torch.no_grad():
            pos = 0
            for b, e in self._ranges[p]:
                flat[b:e].copy_(values[pos:pos + e - b])
                pos += e - b
        return flat

    def __repr__(self) -> str:
        return (f"Fragments(num_fragments={self.num_fragments}, num_blocks={self.num_blocks}, "
                f"numels={self._numels})")


def fragment_spec(fragments: Fragments, p: int) -> ParamSpec:
    """The `ParamSpec` of fragment p alone: its parameters in spec order, laid out back to back.

    That is exactly the layout of `Fragments.gather` (ranges in offset order = spec order;
    zero-sized parameters are named but hold nothing), so a gathered fragment encodes and decodes
    with `fl_geo.runtime.wire` like a small model, and the decoded pieces' offsets index the gathered
    tensor. With P = 1 it equals the full spec.
    """
    spec = fragments.spec
    keep = set(fragments.names(p))
    idx = [i for i, name in enumerate(spec.names) if name in keep]
    return ParamSpec(tuple(spec.names[i] for i in idx), tuple(spec.shapes[i] for i in idx),
                     tuple(spec.dtypes[i] for i in idx))


def fragment_record(p: int) -> str:
    """Name of the ArrayRecord that carries fragment p in a message (``frag_<p>``): the new
    global fragment server → worker, the pseudo-gradient Δ_p worker → server."""
    return f"frag_{int(p)}"
