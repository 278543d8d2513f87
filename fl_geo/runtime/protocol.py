"""fl-geo's message protocol: one typed, versioned dataclass per request, validated on both sides.

Where things travel in a Flower ``Message`` (``docs/protocol.md`` has the full table):

- ``"fl-geo"`` (ConfigRecord): the fl-geo request, the fields of one dataclass below plus
  ``protocol`` (= `PROTOCOL_VERSION`);
- ``"config"`` (ConfigRecord): the *user's* Flower ``train_config`` / ``evaluate_config``, exactly
  what a plain Flower ClientApp reads with Flower's own strategies (empty when there is none);
- ``"arrays"`` (ArrayRecord): the model, in the request's ``wire_down`` precision (fp32 for a plain
  Flower ClientApp).

A reply from fl-geo's ClientApp declares itself in its own ``"fl-geo"`` ConfigRecord
(`ReplyDeclaration`: protocol version, what ``"arrays"`` holds, its precision) next to its
``"metrics"`` MetricRecord. A reply without that declaration is a Flower-convention reply: the
trained model in ``"arrays"`` and ``"num-examples"`` in its metrics (``strategies/replies.py``).

Why typed: a misspelled or missing field fails on the server when the dataclass is built (before
anything is sent), a client checks every field's presence and type and refuses unknown ones
(`ProtocolError`, which Flower turns into an error reply), and a peer of another protocol version
is told both versions in one line instead of failing somewhere deep in a handler.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, ClassVar, TypeVar

from flwr.app import ConfigRecord, Message, MetricRecord

from fl_geo.runtime.wire_settings import WIRE_PRECISIONS  # the one list the config checks too

# 2: the profile query may travel as a ``train`` message (`is_profile_probe`), which fl-geo's
# ClientApp answers with its profile and a plain Flower ClientApp with a trained model.
# 3: ``TrainRequest.keep_prev`` (keep the state from before this round) became ``checkpoint_step``
# (the server's newest checkpoint), so a node keeps its state from that checkpoint however many
# rounds ago it was (`fl_geo.clients.persist.rewind_to_round`).
PROTOCOL_VERSION = 3
PROTOCOL_KEY = "protocol"
REQUEST_RECORD = "fl-geo"  # the fl-geo request in a message; the reply's declaration in a reply
PROFILE_KEY = "profile"  # the ConfigRecord of a profile reply (`ProfileQuery`)
USER_CONFIG_RECORD = "config"  # the user's Flower train_config / evaluate_config
# Fields that hold JSON text (checked to parse on both sides).
JSON_FIELDS = frozenset({"client", "model", "data", "wire_compress", "wire_compress_down", "stream_apply", "stream_sync", "ps_addresses", "ps_shards",
                         "ps_push_order"})


class ProtocolError(ValueError):
    """A request or reply that does not follow the protocol; the message says which field and why."""


R = TypeVar("R", bound="Request")


@dataclass(frozen=True, kw_only=True)
class Request:
    """Base of every request: the message type it travels as, and the record codec."""

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name, value in self._values().items():
            _check(type(self), name, value)

    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_record(self) -> ConfigRecord:
        """The ConfigRecord a message carries under ``"fl-geo"`` (unset optional fields omitted)."""
        values = {k: v for k, v in self._values().items() if v is not None}
        return ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, **values})

    @classmethod
    def from_record(cls: type[R], record: ConfigRecord | None) -> R:
        """Validate a received record: protocol version, no unknown field, every required one
        present, every value of its declared type (JSON fields must parse)."""
        if record is None:
            raise ProtocolError(f"the message carries no '{REQUEST_RECORD}' record (an fl-geo request): is the "
                                "server an fl-geo strategy of a compatible version?")
        values = dict(record)
        version = values.pop(PROTOCOL_KEY, None)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"fl-geo protocol version {version!r} from the server, this client speaks "
                                f"{PROTOCOL_VERSION}: update the older side")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ProtocolError(f"{cls.__name__}: unknown field(s) {unknown}; valid: {', '.join(sorted(known))}")
        missing = sorted(n for n, f in known.items() if n not in values and _required(f))
        if missing:
            raise ProtocolError(f"{cls.__name__}: missing field(s) {missing}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(str(exc)) from None

    @classmethod
    def in_message(cls: type[R], msg: Message) -> R:
        """The request a received message carries (validated)."""
        if cls.MESSAGE_TYPES and msg.metadata.message_type not in cls.MESSAGE_TYPES:
            raise ProtocolError(f"{cls.__name__} travels as {cls.MESSAGE_TYPES}, not {msg.metadata.message_type!r}")
        return cls.from_record(msg.content.config_records.get(REQUEST_RECORD))


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check(cls: type, name: str, value: Any) -> None:
    """``value`` has the declared type of field ``name`` (bool is not an int here; an int is a
    fine float); JSON fields parse; wire precisions and counts are in range."""
    hint = _hints(cls)[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return
    ok = any(
        (t is bool and isinstance(value, bool))
        or (t is int and isinstance(value, int) and not isinstance(value, bool))
        or (t is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (t is str and isinstance(value, str))
        for t in allowed
    )
    if not ok:
        names = " | ".join("None" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
        raise ProtocolError(f"{cls.__name__}.{name} must be {names}, got {type(value).__name__} {value!r:.60}")
    if name in JSON_FIELDS and isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise ProtocolError(f"{cls.__name__}.{name} is not valid JSON") from None
    if name in ("wire_up", "wire_down") and value not in WIRE_PRECISIONS:
        raise ProtocolError(f"{cls.__name__}.{name} must be one of {WIRE_PRECISIONS}, got {value!r}")
    if name in ("inner_steps", "schedule_total", "threads", "round", "base_version", "stream_step", "stream_steps",
                "fragments", "tau", "H", "eval_batches", "start_step", "down_version", "down_from", "checkpoint_step") and value < 0:
        raise ProtocolError(f"{cls.__name__}.{name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class JobRequest(Request):
    """What every job for fl-geo's ClientApp carries: the run's sections and where it stands.

    ``client`` / ``model`` / ``data``: the run's sections as JSON (the server is the single source
    of truth: sites never read config files). ``schedule_total``: inner LR schedule length.
    ``threads``: torch threads the client may use. ``resumed``: the server resumed from a
    checkpoint (clients may reload their inner state from ``state_dir``). ``wire_compress``: the
    uplink's compression (JSON of `fl_geo.core.compress.CompressSettings`, from ``wire.compress``),
    absent when the uplink is not compressed; a ``pseudo_grad`` train reply is then a
    ``compressed`` payload (docs/compression.md).
    """

    run_name: str
    state_dir: str
    inner_steps: int
    schedule_total: int
    wire_up: str
    wire_down: str
    threads: int
    seed: int
    client: str
    model: str
    data: str
    round: int
    base_version: int
    resumed: bool = False
    wire_compress: str | None = None


@dataclass(frozen=True, kw_only=True)
class TrainRequest(JobRequest):
    """``train``: run ``inner_steps`` inner steps (or ``time_budget_s`` seconds, H as a cap) from
    the model in ``"arrays"`` and reply the update.

    ``send``: ``pseudo_grad`` (Δ = θ_sent − θ_local), ``params`` (θ_local) or ``grad`` (the
    data-parallel method ``ddp``: the gradient of the loss of one batch at θ_sent, no optimizer
    step and no clip; ``inner_steps`` is then 1, batch ``start_step`` is drawn and the site's
    inner optimizer state is not touched). ``start_step``: the schedule position under the global
    schedule clock (and the batch of a ``grad`` job). ``checkpoint_step``: the outer step of
    the server's newest checkpoint when it sent this round (absent: the run keeps no checkpoints);
    the node keeps the inner state its first round after that checkpoint started from, to which a
    server that resumes from it rewinds the node (`fl_geo.clients.persist`). ``ps_*``: the sharded parameter server's
    data path (follower addresses, shard bounds, push order, frame size, retry time, the CA
    certificate the followers are verified with, the job's id and its token, `fl_geo.ps.auth`).
    ``wire_compress_down`` (JSON of the downlink's `CompressSettings`, from ``wire.compress_down``;
    absent when the downlink is not compressed), ``down_version``: the version of the server's public
    model x̂ this job trains from, ``down_from``: the version the ``"arrays"`` deltas start from
    (``down_version − down_from`` payloads, none when equal), or absent: ``"arrays"`` is x̂ whole
    in ``wire_down`` precision (`fl_geo.core.downlink`, docs/compression.md).
    """

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ("train",)
    checkpoint_step: int | None = None
    time_budget_s: float = 0.0
    send: str = "pseudo_grad"
    start_step: int | None = None
    ps_job: str | None = None
    ps_addresses: str | None = None
    ps_shards: str | None = None
    ps_push_order: str | None = None
    ps_chunk_bytes: int | None = None
    ps_retry_s: float | None = None
    ps_tls_ca: str | None = None
    ps_token: str | None = None
    wire_compress_down: str | None = None
    down_version: int | None = None
    down_from: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.wire_compress_down is None) != (self.down_version is None):
            raise ProtocolError("TrainRequest.wire_compress_down and down_version come together")
        if self.down_from is not None and (self.down_version is None or self.down_from > self.down_version):
            raise ProtocolError(f"TrainRequest.down_from={self.down_from} needs a down_version at or after it, "
                                f"got {self.down_version}")
        if self.send not in ("pseudo_grad", "params", "grad"):
            raise ProtocolError(f"TrainRequest.send must be pseudo_grad, params or grad, got {self.send!r}")
        if self.send == "grad" and (self.inner_steps != 1 or self.start_step is None):
            raise ProtocolError("TrainRequest.send=grad is one step's gradient: it needs inner_steps=1 and a "
                                f"start_step (the batch), got inner_steps={self.inner_steps}, start_step={self.start_step}")


@dataclass(frozen=True, kw_only=True)
class StreamRequest(JobRequest):
    """``train.stream``: one tick of Streaming DiLoCo / CoCoDC: train ``stream_steps`` steps from
    schedule step ``stream_step``, first applying the new global fragments ``stream_apply`` (in
    ``"fragment.<p>"`` records) and then starting the syncs ``stream_sync``; the merge rule and
    its parameters (``stream_rule``, ``alpha``, ``lambda``, ``tau``, ``H``, ``fragments``). Each
    Δ_p is compressed per fragment when the request carries ``wire_compress`` (the run's
    ``wire.compress``, or ``streaming.quantize``'s alias of it). ``stream_keep``: keep the state
    this tick starts from (the server checkpointed at ``stream_step``); a resumed server that
    sends the tick of that step again finds the worker rewound to it."""

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ("train.stream",)
    stream_rule: str
    fragments: int
    alpha: float
    # ``lambda`` is a Python keyword: the dataclass field is ``lambda_`` and the record key ``lambda``.
    lambda_: float
    tau: int
    H: int
    stream_step: int
    stream_steps: int
    stream_apply: str
    stream_sync: str
    stream_keep: bool = False

    def to_record(self) -> ConfigRecord:
        record = super().to_record()
        record["lambda"] = record.pop("lambda_")
        return record

    @classmethod
    def from_record(cls, record: ConfigRecord | None) -> StreamRequest:
        if record is not None and "lambda" in record:
            record = ConfigRecord({("lambda_" if k == "lambda" else k): v for k, v in record.items()})
        return super().from_record(record)


@dataclass(frozen=True, kw_only=True)
class EvaluateRequest(JobRequest):
    """``evaluate``: the validation loss of the model in ``"arrays"`` on this site's held-out
    batches; ``evaluate.stream``: of the worker's own streaming model on ``eval_batches`` batches of
    the global held-out set."""

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ("evaluate", "evaluate.stream")
    eval_batches: int | None = None


@dataclass(frozen=True, kw_only=True)
class ProfileQuery(Request):
    """``query``: ask a node for its profile (partition, device, site); Flower's ``NodeInfo``
    carries no node config.

    It also travels as a ``train`` message, the *profile probe* (`is_profile_probe`), when the
    server does not know whether a node runs fl-geo's ClientApp: a plain Flower ClientApp has no
    ``query`` handler (Flower would log a traceback on the node), but it trains, so the probe
    carries a first train job's model and config too (fl_geo.runtime.profiling)."""

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ("query", "train")
    ask: str


def is_profile_probe(msg: Message) -> bool:
    """Whether ``msg`` is the profile query sent as a ``train`` message: its ``"fl-geo"`` record
    holds a `ProfileQuery` (the ``ask`` field, which no `TrainRequest` has)."""
    record = msg.content.config_records.get(REQUEST_RECORD)
    return msg.metadata.message_type == "train" and record is not None and "ask" in record


@dataclass(frozen=True, kw_only=True)
class BridgeRequest(Request):
    """HALoS deployment, global server -> a region's bridge ClientApp: exchange the global model
    (``global_version``) for the region's update, or ``stop``. ``resync``: the global server
    resumed from a checkpoint and this θ_g is its first to the region, or it is sent again after
    the region's exchange failed (its regional ServerApp restarting): the LPS merges it whatever
    its send state and gives up an update made before it (`LocalParameterServer.resync`)."""

    MESSAGE_TYPES: ClassVar[tuple[str, ...]] = ("train",)
    stop: bool
    global_version: int
    exchange_timeout_s: float
    connect_timeout_s: float
    resync: bool = False


@dataclass(frozen=True, kw_only=True)
class ReplyDeclaration(Request):
    """What an fl-geo ClientApp's reply says about itself: ``payload`` is what ``"arrays"`` holds
    (``pseudo_grad``: Δ; ``params``: θ_local; ``grad``: one batch's gradient at the model sent;
    ``control``: nothing, the update went over the sharded PS data path; ``fragments``: Streaming DiLoCo fragment updates; ``none``: no arrays;
    ``compressed``: Δ as the arrays of a `fl_geo.core.compress` payload, `fl_geo.runtime.compressed`),
    in ``precision``."""

    payload: str
    precision: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.payload not in ("pseudo_grad", "params", "grad", "control", "fragments", "none",
                                "compressed"):
            raise ProtocolError(f"ReplyDeclaration.payload {self.payload!r} is unknown")


@dataclass(frozen=True, kw_only=True)
class TrainMetrics:
    """The ``"metrics"`` record of an fl-geo train reply: the client writes it (`to_record`), the
    server reads the same keys (strategies/replies.py: `TRAIN_METRICS_REQUIRED` are the ones
    every reply must carry; the bounds each value must meet are the server's, `read_reply_metrics`). One list of
    keys: a field renamed here is renamed on both sides.

    ``tokens`` the job's training tokens (also written as Flower's ``num-examples``); ``steps``
    the inner steps run; ``train_loss`` / ``final_loss`` their mean and last loss;
    ``step_time_s`` / ``train_time_s`` the site's own timers; ``noisy_steps`` steps on
    deliberately corrupted batches (``data.noise_*``); ``base_version`` the model version the job
    was sent with (echoed: the server refuses a reply of another job). Sharded data path:
    ``ps_pushed_bytes`` / ``ps_version`` (the update went to the followers) and
    ``ps_pulled_bytes`` (the payload bytes the site received from them for this job). Streaming:
    ``stream_step`` (the tick answered) and the overlaps τ of the fragments applied. ``noop``: a
    bench client that trained nothing (fl_geo/bench/noop_client.py).
    """

    tokens: int
    steps: int
    train_loss: float
    step_time_s: float
    partition_id: int
    final_loss: float | None = None
    train_time_s: float | None = None
    noisy_steps: int = 0
    base_version: int | None = None
    ps_pushed_bytes: int | None = None
    ps_version: int | None = None
    ps_pulled_bytes: int | None = None
    stream_step: int | None = None
    overlap_count: int | None = None
    overlap_sum: int | None = None
    overlap_max: int | None = None
    overlap_min: int | None = None
    noop: int | None = None

    def to_record(self) -> MetricRecord:
        """The MetricRecord a reply carries (unset optional fields omitted; ``num-examples`` =
        ``tokens``, the key Flower's own strategies weight by)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return MetricRecord({**values, "num-examples": self.tokens})


# The keys every train reply's metrics must carry: the fields of TrainMetrics without a default.
TRAIN_METRICS_REQUIRED = tuple(f.name for f in fields(TrainMetrics) if _required(f))


def declaration_of(msg: Message) -> ReplyDeclaration | None:
    """The reply's declaration, or None for a Flower-convention reply (no ``"fl-geo"`` record).
    A declaration of another protocol version, or a malformed one, is a `ProtocolError`."""
    record = msg.content.config_records.get(REQUEST_RECORD)
    if record is None:
        return None
    version = record.get(PROTOCOL_KEY)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"the reply speaks fl-geo protocol version {version!r}, this server "
                            f"{PROTOCOL_VERSION}: update the older side")
    return ReplyDeclaration.from_record(record)


def user_config(config: ConfigRecord | None) -> ConfigRecord:
    """The user's Flower train/evaluate config for the ``"config"`` record (a copy; empty if None)."""
    return ConfigRecord(dict(config)) if config is not None else ConfigRecord()
