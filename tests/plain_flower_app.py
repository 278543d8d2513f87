"""A plain Flower ClientApp with no fl-geo code: the kind a Flower user already has.

It trains its own tiny bigram language model (an embedding and a linear head, not fl-geo's
decoder) on a synthetic Markov-chain token stream of its partition, and replies the Flower way:
the trained model in ``"arrays"`` and ``"num-examples"`` (plus ``"train_loss"``) in a MetricRecord.
The tests drive fl-geo's public strategies against it.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

VOCAB = 16
STEPS = 5
BATCH = 32


class BigramLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def initial_model(seed: int = 0) -> BigramLM:
    torch.manual_seed(seed)
    return BigramLM()


def batches(partition: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, next token) pairs of a fixed Markov chain: token t is followed by (3t + 1 + noise)."""
    g = torch.Generator().manual_seed(1000 * partition + seed)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (BATCH,), generator=g)
        noise = torch.randint(0, 2, (BATCH,), generator=g)
        out.append((x, (3 * x + 1 + noise) % VOCAB))
    return out


def loss_of(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        return float(sum(torch.nn.functional.cross_entropy(model(x), y) for x, y in data) / len(data))


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    model = BigramLM()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    lr = float(msg.content["config"].get("lr", 0.5)) if "config" in msg.content else 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    partition = int(context.node_config.get("partition-id", 0))
    rounds = int(context.state["progress"]["rounds"]) if "progress" in context.state else 0
    data = batches(partition, STEPS, seed=rounds)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    context.state["progress"] = ConfigRecord({"rounds": rounds + 1})
    metrics = MetricRecord({"num-examples": STEPS * BATCH, "train_loss": sum(losses) / len(losses)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Flower's centralised evaluation: loss on held-out batches (a partition no node trains on)."""
    model = BigramLM()
    model.load_state_dict(arrays.to_torch_state_dict())
    return MetricRecord({"loss": loss_of(model, batches(99, 4, seed=0))})
