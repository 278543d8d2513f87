"""Server-side evaluation of the global model on held-out text.

The held-out set is the tail of every document (fl_geo.data), which no partition trains on, so the
figure is comparable across methods and partitionings. The evaluator keeps one model instance and
copies the flat global buffer into it: no model-sized allocation per evaluation.

Besides the loss in nats per token it reports bits per byte (`bits_per_byte`): the same summed
negative log-likelihood divided by the UTF-8 bytes the target tokens stand for, which does not
depend on how the text was cut into tokens, so byte-level and BPE runs compare fairly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fl_geo.config import FlGeoConfig
from fl_geo.core.state import ParamSpec, load_flat_into
from fl_geo.data import eval_batches
from fl_geo.inner.training import evaluate_loss
from fl_geo.runtime.builders import make_model, partitions, tokenizer


def target_bytes(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], token_bytes: np.ndarray) -> int:
    """UTF-8 bytes covered by every target token of ``batches`` (``token_bytes[id]`` per id)."""
    table = torch.from_numpy(np.asarray(token_bytes, dtype=np.int64))
    return int(sum(int(table[y.long().flatten()].sum()) for _, y in batches))


def bits_per_byte(loss: float, num_tokens: int, num_bytes: int) -> float:
    """Bits per byte of a mean token loss ``loss`` (nats) over ``num_tokens`` targets covering
    ``num_bytes`` bytes: (loss · num_tokens) / (ln 2 · num_bytes). Written as a ratio times the loss
    so that the byte tokenizer (num_tokens == num_bytes) gives exactly loss / ln 2."""
    if num_bytes <= 0 or not math.isfinite(loss):
        return float("nan")
    return loss * (num_tokens / num_bytes) / math.log(2)


class GlobalEvaluator:
    """Validation loss (nats per token; bytes with the byte tokenizer) of a flat parameter buffer."""

    def __init__(self, cfg: FlGeoConfig, num_partitions: int) -> None:
        self.model = make_model(cfg.model, cfg.run.seed)
        self.spec = ParamSpec.from_state_dict(self.model.state_dict())
        _, val_tokens = partitions(cfg.data, num_partitions)
        self.batches = eval_batches(val_tokens, cfg.client.seq_len, cfg.client.batch_size, cfg.run.eval_batches)
        self.num_tokens = sum(int(y.numel()) for _, y in self.batches)
        self.num_bytes = target_bytes(self.batches, tokenizer(cfg.data).token_bytes())

    def evaluate(self, flat: torch.Tensor) -> float:
        load_flat_into(self.model, flat, self.spec)
        return evaluate_loss(self.model, self.batches)

    def bpb(self, loss: float) -> float:
        """Bits per byte of a loss this evaluator measured."""
        return bits_per_byte(loss, self.num_tokens, self.num_bytes)

    def metrics(self, flat: torch.Tensor, step: int) -> dict[str, float]:
        """The outer loops' evaluator interface: ``val/loss``, ``val/ppl`` and ``val/bpb`` at any step."""
        loss = self.evaluate(flat)
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0)), "val/bpb": self.bpb(loss)}
