"""Streaming weighted mean of model-sized updates with one fp32 buffer.

The asynchronous server (ALGORITHMS.md §5) folds every accepted reply into a running weighted
sum as it arrives, so server memory is O(1) in the number of workers: one fp32 buffer, whatever
``count`` becomes. Updates arrive in wire precision (fp32/fp16/bf16), either as one flat tensor
or as the ``(offset, tensor)`` pieces that `fl_geo.wire.decode` yields, one per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .state import CHUNK_ELEMS, chunk_ranges

__all__ = ["WEIGHT_KINDS", "WeightedAccumulator", "weight_for"]

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


class WeightedAccumulator:
    """Σ w_i·u_i and Σ w_i over streamed updates, holding exactly one fp32 buffer.

    Allocation happens once, at construction. Reduced-precision updates are converted chunk by
    chunk into a small fp32 scratch (`CHUNK_ELEMS` values) before the multiply-add: on CPU a
    mixed-dtype ``buf.add_(u_bf16, alpha=w)`` would materialise a full-size fp32 copy of ``u``
    (TensorIterator's CPU type promotion), i.e. one extra model-sized temporary per update.
    """

    def __init__(self, numel: int, device: str | torch.device = "cpu") -> None:
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        self.numel = int(numel)
        self.device = torch.device(device)
        self._buf = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        # The buffer is zeroed lazily: `reset` only clears this flag, and the first `add` after
        # it *writes* w·u instead of reading zeros back and adding (saves two passes per round).
        self._holds_sum = True
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
        untouched. Weights must be finite and positive.
        """
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
        for offset, piece in pieces:
            self._fold(offset, piece, weight, overwrite)
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

    def _fold(self, offset: int, piece: torch.Tensor, weight: float, overwrite: bool) -> None:
        buf = self._buf[offset:offset + piece.numel()]
        if piece.dtype == torch.float32 and piece.device == self.device:
            # Same dtype: TensorIterator streams both operands, no temporary at all.
            if overwrite:
                torch.mul(piece, weight, out=buf)
            else:
                buf.add_(piece, alpha=weight)
            return
        # Convert a cache-sized chunk into the scratch, then multiply-add from cache: the update is
        # read once from memory and the buffer once read and once written (only written when
        # overwriting). round(w·u) is the same number either way, so results do not depend on it.
        for begin, end in chunk_ranges(0, piece.numel()):
            scratch = self._scratch[: end - begin]
            scratch.copy_(piece[begin:end])
            if overwrite:
                torch.mul(scratch, weight, out=buf[begin:end])
            else:
                buf[begin:end].add_(scratch, alpha=weight)

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
