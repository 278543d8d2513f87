"""Streaming weighted mean of model-sized updates with one fp32 buffer.

The asynchronous server (ALGORITHMS.md §5) folds every accepted reply into a running weighted
sum as it arrives, so server memory is O(1) in the number of workers: one fp32 buffer, whatever
``count`` becomes. Updates arrive in wire precision (fp32/fp16/bf16), either as one flat tensor
or as the ``(offset, tensor)`` pieces that `fl_geo.wire.decode` yields, one per parameter.

Two ways in: `WeightedAccumulator.add` folds an update already checked by
`fl_geo.wire.check_finite_and_norm` (needed when the norm decides acceptance or weight, §4), and
`WeightedAccumulator.add_checked` checks and folds in one pass (one read and one bf16→fp32
conversion of the update instead of two) when nothing between the check and the fold depends
on the norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from .state import CHUNK_ELEMS, chunk_ranges

__all__ = [
    "WEIGHT_KINDS",
    "NonFiniteUpdateError",
    "WeightedAccumulator",
    "describe_non_finite",
    "weight_for",
]

WEIGHT_KINDS = ("uniform", "tokens")


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


class NonFiniteUpdateError(ValueError):
    """A checked add met NaN/±Inf (or an fp32 overflow of the sum of squares).

    ``offset``: flat index of the first chunk that failed; ``index``: position of the offending
    update in a batch (`WeightedAccumulator.add_batch_checked`), None for a single update.
    """

    def __init__(self, message: str, offset: int, index: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset
        self.index = index


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


class _StopFold(Exception):
    """Internal: a chunk's sum of squares was not finite (raised before folding that chunk)."""

    def __init__(self, chunk_begin: int, index: int = 0, piece: int = 0) -> None:
        self.chunk_begin = chunk_begin  # within the piece
        self.index = index  # update within a batch
        self.piece = piece  # piece within the layout (batched adds)


Pieces = list[tuple[int, torch.Tensor]]


