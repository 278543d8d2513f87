"""A user's own non-language model in fl-geo's client API: an MLP regression.

What a new user brings to a plain Flower app: a small ``torch.nn.Module`` whose update norms have
nothing to do with a language model's (4.8 k parameters, pseudo-gradient norms of order 1 per
outer step), mean-squared-error loss, and step-indexed batches of a fixed teacher
function plus noise, a different input distribution per partition (non-IID). Module level, so it
pickles. Used by tests/test_user_model_defaults.py to check that every public strategy's
*defaults* learn on it.
"""

from __future__ import annotations

import torch

from fl_geo.clients import Site, make_client_app

IN, HIDDEN, BATCH = 8, 64, 32


class MLP(torch.nn.Module):
    """8 → 64 → 64 → 1 with tanh: a regression model of 4.8 k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)])
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).squeeze(-1)


def initial_model(seed: int = 0) -> MLP:
    """The same initial model on every node and on the server."""
    torch.manual_seed(seed)
    return MLP()


def _teacher() -> torch.Tensor:
    return torch.randn(IN, generator=torch.Generator().manual_seed(1234)) / IN ** 0.5


def samples(partition: int, step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of partition ``partition``: y = sin(2 w·x) + 0.5 (w·x)² + noise; partition p
    draws x around a mean shifted by p (the held-out partition 99 is centred)."""
    g = torch.Generator().manual_seed(10_000 * partition + step)
    shift = 0.0 if partition == 99 else 0.3 * (partition - 1.5)
    x = torch.randn(batch, IN, generator=g) + shift
    s = x @ _teacher()
    y = torch.sin(2 * s) + 0.5 * s * s + 0.1 * torch.randn(batch, generator=g)
    return x, y


def heldout_loss(model: torch.nn.Module) -> float:
    """Mean-squared error on four fixed held-out batches."""
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in (samples(99, i) for i in range(4))]
    return float(sum(losses) / len(losses))


def mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output.float(), targets.float())


def model_fn(site: Site) -> torch.nn.Module:
    return initial_model(site.seed)


def batches_fn(site: Site):
    return lambda step: samples(site.partition_id, step, site.inner.batch_size)


def eval_batches_fn(site: Site):
    return [samples(99, i, site.inner.batch_size) for i in range(max(site.eval_batches, 1))]


app = make_client_app(model_fn, batches_fn, eval_batches_fn=eval_batches_fn, loss_fn=mse, blocks="layers")
