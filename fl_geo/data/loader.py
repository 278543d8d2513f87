"""Batches of next-token windows from a flat token stream.

Training batches are a pure function of ``(seed, stream, step)``: a datacenter client that is
restarted, preempted or handed a new schedule position by an asynchronous server reproduces exactly
the batch it would have seen, and nothing about the data order needs to be checkpointed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BatchSampler", "eval_batches"]


def _as_tensor(tokens: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(tokens, np.ndarray):
        tokens = torch.from_numpy(tokens)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    return tokens


def _check_length(tokens: torch.Tensor, seq_len: int, what: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"{what} has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for "
            "one (input, target) window; use a shorter seq_len or more data"
        )


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows of ``seq_len + 1`` tokens in one indexing op; targets are inputs shifted by one."""
    index = starts[:, None] + torch.arange(seq_len + 1)
    window = tokens[index].long()
    return window[:, :-1], window[:, 1:]


class BatchSampler:
    """Random training windows; ``batch(step)`` depends only on ``(seed, stream, step)``.

    ``stream`` separates samplers that share a seed (one per datacenter, or per worker), so they
    draw different windows from their own shards.
    """

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        stream: int = 0,
    ) -> None:
        self.tokens = _as_tensor(tokens)
        _check_length(self.tokens, seq_len, "the training stream")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0 or stream < 0:
            raise ValueError(f"seed and stream must be >= 0, got seed={seed}, stream={stream}")
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.stream = int(stream)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` LongTensors [batch_size, seq_len] for training step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, self.stream, int(step)])
        high = self.tokens.numel() - self.seq_len  # last valid start is numel - seq_len - 1
        starts = torch.from_numpy(rng.integers(0, high, size=self.batch_size, dtype=np.int64))
        return _windows(self.tokens, starts, self.seq_len)


def eval_batches(
    tokens: torch.Tensor | np.ndarray, seq_len: int, batch_size: int, max_batches: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic, non-overlapping validation windows, at most ``max_batches`` batches.

    When the stream holds more windows than requested, the windows are spread evenly over the whole
    stream rather than taken from its start: a held-out set is laid out group by group, and the
    first windows alone would measure only the first group. The last batch may be smaller.
    """
    stream = _as_tensor(tokens)
    _check_length(stream, seq_len, "the validation stream")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    available = (stream.numel() - 1) // seq_len
    wanted = available if max_batches is None else min(available, max_batches * batch_size)
    if wanted < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    chosen = torch.from_numpy(np.linspace(0, available - 1, wanted).round().astype(np.int64))
    starts = chosen * seq_len
    return [_windows(stream, part, seq_len) for part in starts.split(batch_size)]
