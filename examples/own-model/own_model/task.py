"""The model and the data: what a user of fl-geo brings themselves.

A character-level GRU language model, and text that every machine has offline: the docstrings of
Python's standard library, split into partitions by module so that each site sees its own topics
(non-IID, as datacenters with their own data would).
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil

import torch

VOCAB = 256  # bytes


class GRULanguageModel(torch.nn.Module):
    """Embedding -> 2-layer GRU -> linear head over bytes."""

    def __init__(self, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, d_model)
        self.gru = torch.nn.GRU(d_model, d_model, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(tokens))
        return self.head(hidden)


def make_model(seed: int = 0) -> GRULanguageModel:
    """Every node and the server build the same initial model from the same seed."""
    torch.manual_seed(seed)
    return GRULanguageModel()


_MODULES = ("json", "csv", "textwrap", "argparse", "collections", "functools", "itertools", "pathlib",
            "string", "heapq", "bisect", "statistics", "fractions", "decimal", "calendar", "difflib")


def _docstrings(module_name: str) -> str:
    module = importlib.import_module(module_name)
    parts = [module.__doc__ or ""]
    for name in sorted(dir(module)):
        doc = getattr(getattr(module, name, None), "__doc__", None)
        if isinstance(doc, str) and not name.startswith("_"):
            parts.append(doc)
    return "\n".join(parts)


def partition_text(partition_id: int, num_partitions: int) -> bytes:
    """The text of one partition: the modules whose name hashes to it."""
    names = [m for m in _MODULES if int(hashlib.sha256(m.encode()).hexdigest(), 16) % num_partitions == partition_id]
    return "\n".join(_docstrings(m) for m in names).encode("utf-8", "replace")


def heldout_text() -> bytes:
    """Text no partition trains on (for the server's evaluation)."""
    others = [m.name for m in pkgutil.iter_modules() if m.name in ("shlex", "fnmatch", "glob", "tempfile")]
    return "\n".join(_docstrings(m) for m in others).encode("utf-8", "replace")


def batch_at(text: bytes, step: int, batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of random windows (input, next byte) of ``text``.

    A pure function of (seed, step): a node that restarts, or a fresh process per message in a
    deployment, continues the same data order without keeping a sampler.
    """
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def loss_on(model: torch.nn.Module, text: bytes, batch_size: int = 16, seq_len: int = 64, count: int = 8) -> float:
    """Mean next-byte cross-entropy on ``count`` fixed windows of ``text``."""
    model.eval()
    with torch.no_grad():
        losses = []
        for i in range(count):
            x, y = batch_at(text, i, batch_size, seq_len, seed=1234)
            losses.append(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    return float(sum(losses) / len(losses))
