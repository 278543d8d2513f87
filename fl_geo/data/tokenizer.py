"""Tokenizers: UTF-8 bytes (the default), a byte-level BPE trained on the run's training text, or
a local ``tokenizer.json``.

Bytes make every corpus (code, Middle English, Latin-1 plays) representable without an
out-of-vocabulary path, and give the untrained-model loss a known value, ln 256 ≈ 5.55 nats.
The BPE and directory tokenizers live in :mod:`fl_geo.data.bpe` (the optional ``tokenizers``
package is imported only there). Every tokenizer exposes ``vocab_size``, ``encode``, ``decode``,
``eos_id`` (``None``: documents are concatenated without a separator), ``token_bytes()`` (the
number of UTF-8 bytes each id stands for, which bits per byte divides by) and ``sha256``, an
identity that server and clients compare so that no node trains on other token ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

__all__ = ["BYTE_TOKENIZER_SHA256", "ByteTokenizer", "Tokenizer"]

BYTE_TOKENIZER_SHA256 = hashlib.sha256(b"fl-geo byte tokenizer: UTF-8 bytes, vocabulary 256").hexdigest()


class Tokenizer(Protocol):
    """What the data pipeline, the evaluators and the ClientApps need from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    @property
    def sha256(self) -> str: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray | torch.Tensor | Iterable[int]) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    vocab_size: int = 256
    eos_id: int | None = None
    sha256: str = BYTE_TOKENIZER_SHA256

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

    def token_bytes(self) -> np.ndarray:
        """Every id is one byte."""
        return np.ones(self.vocab_size, dtype=np.int64)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"
