"""A user's own model wrapped with fl-geo's client API (``fl_geo.clients.make_client_app``).

A tiny residual language model (not fl-geo's decoder) with its repeated blocks in ``layers``, so
Streaming DiLoCo / CoCoDC can cut fragments from them, and a step-indexed batch source over the
synthetic Markov-chain text of tests/plain_flower_app.py. Module level, so Ray actors and the
data-parallel job can pickle it.
"""

from __future__ import annotations

import torch

from fl_geo.clients import Site, make_client_app
from tests.plain_flower_app import VOCAB

SEQ = 8


class TinyResidualLM(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def initial_model(seed: int = 0) -> TinyResidualLM:
    torch.manual_seed(seed)
    return TinyResidualLM()


def sequences(partition: int, step: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of partition ``partition``: token t is followed by 3t + 1 (+ 0 or 1)."""
    g = torch.Generator().manual_seed(10_000 * partition + step)
    tokens = [torch.randint(0, VOCAB, (batch,), generator=g)]
    for _ in range(SEQ):
        tokens.append((3 * tokens[-1] + 1 + torch.randint(0, 2, (batch,), generator=g)) % VOCAB)
    window = torch.stack(tokens, dim=1)
    return window[:, :-1], window[:, 1:]


def heldout_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                  for x, y in (sequences(99, i) for i in range(4))]
    return float(sum(losses) / len(losses))


def model_fn(site: Site) -> torch.nn.Module:
    return initial_model(site.seed)


def batches_fn(site: Site):
    return lambda step: sequences(site.partition_id, step)


def eval_batches_fn(site: Site):
    return [sequences(99, i) for i in range(max(site.eval_batches, 1))]


app = make_client_app(model_fn, batches_fn, eval_batches_fn=eval_batches_fn, blocks="layers")
