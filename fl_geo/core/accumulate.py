"""Streaming weighted sum of model-sized updates in O(1) fp32 buffers, exact under batching.

The server folds every accepted reply into a running weighted sum (docs/algorithms.md §5), so its
memory is O(1) in the number of workers. Updates arrive in wire precision (fp32/fp16/bf16), as
one flat tensor or as the ``(offset, tensor)`` pieces that `fl_geo.runtime.wire.decode` yields.

Arithmetic contract (what makes results independent of how replies were grouped): folding an
update ``u`` with weight ``w`` computes, element by element, ``acc ← fl(acc + fl(w·u))`` with
``u`` converted exactly to fp32 and ``w`` rounded to fp32 (torch's scalar handling); the first
fold into an empty accumulator writes ``fl(w·u)``, which equals ``fl(0 + fl(w·u))`` up to the
sign of a zero. The multiply and the add are two separate correctly rounded ops on purpose:
``add_(u, alpha=w)`` is a fused multiply-add in torch's vectorised CPU kernel, and whether a
kernel's scalar tail or another build contracts it the same way is not something to bet
bit-exactness on (the price: one more in-cache pass per update chunk, about 10 % of a batched
fold of 8 × 100 M bf16 updates on a 2-core VM). Elementwise ops do not depend on chunking, vectorisation or thread splits, so
`WeightedAccumulator.add` and `WeightedAccumulator.add_batch_checked` give bit-identical sums
for the same updates in the same order, however they are grouped.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from fl_geo.core.state import CHUNK_ELEMS, chunk_ranges, sum_of_squares

__all__ = [
    "WEIGHT_KINDS",
    "BatchResult",
    "WeightedAccumulator",
    "describe_non_finite",
    "weight_for",
]

WEIGHT_KINDS = ("uniform", "tokens")

Pieces = list[tuple[int, torch.Tensor]]
Update = torch.Tensor | Iterable[tuple[int, torch.Tensor]]


def weight_for(kind: str, tokens: int) -> float:
    """Unnormalised weight of one update: ``uniform`` → 1, ``tokens`` → T_i (Di-PS).

    Normalisation (w_i / Σ w_j) happens in `WeightedAccumulator.mean`, so the weight of an update
    can be decided on arrival without knowing the others. ``tokens`` is validated for both kinds:
    a reply that claims to have consumed no tokens is malformed either way.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    if kind == "uniform":
        return 1.0
    if kind == "tokens":
        return float(tokens)
    raise ValueError(f"unknown weight kind {kind!r}; valid kinds: {', '.join(WEIGHT_KINDS)}")


def describe_non_finite(piece: torch.Tensor) -> str:
    """What makes a piece's sum of squares non-finite (error path only; chunked, no big temps)."""
    nan = pos = neg = 0
    flat = piece.reshape(-1)
    for b, e in chunk_ranges(0, flat.numel()):
        chunk = flat[b:e]
        nan += int(torch.isnan(chunk).sum())
        pos += int(torch.isposinf(chunk).sum())
        neg += int(torch.isneginf(chunk).sum())
    if nan or pos or neg:
        return f"non-finite values: {nan} NaN, {pos} +Inf, {neg} -Inf"
    return "all values finite but the fp32 sum of squares overflowed (update too large)"


@dataclass
class BatchResult:
    """Outcome of `WeightedAccumulator.add_batch_checked`, one entry per input update.

    ``norms[i]``: L2 norm of update i (`fl_geo.core.state.sum_of_squares` per chunk, summed in
    fp64: relative error ~1e-8 on any CPU, as `fl_geo.runtime.wire.check_finite_and_norm`), None
    if it was rejected.
    ``rejected``: index in the batch → why; a rejected update left no trace in the sum.
    """

    norms: list[float | None] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)


@dataclass
class _Tiled:
    """One update of a batch: non-empty pieces sorted by offset, tiling [0, numel) exactly."""

    pieces: Pieces
    starts: list[int]
    weight: float
    sum_sq: float = 0.0


