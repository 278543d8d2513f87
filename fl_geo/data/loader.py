"""Batches of next-token windows from a flat token stream.

Training batches are a pure function of ``(seed, stream, step)``: a datacenter client that is
restarted, preempted or handed a new schedule position by an asynchronous server reproduces exactly
the batch it would have seen, and nothing about the data order needs to be checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fl_geo.data.settings import NOISE_KINDS  # BatchNoise.kind (config: data.noise_kind)

__all__ = ["BatchNoise", "BatchSampler", "eval_batches"]

# Fixed extra seed words, so the noise draws never collide with the clean window draw
# ``default_rng([seed, stream, step])``.
_NOISE_DECISION = 0x6E6F6973  # "nois": corrupt/clean decision per block
_NOISE_CONTENT = 0x67617262  # "garb": the garbage itself, per step


@dataclass(frozen=True)
class BatchNoise:
    """Low-quality training batches in bursts (EDiT-style loss spikes).

    Steps are grouped in blocks of ``block``; each block is corrupted with probability
    ``fraction``. ``random``: uniform token ids in ``[0, vocab_size)``. ``shuffle``: the real
    windows with each sequence's tokens randomly permuted (same bytes, no order). ``shared``: the
    corrupt/clean decision ignores the sampler's stream, so every noisy partition is hit in the
    same blocks (a bad shard of a shared data pipeline reaching every site at once).
    """

    fraction: float
    kind: str
    block: int
    vocab_size: int
    shared: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"noise fraction must be in [0, 1], got {self.fraction}")
        if self.kind not in NOISE_KINDS:
            raise ValueError(f"noise kind must be one of {NOISE_KINDS}, got '{self.kind}'")
        if self.block < 1:
            raise ValueError(f"noise block must be >= 1, got {self.block}")
        if self.vocab_size < 1:
            raise ValueError(f"noise vocab_size must be >= 1, got {self.vocab_size}")


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
    window = _raw_windows(tokens, starts, seq_len)
    return window[:, :-1], window[:, 1:]


def _raw_windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[len(starts), seq_len + 1] LongTensor of the windows starting at ``starts``."""
    index = starts[:, None] + torch.arange(seq_len + 1)
    return tokens[index].long()


class BatchSampler:
    """Random training windows; ``batch(step)`` depends only on ``(seed, stream, step)``.

    ``stream`` separates samplers that share a seed (one per datacenter, or per worker), so they
    draw different windows from their own shards. With ``noise`` some steps' batches are replaced
    by garbage (:class:`BatchNoise`); which ones is again a pure function of ``(seed, stream,
    step)``, and a sampler without noise (or with fraction 0) draws exactly the clean batches.
    """

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        stream: int = 0,
        *,
        noise: BatchNoise | None = None,
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
        self.noise = noise

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` LongTensors [batch_size, seq_len] for training step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.is_noisy(step):
            return self._noisy_batch(int(step))
        return _windows(self.tokens, self._starts(int(step)), self.seq_len)

    def is_noisy(self, step: int) -> bool:
        """Whether ``batch(step)`` is corrupted: one draw per block of ``noise.block`` steps."""
        noise = self.noise
        if noise is None or noise.fraction <= 0.0:
            return False
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        block = int(step) // noise.block
        stream = 0 if noise.shared else self.stream
        rng = np.random.default_rng([self.seed, stream, block, _NOISE_DECISION])
        return bool(rng.random() < noise.fraction)

    def _starts(self, step: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, self.stream, step])
        high = self.tokens.numel() - self.seq_len  # last valid start is numel - seq_len - 1
        return torch.from_numpy(rng.integers(0, high, size=self.batch_size, dtype=np.int64))

    def _noisy_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = self.noise
        assert noise is not None
        rng = np.random.default_rng([self.seed, self.stream, step, _NOISE_CONTENT])
        shape = (self.batch_size, self.seq_len + 1)
        if noise.kind == "random":
            window = torch.from_numpy(rng.integers(0, noise.vocab_size, size=shape, dtype=np.int64))
        else:  # shuffle: the clean windows, each row's tokens in a random order
            clean = _raw_windows(self.tokens, self._starts(step), self.seq_len)
            order = torch.from_numpy(np.argsort(rng.random(shape), axis=1))
            window = torch.gather(clean, 1, order)
        return window[:, :-1], window[:, 1:]


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
