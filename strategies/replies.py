"""Reading a train reply, shared by every strategy: one place decides what a valid reply is.

A reply must carry an ``arrays`` ArrayRecord (the update in the configured uplink precision, keys
and shapes of the model's ParamSpec) and a ``metrics`` MetricRecord with the keys the datacenter
client writes. Anything else is a :class:`ReplyError` whose message is what the server logs.
Finiteness is checked later, in the same pass that folds the values (fl_geo.accumulate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from flwr.app import Message

from fl_geo.state import ParamSpec
from fl_geo.wire import PayloadError, decode, payload_nbytes

# Metric keys a train reply must carry (clients/datacenter.py writes them).
REPLY_METRICS = ("tokens", "steps", "train_loss", "step_time_s", "partition_id")


class ReplyError(ValueError):
    """A reply that cannot be used; the message says why."""


@dataclass
class TrainReply:
    """The parts of a valid train reply a strategy folds and counts."""

    pieces: list[tuple[int, torch.Tensor]]  # zero-copy views in wire precision (fl_geo.wire.decode)
    tokens: int
    loss: float
    step_time_s: float
    nbytes: int
    steps: int = 0  # inner steps the worker ran (A-EDiT's time budget makes them differ)
    noisy_steps: int = 0  # of them, steps on corrupted batches (data.noise_*; 0 otherwise)


def read_train_reply(reply: Message, spec: ParamSpec, precision: str, expected_version: int | None = None) -> TrainReply:
    """Validate records, metrics, keys, shapes, dtypes and sizes; decode without copying.

    ``expected_version``: the model version the job was sent with. A reply that says it trained
    from another one (a stale reply replayed, or a version from the future) is refused: its
    staleness would be wrong, and so would everything weighted by it.
    """
    content = reply.content
    if "arrays" not in content.array_records or "metrics" not in content.metric_records:
        raise ReplyError("reply lacks the 'arrays' or 'metrics' record")
    metrics = content.metric_records["metrics"]
    missing = [k for k in REPLY_METRICS if k not in metrics]
    if missing:
        raise ReplyError(f"reply metrics lack {missing}")
    if expected_version is not None and "base_version" in metrics and int(metrics["base_version"]) != expected_version:
        raise ReplyError(f"reply says it trained from model version {int(metrics['base_version'])}, "
                         f"the job sent version {expected_version} (stale, replayed or from the future)")
    tokens, loss = int(metrics["tokens"]), float(metrics["train_loss"])
    if tokens <= 0 or not math.isfinite(loss):
        raise ReplyError(f"implausible metrics (tokens={tokens}, train_loss={loss})")
    record = content.array_records["arrays"]
    try:
        pieces = decode(record, spec, precision)
    except PayloadError as exc:
        raise ReplyError(str(exc)) from None
    steps = int(metrics["steps"])
    if steps < 1:
        raise ReplyError(f"implausible metrics (steps={steps})")
    noisy = int(metrics["noisy_steps"]) if "noisy_steps" in metrics else 0
    return TrainReply(pieces, tokens, loss, float(metrics["step_time_s"]), payload_nbytes(record), steps, noisy)


@dataclass
class Tally:
    """Scalars of the updates folded since the last outer step (no per-update model buffers)."""

    accepted: int = 0
    rejected: int = 0
    errors: int = 0
    tokens: int = 0
    loss_x_tokens: float = 0.0
    step_time_sum: float = 0.0
    norm_sum: float = 0.0
    bytes_up: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    rejected_groups: int = 0  # penalty groups (modules) rejected, whole rejected updates included
    steps: int = 0
    noisy_steps: int = 0  # steps on corrupted batches in every valid reply, accepted or not
    noisy_steps_accepted: int = 0
    max_z: float = float("nan")  # largest outlier score this step (penalty only; NaN before warm-up)

    def accept(self, r: TrainReply, norm: float, staleness: int = 0) -> None:
        self.accepted += 1
        self.tokens += r.tokens
        self.loss_x_tokens += r.loss * r.tokens
        self.step_time_sum += r.step_time_s
        self.norm_sum += norm
        self.bytes_up += r.nbytes
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.steps += r.steps
        self.noisy_steps_accepted += r.noisy_steps

    def mean(self, total: float) -> float:
        """``total`` / accepted, NaN when nothing was accepted."""
        return total / self.accepted if self.accepted else float("nan")
