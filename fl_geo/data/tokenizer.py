"""Byte-level tokenizer: vocabulary 256, no training, no downloads.

Bytes make every corpus (code, Middle English, Latin-1 plays) representable without an
out-of-vocabulary path, and give the untrained-model loss a known value, ln 256 ≈ 5.55 nats.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a uint8 array (a copy, so callers may keep or mutate it)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: np.ndarray | torch.Tensor | bytes | Iterable[int]) -> str:
        """Text for ``tokens``; invalid UTF-8 (a window cut mid-character) becomes U+FFFD."""
        if isinstance(tokens, bytes | bytearray):
            return bytes(tokens).decode("utf-8", errors="replace")
        if isinstance(tokens, torch.Tensor):
            arr = tokens.detach().cpu().numpy()
        else:
            arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte tokens must lie in [0, 255]")
        data = arr.astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"