class WeightedAccumulator:
    """Σ w_i·u_i and Σ w_i over streamed updates, in one or two model-sized fp32 buffers.

    Memory: ``numel × 4`` bytes for the sum, allocated at construction; `add_batch_checked`
    lazily adds a second buffer of the same size on first use (``2 × numel × 4`` bytes in all),
    whatever the number of updates or batches. Plus one chunk-sized scratch (`CHUNK_ELEMS` fp32
    values): reduced-precision updates are converted chunk by chunk there, because on
    CPU a mixed-dtype op on the whole update would materialise a full-size fp32 copy of it
    (TensorIterator's CPU type promotion), one model-sized temporary per update.
    """

    def __init__(self, numel: int, device: str | torch.device = "cpu") -> None:
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        self.numel = int(numel)
        self.device = torch.device(device)
        self._buf = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        # Second buffer of add_batch_checked: the batch is folded into it (reading _buf), and
        # the two are swapped only once every update of the batch has proved finite, so _buf
        # is never written by a batch that could still fail. Allocated on first use.
        self._out: torch.Tensor | None = None
        # The sum is zeroed lazily: construction and `reset` only clear this flag, and the
        # first fold after them *writes* fl(w·u) instead of reading zeros back and adding
        # (saves a zeroing pass and a read per round; equal to 0 + fl(w·u) up to zero signs).
        self._holds_sum = False
        self._scratch = torch.empty(min(CHUNK_ELEMS, self.numel), dtype=torch.float32,
                                    device=self.device)
        self._count = 0
        self._total_weight = 0.0
        self._dirty = False  # True once mean() has scaled the buffer in place

    @property
    def count(self) -> int:
        """Number of updates folded in since the last reset."""
        return self._count

    @property
    def total_weight(self) -> float:
        """Σ w_i of the folded updates (Python float, i.e. fp64, summed in fold order)."""
        return self._total_weight

    @property
    def buffer(self) -> torch.Tensor:
        """The running sum itself (read it; do not keep it across a fold or `reset`: batched
        folds swap the two buffers)."""
        self._materialise_zeros()
        return self._buf

    def _materialise_zeros(self) -> None:
        if not self._holds_sum:
            self._buf.zero_()
            self._holds_sum = True

    # -----------------------------------------------------------------------------------------
    # Folding

    def add(self, update: Update, weight: float) -> None:
        """Fold ``weight · update`` into the sum, in place, without looking at the values.

        ``update`` is a 1-D tensor of ``numel`` elements or an iterable of ``(offset, 1-D
        tensor)`` pieces covering parts of the buffer, in any order. Pieces are validated for
        bounds before anything is folded, so a bad piece list leaves the sum untouched. Weights
        must be positive and finite in fp32. For replies from the network use `add_batch_checked`
        (a batch of one is the streaming case): it rejects NaN/±Inf without touching the sum.
        """
        self._check_state()
        weight = _check_weight(weight)
        pieces = self._pieces(update)
        overwrite = not self._holds_sum and _tiles(pieces, self.numel)
        if not overwrite:
            self._materialise_zeros()
        for offset, piece in pieces:
            for b, e in chunk_ranges(0, piece.numel()):
                dst = self._buf[offset + b:offset + e]
                x = self._as_fp32(piece[b:e])
                if overwrite:
                    torch.mul(x, weight, out=dst)
                else:
                    dst.add_(torch.mul(x, weight, out=self._scratch[: e - b]))
        self._commit(weight)

    def add_batch_checked(self, updates: Sequence[Update], weights: Sequence[float],
                          max_norm: float | None = None) -> BatchResult:
        """Check every update for NaN/±Inf, take its L2 norm and fold the finite ones, in one
        pass over the sum; bit-identical to `add` of the accepted updates one by one, in order.

        A synchronous round hands us every reply that is ready at once: folding them together
        reads and writes the model-sized sum once per batch instead of once per reply (each
        fold of a 100 M update costs >= 20 ms of RAM traffic for the sum alone). Per chunk of
        `CHUNK_ELEMS` elements, each update is converted to fp32 in a cache-resident scratch,
        its sum of squares taken (``torch.dot``; NaN/±Inf or an fp32 overflow make it
        non-finite ⇒ rejected, as `fl_geo.runtime.wire.check_finite_and_norm`), and folded into the
        second buffer's chunk: ``out = acc + fl(w₀·u₀)``, then ``out += fl(wᵢ·uᵢ)`` in list
        order. If all are finite the buffers swap (no copy). A rejected update is skipped from
        the chunk where it failed on; the chunks before that, which include it, are folded
        again without it from the untouched sum (rare path). So bad input loses nothing: the
        sum equals never having seen it, bit for bit.

        ``updates[i]``: a flat tensor of ``numel`` elements, or ``(offset, 1-D tensor)`` pieces
        (as `fl_geo.runtime.wire.decode` returns) that cover ``[0, numel)`` exactly once, in any order;
        any floating dtype. ``weights[i]``: > 0 and finite in fp32. Argument errors (ValueError,
        TypeError) are raised before anything is folded. An empty batch folds nothing.

        ``max_norm``: an update whose L2 norm exceeds it is rejected too (a hostile or broken
        update scaled ×1e6 is finite and well-shaped); its norm is only known after the pass, so
        the others are folded again from the untouched sum (rare path, same bits as above).
        """
        self._check_state()
        if len(updates) != len(weights):
            raise ValueError(f"need one weight per update, got {len(updates)} updates and "
                             f"{len(weights)} weights")
        batch = [self._tiled(i, u, w) for i, (u, w) in enumerate(zip(updates, weights,
                                                                      strict=True))]
        result = BatchResult(norms=[None] * len(batch))
        if not batch:
            return result
        if self._out is None:
            self._out = torch.empty_like(self._buf)
        active = list(range(len(batch)))
        redo_end = 0  # [0, redo_end) was folded with updates that were rejected later
        for begin, end in chunk_ranges(0, self.numel):
            failed = self._fold_chunk(batch, active, begin, end, check=True)
            for i in failed:
                result.rejected[i] = failed[i]
                active.remove(i)
                redo_end = begin
            if not active:
                return result  # everything rejected: the sum was never written
        if max_norm is not None:
            limit = float(max_norm) ** 2
            for i in [i for i in active if batch[i].sum_sq > limit]:
                result.rejected[i] = (f"update norm {math.sqrt(batch[i].sum_sq):.4g} exceeds the bound "
                                      f"{float(max_norm):.4g}")
                active.remove(i)
                redo_end = self.numel
            if not active:
                return result
        if redo_end:
            for begin, end in chunk_ranges(0, redo_end):
                self._fold_chunk(batch, active, begin, end, check=False)
        self._buf, self._out = self._out, self._buf
        for i in active:
            result.norms[i] = math.sqrt(batch[i].sum_sq)
            self._commit(batch[i].weight)
        return result

    def _fold_chunk(self, batch: list[_Tiled], active: list[int], begin: int, end: int,
                    check: bool) -> dict[int, str]:
        """``out[begin:end] = acc[begin:end] + Σ fl(w·u)`` over ``active`` in order.

        With ``check``, each update's chunk sum of squares is added to its ``sum_sq`` first, and
        an update whose sum is not finite is left out of this chunk and returned (index → why);
        the first update actually folded is the one that reads ``acc``. If every update fails,
        ``out`` is left partly unwritten, which is harmless: the caller then keeps ``acc``.
        """
        assert self._out is not None
        dst = self._out[begin:end]
        scaled = self._scratch[: end - begin]  # fl(w·u), in place when x is the scratch itself
        failed: dict[int, str] = {}
        first = True
        for i in active:
            update = batch[i]
            x = self._load(update, begin, end)
            if check:
                sq = sum_of_squares(x)
                if not math.isfinite(sq):
                    failed[i] = _reason(x, begin, end, self.numel)
                    continue
                update.sum_sq += sq
            if first and not self._holds_sum:
                torch.mul(x, update.weight, out=dst)  # = 0 + fl(w·u), see _holds_sum
            elif first:
                torch.add(self._buf[begin:end], torch.mul(x, update.weight, out=scaled),
                          out=dst)
            else:
                dst.add_(torch.mul(x, update.weight, out=scaled))
            first = False
        return failed

    def _load(self, update: _Tiled, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of an update as fp32: a view of an fp32 piece on our device
        when one piece holds them all (nothing to convert), else converted into the scratch."""
        k = bisect_right(update.starts, begin) - 1
        offset, piece = update.pieces[k]
        if offset + piece.numel() >= end:
            return self._as_fp32(piece[begin - offset:end - offset])
        out = self._scratch[: end - begin]
        pos = begin
        while pos < end:
            offset, piece = update.pieces[k]
            stop = min(end, offset + piece.numel())
            out[pos - begin:stop - begin].copy_(piece[pos - offset:stop - offset])
            pos, k = stop, k + 1
        return out

    def _as_fp32(self, chunk: torch.Tensor) -> torch.Tensor:
        """A chunk as fp32 on our device: itself if it already is, else converted (exactly,
        from fp16/bf16) into the scratch."""
        if chunk.dtype == torch.float32 and chunk.device == self.device:
            return chunk
        return self._scratch[: chunk.numel()].copy_(chunk)

    # -----------------------------------------------------------------------------------------
    # Validation and bookkeeping

    def _check_state(self) -> None:
        if self._dirty:
            raise RuntimeError("mean() scaled the buffer in place; call reset() before adding")

    def _pieces(self, update: Update) -> Pieces:
        """The update as validated ``(offset, 1-D floating tensor)`` pieces within the buffer."""
        if isinstance(update, torch.Tensor):
            if update.dim() != 1 or update.numel() != self.numel:
                raise ValueError(
                    f"update must be 1-D with {self.numel} elements, got {tuple(update.shape)}"
                )
            pieces: Pieces = [(0, update)]
        else:
            pieces = list(update)
        for offset, piece in pieces:
            if not piece.is_floating_point():
                raise TypeError(f"piece at offset {offset} has non-floating dtype {piece.dtype}")
            if piece.dim() != 1:
                raise ValueError(f"piece at offset {offset} must be 1-D, got "
                                 f"{tuple(piece.shape)}")
            if offset < 0 or offset + piece.numel() > self.numel:
                raise ValueError(
                    f"piece [{offset}, {offset + piece.numel()}) outside buffer of {self.numel}"
                )
        return pieces

    def _tiled(self, index: int, update: Update, weight: float) -> _Tiled:
        """Validate one update of a batch: weight, pieces, and an exact cover of the buffer."""
        try:
            weight = _check_weight(weight)
            pieces = sorted(((o, p) for o, p in self._pieces(update) if p.numel()),
                            key=lambda item: item[0])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"update {index} of the batch: {exc}") from None
        if not _tiles(pieces, self.numel):
            raise ValueError(f"update {index} of the batch: its pieces do not cover "
                             f"[0, {self.numel}) exactly once (gap or overlap)")
        return _Tiled(pieces, [o for o, _ in pieces], weight)

    def _commit(self, weight: float) -> None:
        self._holds_sum = True
        self._count += 1
        self._total_weight += weight

    # -----------------------------------------------------------------------------------------
    # Result

    def mean(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ w_i·u_i / Σ w_i.

        With ``out=None`` the buffer is divided **in place** and returned (no model-sized
        temporary); the accumulator then refuses further folds until `reset`. Pass ``out``
        (a float32 tensor of ``numel`` elements) to keep the sum intact.
        """
        if self._count == 0:
            raise RuntimeError("mean() of an empty accumulator: no update was added")
        if not self._total_weight > 0.0:
            raise RuntimeError(f"total weight must be positive, got {self._total_weight}")
        if self._dirty:
            raise RuntimeError("mean() already scaled the buffer in place; call reset() first")
        if out is None:
            self._dirty = True
            return self._buf.div_(self._total_weight)
        if out.dim() != 1 or out.numel() != self.numel or out.dtype != torch.float32:
            raise ValueError(
                f"out must be a 1-D float32 tensor of {self.numel} elements, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        return torch.div(self._buf, self._total_weight, out=out)

    def reset(self) -> None:
        """Start a new sum, reusing the buffers (zeroed lazily, see ``__init__``)."""
        self._holds_sum = False
        self._count = 0
        self._total_weight = 0.0
        self._dirty = False


_FP32 = torch.finfo(torch.float32)


def _check_weight(weight: float) -> float:
    """A weight as a float, finite and positive also once rounded to fp32 (the fold multiplies
    in fp32: a weight beyond fp32's range would turn finite updates into ±Inf in the sum)."""
    weight = float(weight)
    if not _FP32.tiny <= weight <= _FP32.max:
        raise ValueError(f"weight must be finite and positive, within fp32's normal range "
                         f"[{_FP32.tiny:.3g}, {_FP32.max:.3g}], got {weight}")
    return weight


def _tiles(pieces: Sequence[tuple[int, torch.Tensor]], numel: int) -> bool:
    """True if the pieces cover [0, numel) exactly once (then every element gets written)."""
    end = 0
    for offset, piece in sorted(pieces, key=lambda item: item[0]):
        if piece.numel() == 0:
            continue
        if offset != end:
            return False
        end += piece.numel()
    return end == numel


def _reason(x: torch.Tensor, begin: int, end: int, numel: int) -> str:
    """Why a chunk's sum of squares was not finite (rare path: chunk-sized temporaries)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if not count:
        return (f"all values finite but the fp32 sum of squares of elements [{begin}, {end}) "
                "overflowed (update too large)")
    first = int(bad.nonzero()[0])
    value = float(x[first])
    kind = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return (f"non-finite value ({kind}) at element {begin + first} of {numel} "
            f"({count} non-finite in elements [{begin}, {end}))")
