"""Reading a train reply, shared by every strategy: one place decides what a valid reply is.

A reply must carry an ``arrays`` ArrayRecord (the update in the configured uplink precision, keys
and shapes of the model's ParamSpec; or, with ``wire.compress``, the arrays of a compressed payload) and a ``metrics`` MetricRecord with the keys the datacenter
client writes. Anything else is a :class:`ReplyError` whose message is what the server logs.
Finiteness is checked later, in the same pass that folds the values (fl_geo.core.accumulate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from flwr.app import Message, MetricRecord

from fl_geo.core.compress import Compressor
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.compressed import decompress_record
from fl_geo.runtime.protocol import TRAIN_METRICS_REQUIRED, ProtocolError, declaration_of
from fl_geo.runtime.wire import PayloadError, decode, payload_nbytes

# Metric keys a train reply must carry: the protocol's, which the client writes (TrainMetrics).
REPLY_METRICS = TRAIN_METRICS_REQUIRED


class ReplyError(ValueError):
    """A reply that cannot be used; the message says why."""


@dataclass
class TrainReply:
    """The parts of a valid train reply a strategy folds and counts."""

    pieces: list[tuple[int, torch.Tensor]]  # zero-copy views in wire precision (fl_geo.runtime.wire.decode)
    tokens: int
    loss: float
    step_time_s: float
    nbytes: int
    steps: int = 0  # inner steps the worker ran (A-EDiT's time budget makes them differ)
    noisy_steps: int = 0  # of them, steps on corrupted batches (data.noise_*; 0 otherwise)
    payload: str = "pseudo_grad"  # what ``pieces`` hold: pseudo_grad (Δ) or params (θ_worker)
    plain: bool = False  # a Flower-convention reply: ``tokens`` is its own num-examples / num-tokens claim


# A reported step time above this is a lie or a broken clock, not a slow accelerator.
MAX_STEP_TIME_S = 3600.0


def metric_number(metrics: MetricRecord, key: str) -> float:
    """A scalar metric as a float: an int or float (not a bool, list or string), finite."""
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyError(f"metric '{key}' must be a number, got {type(value).__name__} {value!r}"[:200])
    if not math.isfinite(value):
        raise ReplyError(f"metric '{key}' is {value}")
    return float(value)


def metric_whole(metrics: MetricRecord, key: str, low: int, high: int | None = None) -> int:
    """A count metric: a whole number in [low, high] (high None: no upper bound)."""
    value = metric_number(metrics, key)
    if value != int(value) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ReplyError(f"implausible metrics ({key}={metrics[key]!r}, must be a whole number {bound})")
    return int(value)


@dataclass
class ReplyMetrics:
    """The scalars of an fl-geo train reply, each checked (`read_reply_metrics`)."""

    tokens: int
    steps: int
    noisy_steps: int
    loss: float
    step_time_s: float


def read_reply_metrics(metrics: MetricRecord, expected_version: int | None = None, max_steps: int | None = None,
                       step_tokens: int | None = None) -> ReplyMetrics:
    """Check every scalar an fl-geo train reply carries before anything uses it; one place for
    every loop (synchronous, asynchronous, HALoS, streaming fragments, the sharded data path).

    ``tokens`` a positive whole number, at most ``steps`` × ``step_tokens`` (what the job could
    have produced: client.batch_size × client.seq_len × the site's devices; None trusts the
    claim); ``steps`` a whole number in [1, ``max_steps``] (the steps the job asked for);
    ``noisy_steps`` in [0, steps]; ``train_loss`` finite; ``step_time_s`` in [0,
    `MAX_STEP_TIME_S`]; ``base_version`` a whole number equal to ``expected_version`` (required
    when the loop knows the job's version).
    Anything else is a `ReplyError` naming the field (the loop logs and counts the rejection),
    never an exception that ends the run.
    """
    missing = [k for k in REPLY_METRICS if k not in metrics]
    if missing:
        raise ReplyError(f"reply metrics lack {missing}")
    if expected_version is not None and "base_version" not in metrics:
        raise ReplyError("reply metrics lack 'base_version' (the model version the job was sent)")
    if "base_version" in metrics:
        base_version = metric_whole(metrics, "base_version", -(2**63))  # any whole number; then it must be the job's
        if expected_version is not None and base_version != expected_version:
            raise ReplyError(f"reply says it trained from model version {base_version}, "
                             f"the job sent version {expected_version} (stale, replayed or from the future)")
    tokens = metric_whole(metrics, "tokens", 1)
    steps = metric_whole(metrics, "steps", 1, max_steps)
    if step_tokens is not None and tokens > steps * step_tokens:
        raise ReplyError(f"tokens={tokens} is more than {steps} steps can produce ({step_tokens} per step: "
                         "client.batch_size x client.seq_len x the site's devices; strategy.token_cap=none trusts it)")
    noisy = metric_whole(metrics, "noisy_steps", 0, steps) if "noisy_steps" in metrics else 0
    loss = metric_number(metrics, "train_loss")
    step_time = metric_number(metrics, "step_time_s")
    if not 0.0 <= step_time <= MAX_STEP_TIME_S:
        raise ReplyError(f"implausible metrics (step_time_s={step_time}, must be in [0, {MAX_STEP_TIME_S:g}])")
    return ReplyMetrics(tokens, steps, noisy, loss, step_time)


def read_train_reply(reply: Message, spec: ParamSpec, precision: str, expected_version: int | None = None,
                     max_steps: int | None = None, step_tokens: int | None = None,
                     compressor: Compressor | None = None) -> TrainReply:
    """Validate records, metrics (`read_reply_metrics`), keys, shapes, dtypes and sizes; decode
    without copying. With ``compressor`` the arrays are a compressed payload (wire.compress),
    decompressed into one fp32 Δ̂ of ``spec.numel`` (`fl_geo.runtime.compressed`); ``nbytes`` is
    then the payload's arrays as they travelled (.npy headers included, as for every payload).

    ``expected_version``: the model version the job was sent with. A reply that says it trained
    from another one (a stale reply replayed, or a version from the future) is refused: its
    staleness would be wrong, and so would everything weighted by it.
    """
    content = reply.content
    if "arrays" not in content.array_records or "metrics" not in content.metric_records:
        raise ReplyError("reply lacks the 'arrays' or 'metrics' record")
    m = read_reply_metrics(content.metric_records["metrics"], expected_version, max_steps, step_tokens)
    record = content.array_records["arrays"]
    try:
        if compressor is not None:
            pieces = [(0, decompress_record(record, compressor, spec.numel))]
        else:
            pieces = decode(record, spec, precision)
    except PayloadError as exc:
        raise ReplyError(str(exc)) from None
    return TrainReply(pieces, m.tokens, m.loss, m.step_time_s, payload_nbytes(record), m.steps, m.noisy_steps)


@dataclass
class Tally:
    """Scalars of the updates folded since the last outer step (no per-update model buffers)."""

    accepted: int = 0
    rejected: int = 0
    errors: int = 0
    tokens: int = 0
    loss_x_tokens: float = 0.0
    loss_tokens: int = 0  # tokens of the replies that reported a loss (the train/loss weights)
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
    late_folded: int = 0  # quorum rounds: replies of earlier rounds' jobs folded, dropped, failed
    late_dropped: int = 0
    late_failed: int = 0

    def accept(self, r: TrainReply, norm: float, staleness: int = 0) -> None:
        self.accepted += 1
        self.tokens += r.tokens
        if math.isfinite(r.loss):  # a plain Flower reply need not report a loss
            self.loss_x_tokens += r.loss * r.tokens
            self.loss_tokens += r.tokens
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


def _count(metrics: MetricRecord, key: str) -> int | None:
    """A declared count (``num-examples``, ``num-tokens``): a positive whole number, or None when
    absent; anything else (negative, fractional, NaN, a bool, a list) is a ReplyError."""
    if key not in metrics:
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyError(f"'{key}' must be a positive whole number, got {value!r}")
    if not math.isfinite(value) or value != int(value) or value <= 0:
        raise ReplyError(f"'{key}' must be a positive whole number, got {value!r}")
    return int(value)


def read_model_reply(reply: Message, spec: ParamSpec, base: torch.Tensor) -> TrainReply:
    """Read a Flower-convention reply: the trained model in ``"arrays"``, ``"num-examples"`` (and
    optionally ``"num-tokens"``, ``"loss"`` / ``"train_loss"``) in its MetricRecord.

    What a plain Flower ClientApp sends (Flower's own strategies expect the same). The server
    computes the pseudo-gradient Δ = base − θ_reply in fp32, ``base`` being the model the job was
    sent with. The token weight is ``num-tokens`` when declared, else ``num-examples``. Keys and
    shapes must match the model (any float dtype); NaN/Inf is refused later, in the fold.
    """
    content = reply.content
    if "arrays" not in content.array_records:
        raise ReplyError("Flower-convention reply lacks the 'arrays' record (the trained model)")
    records = list(content.metric_records.values())
    metrics = content.metric_records.get("metrics", records[0] if records else None)
    if metrics is None:
        raise ReplyError("Flower-convention reply lacks a MetricRecord with 'num-examples'")
    examples, tokens = _count(metrics, "num-examples"), _count(metrics, "num-tokens")
    if examples is None:
        raise ReplyError("Flower-convention reply lacks 'num-examples' in its metrics")
    record = content.array_records["arrays"]
    names = list(record.keys())
    if names != list(spec.names):
        missing, extra = sorted(set(spec.names) - set(names)), sorted(set(names) - set(spec.names))
        raise ReplyError(f"model keys differ from the model sent (missing {missing[:5]}, unexpected {extra[:5]})"
                         if missing or extra else "model keys are in another order than the model sent")
    delta = torch.empty(spec.numel, dtype=torch.float32)
    for name, offset, n, shape in zip(spec.names, spec.offsets, spec.numels, spec.shapes, strict=True):
        array = record[name]
        if tuple(array.shape) != shape:
            raise ReplyError(f"'{name}' has shape {tuple(array.shape)}, the model sent {shape}")
        if array.dtype not in ("float16", "float32", "float64"):
            raise ReplyError(f"'{name}' has dtype {array.dtype}; a model reply holds float16/32/64 arrays")
        try:
            theta = torch.from_numpy(array.numpy()).reshape(-1)
        except ValueError as exc:
            raise ReplyError(f"'{name}' does not decode: {exc}") from None
        torch.sub(base[offset : offset + n], theta.to(torch.float32), out=delta[offset : offset + n])
    loss = float("nan")
    for key in ("train_loss", "loss"):
        value = metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            loss = float(value)
            break
    return TrainReply([(0, delta)], tokens if tokens is not None else examples, loss, 0.0,
                      payload_nbytes(record), steps=0, plain=True)


def read_reply(reply: Message, spec: ParamSpec, precision: str, expected_version: int | None = None,
               base: torch.Tensor | None = None, payloads: tuple[str, ...] = ("pseudo_grad",),
               max_steps: int | None = None, step_tokens: int | None = None,
               compressor: Compressor | None = None) -> TrainReply:
    """Read a train reply by what it declares (fl_geo.runtime.protocol), never by guessing.

    A reply with fl-geo's ``"fl-geo"`` declaration must speak this protocol version, carry one of
    ``payloads`` in the agreed ``precision``, and is read by `read_train_reply`. ``compressor``:
    the run's compressed uplink (wire.compress): a ``pseudo_grad`` job's reply must then declare a
    ``compressed`` payload (an uncompressed one is refused: it is not what the run sends), which is
    decompressed here, so every loop that reads replies this way gets Δ̂ as fp32 pieces. A reply without
    one is a Flower-convention reply (the trained model and ``num-examples``): its Δ is taken
    against ``base``, the model the job was sent with; with no ``base`` kept it is refused.
    """
    try:
        decl = declaration_of(reply)
    except ProtocolError as exc:
        raise ReplyError(str(exc)) from None
    if decl is None:
        if base is None:
            raise ReplyError("the reply declares no fl-geo protocol (a Flower-convention reply), and the server kept "
                             "no copy of the model its job was sent with to compute the pseudo-gradient from")
        return read_model_reply(reply, spec, base)
    if compressor is not None and "pseudo_grad" in payloads:
        payloads = tuple("compressed" if p == "pseudo_grad" else p for p in payloads)
    if decl.payload not in payloads:
        raise ReplyError(f"the reply declares a {decl.payload!r} payload, this job asked for {' or '.join(payloads)}")
    if decl.precision != precision:
        raise ReplyError(f"the reply declares {decl.precision} arrays, the run's uplink is {precision}")
    compressed = decl.payload == "compressed"
    r = read_train_reply(reply, spec, precision, expected_version, max_steps, step_tokens,
                         compressor=compressor if compressed else None)
    r.payload = "pseudo_grad" if compressed else decl.payload
    return r


def require_declaration(reply: Message, payloads: tuple[str, ...]) -> None:
    """Replies that only fl-geo's ClientApp can give (streaming fragments, the sharded data path's
    control reply) must declare this protocol version and one of ``payloads``."""
    try:
        decl = declaration_of(reply)
    except ProtocolError as exc:
        raise ReplyError(str(exc)) from None
    if decl is None:
        raise ReplyError("the reply declares no fl-geo protocol: this method needs fl-geo's ClientApp")
    if decl.payload not in payloads:
        raise ReplyError(f"the reply declares a {decl.payload!r} payload, this job asked for {' or '.join(payloads)}")