class WeightedAccumulator:
    """Σ w_i·u_i and Σ w_i over streamed updates, holding exactly one fp32 buffer.

    The buffer is allocated once, at construction. Reduced-precision updates are converted chunk by
    chunk into a small fp32 scratch (`CHUNK_ELEMS` values) before the multiply-add: on CPU a
    mixed-dtype ``buf.add_(u_bf16, alpha=w)`` would materialise a full-size fp32 copy of ``u``
    (TensorIterator's CPU type promotion), i.e. one extra model-sized temporary per update.
    """

    def __init__(self, numel: int, device: str | torch.device = "cpu") -> None:
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        self.numel = int(numel)
        self.device = torch.device(device)
        self._buf = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        # The buffer is zeroed lazily: construction and `reset` only clear this flag, and the
        # first `add` after them *writes* w·u instead of reading zeros back and adding (saves a
        # zeroing pass and a read per round).
        self._holds_sum = False
        self._scratch = torch.empty(min(CHUNK_ELEMS, self.numel), dtype=torch.float32,
                                    device=self.device)
        self._local: torch.Tensor | None = None  # batch partial sum, see add_batch_checked
        self._count = 0
        self._total_weight = 0.0
        self._dirty = False  # True once mean() has scaled the buffer in place

    @property
    def count(self) -> int:
        """Number of updates folded in since the last reset."""
        return self._count

    @property
    def total_weight(self) -> float:
        """Σ w_i of the folded updates (Python float, i.e. fp64)."""
        return self._total_weight

    @property
    def buffer(self) -> torch.Tensor:
        """The running sum itself (read it, do not keep it across `reset`)."""
        self._materialise_zeros()
        return self._buf

    def _materialise_zeros(self) -> None:
        if not self._holds_sum:
            self._buf.zero_()
            self._holds_sum = True

    def add(
        self,
        update: torch.Tensor | Iterable[tuple[int, torch.Tensor]],
        weight: float,
    ) -> None:
        """Fold ``weight · update`` into the sum.

        ``update`` is a 1-D tensor of ``numel`` elements or an iterable of ``(offset, 1-D tensor)``
        pieces covering parts of the buffer (a payload decoded array by array). Pieces are
        validated for bounds before anything is folded, so a bad piece list leaves the sum
        untouched. Weights must be finite and positive. Values are not inspected: check the
        update first (`fl_geo.wire.check_finite_and_norm`) or use `add_checked`.
        """
        pieces, weight, overwrite = self._prepare(update, weight)
        for offset, piece in pieces:
            self._fold(offset, piece, weight, overwrite, check=False)
        self._commit(weight)

    def add_checked(
        self,
        update: torch.Tensor | Iterable[tuple[int, torch.Tensor]],
        weight: float,
    ) -> float:
        """Check for NaN/±Inf, fold, and return the update's L2 norm, in one pass.

        Each chunk is converted to fp32 once, its sum of squares taken (fp32 per chunk, summed
        in fp64, as `fl_geo.wire.check_finite_and_norm`) and checked *before* the chunk is
        folded, so no non-finite value ever reaches the sum. If a chunk fails, the chunks of this
        update already folded are taken out again and `NonFiniteUpdateError` is raised: exactly
        when this was the first update since `reset` (the buffer is simply marked empty again),
        otherwise by subtracting them, which restores the sum up to one fp32 rounding per
        element. A finite update whose fp32 chunk sum of squares overflows is rejected too.

        Use it when nothing between the check and the fold depends on the norm (no §4 penalty,
        weight not a function of the norm); otherwise call `check_finite_and_norm` then `add`.
        """
        pieces, weight, overwrite = self._prepare(update, weight)
        total, done = 0.0, []
        for offset, piece in pieces:
            try:
                total += self._fold(offset, piece, weight, overwrite, check=True)
            except _StopFold as stop:
                self._unfold(done + [(offset, piece[: stop.chunk_begin])], weight, overwrite)
                bad = piece[stop.chunk_begin:stop.chunk_begin + CHUNK_ELEMS]
                where = offset + stop.chunk_begin
                raise NonFiniteUpdateError(
                    f"update rejected at flat offset {where}: {describe_non_finite(bad)}", where
                ) from None
            done.append((offset, piece))
        self._commit(weight)
        return math.sqrt(total)

    def add_batch_checked(
        self,
        updates: Sequence[torch.Tensor | Iterable[tuple[int, torch.Tensor]]],
        weights: Sequence[float],
    ) -> list[float]:
        """`add_checked` for several updates at once, in one pass over the buffer.

        For a synchronous round, where all replies are in memory anyway: per chunk, each update
        is converted, its sum of squares checked and multiply-added into a cache-resident fp32
        partial sum, and the buffer is read and written once for the whole batch instead of once
        per update. All updates must share one piece layout (as payloads decoded with the same
        spec do; flat tensors are sliced to it). The sum differs from sequential adds only in
        summation order. Returns the L2 norm of each update.

        On a non-finite chunk the whole batch is taken out again (exactly when the accumulator
        was empty, otherwise up to one fp32 rounding per element) and `NonFiniteUpdateError`
        names the update (``index``) so the caller can retry without it.
        """
        if len(updates) != len(weights) or not updates:
            raise ValueError(f"need one weight per update and at least one update, got "
                             f"{len(updates)} updates and {len(weights)} weights")
        prepared = [self._prepare(u, w) for u, w in zip(updates, weights, strict=True)]
        layout = self._batch_layout([p for p, _, _ in prepared])
        batch = [(self._slice_to(p, layout), w) for p, w, _ in prepared]
        overwrite = all(ow for _, _, ow in prepared)  # any False already zeroed the buffer
        sums = [0.0] * len(batch)
        written: list[tuple[int, int, int]] = []  # (piece index, begin, end) stored in buffer
        local_all = self._local_scratch()
        try:
            for j, (offset, n) in enumerate(layout):
                for begin, end in chunk_ranges(0, n):
                    local = self._batch_chunk(batch, j, begin, end, local_all, sums)
                    target = self._buf[offset + begin:offset + end]
                    if overwrite:
                        target.copy_(local)
                    else:
                        target.add_(local)
                    written.append((j, begin, end))
        except _StopFold as stop:
            if overwrite:
                self._holds_sum = False
            else:
                for j, begin, end in written:
                    offset = layout[j][0]
                    local = self._batch_chunk(batch, j, begin, end, local_all, None)
                    self._buf[offset + begin:offset + end].sub_(local)
            bad_piece = batch[stop.index][0][stop.piece][1]
            bad = bad_piece[stop.chunk_begin:stop.chunk_begin + CHUNK_ELEMS]
            flat_offset = layout[stop.piece][0] + stop.chunk_begin
            raise NonFiniteUpdateError(
                f"update {stop.index} of the batch rejected at flat offset {flat_offset}: "
                f"{describe_non_finite(bad)}; nothing from this batch was kept",
                flat_offset, stop.index,
            ) from None
        for _, weight in batch:
            self._commit(weight)
        return [math.sqrt(v) for v in sums]

    def _batch_chunk(self, batch: list[tuple[Pieces, float]], j: int, begin: int, end: int,
                     local_all: torch.Tensor, sums: list[float] | None) -> torch.Tensor:
        """Σ_k w_k·u_k over one chunk of piece ``j``, in cache; checks finiteness if ``sums``."""
        local = local_all[: end - begin]
        for k, (pieces, weight) in enumerate(batch):
            src = pieces[j][1][begin:end]
            if src.dtype != torch.float32 or src.device != self.device:
                src = self._scratch[: end - begin].copy_(src)
            if sums is not None:
                sq = float(torch.dot(src, src))
                if not math.isfinite(sq):
                    raise _StopFold(begin, index=k, piece=j)
                sums[k] += sq
            if k == 0:
                torch.mul(src, weight, out=local)
            else:
                local.add_(src, alpha=weight)
        return local

    def _local_scratch(self) -> torch.Tensor:
        """Second chunk scratch (the batch's partial sum), allocated on first batched add."""
        if self._local is None:
            self._local = torch.empty_like(self._scratch)
        return self._local

    def _batch_layout(self, all_pieces: list[Pieces]) -> list[tuple[int, int]]:
        """The shared (offset, numel) layout of a batch; whole-buffer tensors adopt the others'."""
        whole = [(0, self.numel)]
        layouts = [[(o, p.numel()) for o, p in pieces] for pieces in all_pieces]
        layout = next((lay for lay in layouts if lay != whole), whole)
        for i, lay in enumerate(layouts):
            if lay not in (layout, whole):
                raise ValueError(f"update {i} of the batch has a different piece layout; "
                                 "batched adds need one layout (decode with the same spec)")
        return layout

    @staticmethod
    def _slice_to(pieces: Pieces, layout: list[tuple[int, int]]) -> Pieces:
        """Re-express a single whole-buffer piece in ``layout`` (views, no copy)."""
        if [(o, p.numel()) for o, p in pieces] == layout:
            return pieces
        (_, whole), = pieces
        return [(o, whole[o:o + n]) for o, n in layout]

    def _prepare(
        self, update: torch.Tensor | Iterable[tuple[int, torch.Tensor]], weight: float
    ) -> tuple[list[tuple[int, torch.Tensor]], float, bool]:
        """Validate arguments; return the pieces, the weight and whether to overwrite."""
        if self._dirty:
            raise RuntimeError("mean() scaled the buffer in place; call reset() before add()")
        weight = float(weight)
        if not (weight > 0.0 and weight != float("inf")):
            raise ValueError(f"weight must be finite and positive, got {weight}")
        if isinstance(update, torch.Tensor):
            if update.dim() != 1 or update.numel() != self.numel:
                raise ValueError(
                    f"update must be 1-D with {self.numel} elements, got {tuple(update.shape)}"
                )
            pieces: list[tuple[int, torch.Tensor]] = [(0, update)]
        else:
            pieces = list(update)
        for offset, piece in pieces:
            self._check_piece(offset, piece)
        overwrite = not self._holds_sum and self._covers_buffer(pieces)
        if not overwrite:
            self._materialise_zeros()
        return pieces, weight, overwrite

    def _commit(self, weight: float) -> None:
        self._holds_sum = True
        self._count += 1
        self._total_weight += weight

    def _check_piece(self, offset: int, piece: torch.Tensor) -> None:
        if not piece.is_floating_point():
            raise TypeError(f"piece at offset {offset} has non-floating dtype {piece.dtype}")
        if piece.dim() != 1:
            raise ValueError(f"piece at offset {offset} must be 1-D, got {tuple(piece.shape)}")
        if offset < 0 or offset + piece.numel() > self.numel:
            raise ValueError(
                f"piece [{offset}, {offset + piece.numel()}) outside buffer of {self.numel}"
            )

    def _covers_buffer(self, pieces: list[tuple[int, torch.Tensor]]) -> bool:
        """True if the pieces tile [0, numel) exactly (then every element gets written)."""
        end = 0
        for offset, piece in sorted(pieces, key=lambda p: p[0]):
            if offset != end:
                return False
            end += piece.numel()
        return end == self.numel

    def _fold(self, offset: int, piece: torch.Tensor, weight: float, overwrite: bool,
              check: bool) -> float:
        """Fold one piece; with ``check``, return its sum of squares or raise `_StopFold`."""
        buf = self._buf[offset:offset + piece.numel()]
        same = piece.dtype == torch.float32 and piece.device == self.device
        if same and not check:
            # Same dtype: TensorIterator streams both operands, no temporary at all.
            if overwrite:
                torch.mul(piece, weight, out=buf)
            else:
                buf.add_(piece, alpha=weight)
            return 0.0
        # Otherwise convert a cache-sized chunk into the scratch and work from cache: the update
        # is read (and converted) once, the buffer once read and once written (only written when
        # overwriting). round(w·u) is the same number either way, so results do not depend on it.
        total = 0.0
        for begin, end in chunk_ranges(0, piece.numel()):
            src = piece[begin:end] if same else self._scratch[: end - begin].copy_(piece[begin:end])
            if check:
                sq = float(torch.dot(src, src))
                if not math.isfinite(sq):
                    raise _StopFold(begin)
                total += sq
            if overwrite:
                torch.mul(src, weight, out=buf[begin:end])
            else:
                buf[begin:end].add_(src, alpha=weight)
        return total

    def _unfold(self, done: list[tuple[int, torch.Tensor]], weight: float,
                overwrite: bool) -> None:
        """Take partially folded pieces out again (error path of `add_checked`)."""
        if overwrite:
            self._holds_sum = False  # nothing else was in the buffer: forget it entirely
            return
        for offset, piece in done:
            if piece.numel():
                self._fold(offset, piece, -weight, overwrite=False, check=False)

    def mean(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ w_i·u_i / Σ w_i.

        With ``out=None`` the buffer is divided **in place** and returned (no model-sized
        temporary); the accumulator then refuses further `add` calls until `reset`. Pass ``out``
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
        """Start a new sum, reusing the same buffer (zeroed lazily, see ``__init__``)."""
        self._holds_sum = False
        self._count = 0
        self._total_weight = 0.0
        self._dirty = False
