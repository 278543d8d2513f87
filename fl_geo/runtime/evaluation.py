"""Server-side evaluation of the global model on held-out text.

The held-out set is the tail of every document (fl_geo.data), which no partition trains on, so the
figure is comparable across methods and partitionings. The evaluator keeps one model instance and
copies the flat global buffer into it: no model-sized allocation per evaluation.
"""

from __future__ import annotations

import math

import torch

from fl_geo.config import FlGeoConfig
from fl_geo.core.state import ParamSpec, load_flat_into
from fl_geo.data import eval_batches
from fl_geo.inner.training import evaluate_loss
from fl_geo.runtime.builders import make_model, partitions


class GlobalEvaluator:
    """Validation loss (nats per token; bytes with the byte tokenizer) of a flat parameter buffer."""

    def __init__(self, cfg: FlGeoConfig, num_partitions: int) -> None:
        self.model = make_model(cfg.model, cfg.run.seed)
        self.spec = ParamSpec.from_state_dict(self.model.state_dict())
        _, val_tokens = partitions(cfg.data, num_partitions)
        self.batches = eval_batches(val_tokens, cfg.client.seq_len, cfg.client.batch_size, cfg.run.eval_batches)
        self.num_tokens = sum(int(y.numel()) for _, y in self.batches)

    def evaluate(self, flat: torch.Tensor) -> float:
        load_flat_into(self.model, flat, self.spec)
        return evaluate_loss(self.model, self.batches)

    def metrics(self, flat: torch.Tensor, step: int) -> dict[str, float]:
        """The outer loops' evaluator interface: ``val/loss`` and ``val/ppl`` at any step."""
        loss = self.evaluate(flat)
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
