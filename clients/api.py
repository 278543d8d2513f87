"""Wrap any torch model as an fl-geo datacenter ClientApp (``from fl_geo.clients import ...``).

A researcher brings four things: a model factory, a batch source per partition, and optionally
an inner optimizer and a loss. `make_client_app` (or `DatacenterClient(...).app`) turns them
into a Flower ``ClientApp`` that speaks fl-geo's protocol with every method's server: the
``query`` profile, ``train`` (DiLoCo, A-EDiT's time budget, async methods, Di-PS / sharded PS,
HALoS), ``train.stream`` (Streaming DiLoCo / CoCoDC fragments cut from the user's own blocks),
``evaluate`` and ``evaluate.stream``. fl-geo's built-in decoder on its corpus is one user of this
API (clients/datacenter.py).

What the wrapper owns, so a user's code never has to: the received model is decoded against the
user model's own `ParamSpec` (wrong keys, shapes, dtypes or a non-finite value: an error reply),
the inner optimizer state and schedule position survive rounds in ``context.state`` (and on disk
for a resumed server, clients/persist.py), the device (``cpu|cuda|cuda:N|npu|mps|auto``, node
config ``device`` overriding the run's) and bf16 autocast, the multi-device data-parallel job
(fl_geo.inner.distributed), token accounting and the reply's metrics.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.clients.downlink import receive_public
from fl_geo.clients.parallel import parallel_trainer, release, site_nodes
from fl_geo.clients.persist import (  # noqa: F401  (the state keys are re-exported: tools import them from here)
    EF_RESIDUAL_KEY,
    INNER_STATE_KEYS,
    OPT_STATE_KEY,
    PREV_OPT_STATE_KEY,
    PREV_PROGRESS_KEY,
    PROGRESS_KEY,
    keeps_state_for,
    kept_progress,
    load_inner_state,
    opt_from_record,
    opt_record,
    progress_record,
    rewind_to_round,
    save_inner_state,
    start_opt_state,
    state_file,
)
from fl_geo.clients.profile import first_device, partition_ids, profile_probe_mod, profile_reply
from fl_geo.clients.ps_transfer import has_followers, pull_model, push_update
from fl_geo.clients.site import Site, as_batch_source
from fl_geo.clients.uplink import compress_uplink, keep_prev_residual
from fl_geo.core.state import ParamSpec, flatten, load_flat_into, pseudo_grad
from fl_geo.core.streaming_fragments import Fragments, fragment_spec
from fl_geo.inner.device import pick_device
from fl_geo.inner.hf import tied_aliases
from fl_geo.inner.training import (
    BatchSource,
    InnerTrainer,
    LossFn,
    OptimizerFn,
    ScheduleFn,
    TokensFn,
    TrainResult,
    evaluate_loss,
    lr_at,
    target_tokens,
)
from fl_geo.runtime import protocol
from fl_geo.runtime.builders import inner_config
from fl_geo.runtime.wall_faults import wall_fault_mod
from fl_geo.runtime.wire import check_finite_and_norm, decode_into, encode

__all__ = [
    "INNER_STATE_KEYS",
    "OPT_STATE_KEY",
    "PROGRESS_KEY",
    "BlocksFn",
    "DatacenterClient",
    "make_client_app",
    "request_of",
    "rewind_to_round",
]

log = logging.getLogger("fl_geo")

ModelFn = Callable[[Site], torch.nn.Module]
BatchesFn = Callable[[Site], Any]  # -> BatchSource | (step -> batch) | re-iterable of batches
EvalBatchesFn = Callable[[Site], Iterable[tuple[Any, Any]]]
# The model's repeated blocks in depth order, as parameter-name groups; or the dotted path of
# its block container (an nn.ModuleList such as "layers" or "encoder.layers").
BlocksFn = Callable[[torch.nn.Module], Sequence[Sequence[str]]]

_MODEL_CACHE = 2  # models kept per ClientApp process (a run needs one; two spare a rebuild)


# Message type -> the typed request it carries (fl_geo.runtime.protocol).
_REQUESTS: dict[str, type[protocol.Request]] = {
    "train": protocol.TrainRequest,
    "train.stream": protocol.StreamRequest,
    "evaluate": protocol.EvaluateRequest,
    "evaluate.stream": protocol.EvaluateRequest,
    "query": protocol.ProfileQuery,
}


def request_of(msg: Message) -> Any:
    """The fl-geo request a message carries (one place to read it from), as its typed dataclass
    (fl_geo.runtime.protocol: `TrainRequest`, `StreamRequest`, `EvaluateRequest`), validated:
    protocol version, no unknown field, every required one present and of its type; a
    `ProtocolError` otherwise, which Flower turns into an error reply. Handlers read its fields,
    never the raw record, so a field's default lives in one place: the dataclass."""
    kind = _REQUESTS.get(msg.metadata.message_type)
    if kind is None:
        raise protocol.ProtocolError(f"no fl-geo request travels as message type {msg.metadata.message_type!r}")
    return kind.from_record(msg.content.config_records.get(protocol.REQUEST_RECORD))


def declared(records: dict[str, Any], payload: str, precision: str) -> dict[str, Any]:
    """``records`` plus the reply's ``"fl-geo"`` declaration (what ``"arrays"`` holds, in which
    precision): the server reads a declared reply as fl-geo's, an undeclared one as Flower's."""
    decl = protocol.ReplyDeclaration(payload=payload, precision=precision).to_record()
    return {**records, protocol.REQUEST_RECORD: decl}


def set_threads(req: protocol.JobRequest) -> None:
    """Use the torch threads the server allots this job (``threads``)."""
    threads = req.threads
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def blocks_of(model: torch.nn.Module, blocks: str | BlocksFn) -> list[list[str]]:
    """The model's blocks as parameter-name groups (depth order), from a container path or a
    callable; names are state-dict names (the layout the wire uses)."""
    if callable(blocks):
        return [list(group) for group in blocks(model)]
    container = model.get_submodule(blocks)
    groups = []
    for child_name, child in container.named_children():
        prefix = f"{blocks}.{child_name}."
        groups.append([prefix + name for name in child.state_dict()])
    if not groups:
        raise ValueError(f"the model's {blocks!r} has no child modules to use as blocks")
    return groups


def train_metrics(result: TrainResult, train_time: float, pid: int, noisy_steps: int, **extra: int) -> MetricRecord:
    """The ``"metrics"`` record of a train reply (`protocol.TrainMetrics`; ``extra``: e.g. ``base_version``)."""
    return protocol.TrainMetrics(
        tokens=int(result.tokens),
        steps=int(result.steps),
        train_loss=float(result.mean_loss),
        final_loss=float(result.final_loss),
        step_time_s=float(result.step_time_s),
        train_time_s=float(train_time),
        partition_id=pid,
        noisy_steps=int(noisy_steps),  # batches replaced by data.noise_* garbage in this job
        **extra,
    ).to_record()


def noisy_steps(source: BatchSource, start: int, steps: int) -> int:
    """How many of the steps drew a deliberately corrupted batch (sources with ``is_noisy``)."""
    is_noisy = getattr(source, "is_noisy", None)
    return 0 if is_noisy is None else sum(bool(is_noisy(start + i)) for i in range(steps))


# The constructor is generated from the fields below (the user's code, two positional, the rest
# keyword-only). eq/repr off: a client is compared, hashed and shown by identity like any object.
@dataclass(eq=False, repr=False)
class DatacenterClient:
    """A user's model, data, optimizer and loss as fl-geo's datacenter ClientApp (:attr:`app`).

    ``model_fn(site)``: builds the model, with the same initial values on every node for the same
    ``site.seed`` (the server's global model has the same layout; the received parameters
    overwrite the initial ones). Called once per process and model (cached).
    ``batches_fn(site)``: this partition's training batches as an object with
    ``batch(step) -> (inputs, targets)``, a callable ``step -> (inputs, targets)`` or a
    re-iterable of batches. Step-indexed so the data order continues across rounds; the inner
    loop draws batch ``s`` at schedule position ``s``.
    ``eval_batches_fn(site)``: held-out batches for the evaluate handlers (``site.eval_scope``
    says whose: this partition's or the global set; ``site.eval_batches`` how many); without it
    an evaluate message gets an error reply.
    ``optimizer_fn(model, inner)``: the inner optimizer (default: ``client.optimizer``'s, fl-geo's
    AdamW or Muon + AdamW, `fl_geo.inner.muon`). Its per-parameter state is kept across rounds
    whatever it is. The data-parallel job (``client.devices > 1``) needs the default.
    ``lr_schedule(step, inner)``: the learning rate set on every group each step (default: the
    warm-up / cosine schedule of the run's ``client`` section); ``None`` leaves it to the
    optimizer.
    ``loss_fn(output, targets)``: default next-token cross-entropy on logits (B, T, V).
    ``tokens_fn(inputs, targets)``: the tokens a batch counts for (default ``targets.numel()``).
    ``blocks``: the model's repeated blocks, which Streaming DiLoCo / CoCoDC stride into
    fragments: a container path (``"layers"``) or ``model -> [[names of block 0], …]``; default:
    every top-level ``<list>.<int>`` module, as for fl-geo's decoder.

    For the data-parallel job every callable must be picklable (module-level functions).
    """

    model_fn: ModelFn
    batches_fn: BatchesFn
    _: KW_ONLY
    eval_batches_fn: EvalBatchesFn | None = None
    optimizer_fn: OptimizerFn | None = None
    lr_schedule: ScheduleFn | None = lr_at
    loss_fn: LossFn | None = None
    tokens_fn: TokensFn | None = None
    blocks: str | BlocksFn | None = None

    def __post_init__(self) -> None:
        """The caches and the ClientApp with every handler registered (the user's code above is
        only called from the handlers)."""
        self._models: OrderedDict[str, tuple[torch.nn.Module, ParamSpec]] = OrderedDict()
        self._fragments: OrderedDict[tuple[str, int], tuple[Fragments, tuple[ParamSpec, ...]]] = OrderedDict()
        self.pulled_version = -1  # the model version the last pull from the follower PSs returned
        self.pulled_bytes = 0  # and the payload bytes it received (the reply reports both)
        # run.wall_faults: a job the failure trace ends is answered with an error at the failure;
        # the profile probe (a train message, clients="auto") is answered before any handler
        self.app = ClientApp(mods=[wall_fault_mod, profile_probe_mod])
        self.app.query()(self.query)
        self.app.train()(self.train)
        self.app.evaluate()(self.evaluate)
        from fl_geo.clients import stream  # the streaming handlers (they use this class)

        self.app.train("stream")(functools.partial(stream.train_stream, self))
        self.app.evaluate("stream")(functools.partial(stream.evaluate_stream, self))

    # ---------------------------------------------------------------- per-message set-up

    def site(self, req: protocol.JobRequest, context: Context, msg: Message | None = None) -> Site:
        """The `Site` of a message: node partition, run seed, inner settings and sections, and
        the user's own Flower train / evaluate config (the message's ``"config"`` record)."""
        pid, nparts = partition_ids(context)
        user = msg.content.config_records.get(protocol.USER_CONFIG_RECORD) if msg is not None else None
        sections = {key: json.loads(getattr(req, key)) for key in ("model", "data", "client")}
        return Site(
            partition_id=pid,
            num_partitions=nparts,
            seed=req.seed,
            inner=inner_config(sections["client"], req.schedule_total),
            sections=sections,
            node_config=dict(context.node_config),
            run_config=dict(context.run_config),
            config=dict(user) if user is not None else {},
        )

    def device(self, site: Site) -> torch.device:
        """Node config ``device`` (e.g. ``--node-config 'device="cuda:1"'``), else the run's."""
        return pick_device(first_device(str(site.node_config.get("device", site.inner.device))))

    def model(self, site: Site) -> tuple[torch.nn.Module, ParamSpec]:
        """The cached model of this site's run and its spec (what the wire is checked against)."""
        key = site.model_key()
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        model = self.model_fn(site)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
        state = model.state_dict()
        tied = [(alias, source) for alias, source in tied_aliases(model).items() if alias in state and source in state]
        if tied:  # two names, one tensor: the flat state would hold (and average, clip) it twice
            raise ValueError(f"the model's {tied[0][0]} is {tied[0][1]} (tied weights): wrap the model with "
                             "fl_geo.clients.causal_lm so its state dict holds the tensor once")
        entry = (model, ParamSpec.from_state_dict(state))
        self._models[key] = entry
        while len(self._models) > _MODEL_CACHE:
            self._models.popitem(last=False)
        return entry

    def fragments(self, site: Site, num_fragments: int) -> tuple[Fragments, tuple[ParamSpec, ...]]:
        """`Fragments` of the user's blocks and the per-fragment specs (cached)."""
        key = (site.model_key(), num_fragments)
        if key not in self._fragments:
            model, spec = self.model(site)
            if self.blocks is None:
                fragments = Fragments(spec, num_fragments)
            else:
                fragments = Fragments.from_blocks(spec, num_fragments, blocks_of(model, self.blocks))
            self._fragments[key] = (fragments, tuple(fragment_spec(fragments, p) for p in range(num_fragments)))
            while len(self._fragments) > 2 * _MODEL_CACHE:
                self._fragments.popitem(last=False)
        return self._fragments[key]

    def receive_model(self, msg: Message, req: protocol.JobRequest, spec: ParamSpec, out: torch.Tensor,
                      state: RecordDict | None = None) -> torch.Tensor:
        """The received global model (``wire.compress_down``: the server's public model, whole or as
        deltas of the one in ``state``, `fl_geo.clients.downlink`) decoded into ``out``; wrong keys,
        shapes or precision, or a NaN/±Inf (training would only send garbage back), are refused."""
        if has_followers(req):  # sharded Di-PS: the model comes over the data path, not in the message
            self.pulled_version, self.pulled_bytes = pull_model(req, out, state)
        elif getattr(req, "wire_compress_down", None) is not None and state is not None:
            receive_public(state, msg.content.array_records.get("arrays"), req, spec, out)
        else:
            if "arrays" not in msg.content.array_records:
                raise ValueError("the message carries no model ('arrays')")
            decode_into(msg.content.array_records["arrays"], spec, req.wire_down, out=out)
        check_finite_and_norm([(0, out)], spec)
        return out

    def trainer(self, model: torch.nn.Module, site: Site) -> InnerTrainer:
        return InnerTrainer(model, site.inner, optimizer_fn=self.optimizer_fn, loss_fn=self.loss_fn,
                            lr_schedule=self.lr_schedule, tokens_fn=self.tokens_fn)

    def batches(self, site: Site) -> BatchSource:
        return as_batch_source(self.batches_fn(site))

    def eval_batches(self, site: Site) -> list[tuple[Any, Any]]:
        if self.eval_batches_fn is None:
            raise RuntimeError("this ClientApp has no held-out batches (make_client_app(eval_batches_fn=...))")
        batches = list(self.eval_batches_fn(site))
        if not batches:
            raise RuntimeError("eval_batches_fn gave no batches")
        return batches

    def eval_reply(self, msg: Message, model: torch.nn.Module, batches: list[tuple[Any, Any]], **extra: int) -> Message:
        """``val_loss`` and ``val_tokens`` (what `OuterLoop.collect_val_losses` reads;
        ``num-examples`` too, Flower's weighting key) of ``model`` on ``batches``, plus ``extra``."""
        tokens_of = self.tokens_fn or target_tokens
        loss = evaluate_loss(model, batches, loss_fn=self.loss_fn, tokens_fn=self.tokens_fn)
        tokens = sum(int(tokens_of(x, y)) for x, y in batches)
        metrics = MetricRecord({"val_loss": float(loss), "val_tokens": tokens, "num-examples": tokens, **extra})
        return Message(RecordDict(declared({"metrics": metrics}, "none", "fp32")), reply_to=msg)

    # ---------------------------------------------------------------- handlers

    def query(self, msg: Message, context: Context) -> Message:
        """Tell the server who we are: partition, device and site (`profile_reply`)."""
        return profile_reply(msg, context)

    def _single(self, msg: Message, req: protocol.TrainRequest, site: Site,
                state: RecordDict | None = None) -> tuple[InnerTrainer, ParamSpec, torch.Tensor]:
        model, spec = self.model(site)
        base = self.receive_model(msg, req, spec, torch.empty(spec.numel, dtype=torch.float32), state)
        load_flat_into(model, base, spec)
        model.to(self.device(site))
        return self.trainer(model, site), spec, base

    def _data_parallel(self, msg: Message, req: protocol.TrainRequest, site: Site, count: int,
                       state: RecordDict) -> tuple[Any, ParamSpec, torch.Tensor]:
        """A data-parallel job of ``count`` ranks, spawned or the node's site group (`fl_geo.clients.parallel`).
        No trainable model here: the received model is decoded straight into the job's shared
        parameter buffer (rank 0 writes θ_local back into it); ``base`` keeps θ_global."""
        trainer = parallel_trainer(self, req, site, count)
        try:
            self.receive_model(msg, req, trainer.shared.spec, trainer.params, state)
        except BaseException:
            release(trainer)
            raise
        return trainer, trainer.shared.spec, trainer.params.clone()

    def train(self, msg: Message, context: Context) -> Message:
        """Run the inner loop from the received global model; reply with the pseudo-gradient.

        One process by default. With ``client.devices`` (or node config ``devices``) > 1 the inner
        loop runs as a data-parallel job across the site's devices (fl_geo.inner.distributed,
        docs/multidevice.md), each rank with batch ``client.batch_size``; the state handling and
        the reply are the same. (The streaming handler ``train.stream`` always runs in one process.)
        """
        req: protocol.TrainRequest = request_of(msg)
        set_threads(req)
        site = self.site(req, context, msg)
        # Processes for this site's inner loop: node config ``devices`` (a site knows its
        # hardware), else ``client.devices``; a client section without the key means one.
        count = int(context.node_config.get("devices", site.sections["client"].get("devices", 1)))
        nodes = site_nodes(site)  # a site of several nodes: node 0 coordinates (fl_geo.clients.parallel)
        if req.send == "grad":
            return self._gradient(msg, req, site, count * nodes)
        trainer: Any
        if count > 1 or nodes > 1:
            trainer, spec, base = self._data_parallel(msg, req, site, count, context.state)
        else:
            trainer, spec, base = self._single(msg, req, site, context.state)
        try:
            return self._train(msg, context, req, site, trainer, spec, base)
        finally:
            release(trainer)  # a site group's lock (fl_geo.clients.parallel)

    def _train(self, msg: Message, context: Context, req: protocol.TrainRequest, site: Site, trainer: Any,
               spec: ParamSpec, base: torch.Tensor) -> Message:
        """`train` from a trainer holding the received model: state in, inner loop, state out, reply."""
        state = context.state
        pid = site.partition_id
        disk = state_file(context, req, pid)
        if disk is not None and req.resumed and PROGRESS_KEY not in state.config_records:
            load_inner_state(state, disk)  # a restarted server is a new Flower run: context.state is empty
        rewind_to_round(state, req)
        keep = keeps_state_for(state, req)  # the node's first round since the server's newest checkpoint
        start_opt = start_opt_state(state, trainer.optimizer_kind)
        if start_opt is not None:
            trainer.load_optimizer_state(opt_from_record(start_opt))
        progress = state.config_records.get(PROGRESS_KEY, ConfigRecord({"step": 0, "rounds": 0}))
        start_progress = progress
        # schedule_clock (docs/algorithms.md §1): "local" continues our own step count; asynchronous
        # strategies send a global position so a slow worker does not linger at a high learning rate.
        local_step = int(progress["step"])
        start_step = local_step if req.start_step is None else req.start_step

        source = self.batches(site)
        t0 = time.perf_counter()
        # (A-EDiT: train for time_budget_s seconds, H a cap)
        result = trainer.train(source, req.inner_steps, start_step, time_budget_s=req.time_budget_s)
        train_time = time.perf_counter() - t0
        noisy = noisy_steps(source, start_step, result.steps)

        # One process: copy the trained model out. Data-parallel: rank 0 wrote it into shared memory.
        local = flatten(trainer.model.state_dict(), spec) if isinstance(trainer, InnerTrainer) else trainer.params
        update = local
        if req.send != "params":
            # (with send=params, Di-PS's "current" base of Algorithm 1 line 10, the server subtracts
            # from its own current model, so the worker ships its parameters)
            update = pseudo_grad(base, local, out=local)  # reuse the local buffer: no extra model copy
        start_residual = state.array_records.get(EF_RESIDUAL_KEY)
        records, pushed, payload = self._reply_update(state, req, spec, update)

        if keep:
            # What this round started from, the node's state at the server's newest checkpoint (the
            # same objects, no copy): a server resumed from that checkpoint that sends this round
            # again gets the same result (rewind_to_round).
            if start_opt is not None:
                state[PREV_OPT_STATE_KEY] = start_opt
            elif PREV_OPT_STATE_KEY in state.array_records:
                del state[PREV_OPT_STATE_KEY]
            keep_prev_residual(state, start_residual)
            state[PREV_PROGRESS_KEY] = kept_progress(start_progress, req)
        state[OPT_STATE_KEY] = opt_record(trainer)
        state[PROGRESS_KEY] = progress_record(local_step + result.steps, int(progress["rounds"]) + 1,
                                              trainer.optimizer_kind, last_round=req.round)
        if disk is not None:
            save_inner_state(state, INNER_STATE_KEYS, disk)

        metrics = train_metrics(result, train_time, pid, noisy, base_version=req.base_version, **pushed)
        records = declared(records, payload, req.wire_up)
        return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)

    def _reply_update(self, state: RecordDict, req: protocol.TrainRequest, spec: ParamSpec,
                      update: torch.Tensor) -> tuple[dict[str, Any], dict[str, int], str]:
        """What a train reply carries for ``update`` and the payload it declares: control only
        when the update went to the follower PSs; with ``wire.compress`` a compressed payload
        with error feedback (`fl_geo.clients.uplink`); else the update at the wire precision."""
        if has_followers(req):
            return {}, {"ps_pushed_bytes": push_update(req, update, state), "ps_version": self.pulled_version,
                        "ps_pulled_bytes": self.pulled_bytes}, "control"
        if req.wire_compress is not None and req.send == "pseudo_grad":
            return {"arrays": compress_uplink(state, req, update)}, {}, "compressed"
        return {"arrays": encode(update, spec, req.wire_up)}, {}, req.send

    def _gradient(self, msg: Message, req: protocol.TrainRequest, site: Site, count: int) -> Message:
        """A ``grad`` job (the data-parallel method ``ddp``): the gradient of the loss of batch
        ``start_step`` of this site at the received model, in the uplink precision
        (`InnerTrainer.gradient`). No optimizer step and no state: the server averages every
        site's gradient and takes the one AdamW step (`fl_geo.inner.large_batch`), so this node's
        ``context.state`` is neither read nor written.

        The server's step is fl-geo's inner AdamW and schedule: a ClientApp built with its own
        ``optimizer_fn`` or ``lr_schedule`` would be stepped by another optimizer than it declares,
        and a multi-device site runs its data-parallel job for whole inner loops only; both are
        refused with an error reply.
        """
        if self.optimizer_fn is not None or self.lr_schedule is not lr_at:
            raise ValueError("strategy ddp steps fl-geo's inner AdamW and lr_at schedule at the server: a ClientApp "
                             "with its own optimizer_fn or lr_schedule cannot take part")
        if count > 1:
            raise ValueError(f"strategy ddp computes each site's gradient in one process; this site runs {count} "
                             "ranks (client.devices x client.nodes, or node config devices and nodes): set them to 1")
        trainer, spec, _ = self._single(msg, req, site)
        source = self.batches(site)
        assert req.start_step is not None  # TrainRequest refuses send=grad without one
        step = req.start_step
        grad = torch.empty(spec.numel, dtype=torch.float32)
        t0 = time.perf_counter()
        result = trainer.gradient(source, step, spec.names, grad)
        train_time = time.perf_counter() - t0
        metrics = train_metrics(result, train_time, site.partition_id, noisy_steps(source, step, 1),
                                base_version=req.base_version)
        records = declared({"arrays": encode(grad, spec, req.wire_up)}, "grad", req.wire_up)
        return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Validation loss of the received model on this node's held-out batches."""
        req: protocol.EvaluateRequest = request_of(msg)
        set_threads(req)
        site = self.site(req, context, msg)
        model, spec = self.model(site)
        base = self.receive_model(msg, req, spec, torch.empty(spec.numel, dtype=torch.float32))
        load_flat_into(model, base, spec)
        model.to(self.device(site))
        count = int(site.sections["client"].get("eval_batches", 0))
        batches = self.eval_batches(site.for_eval("partition", count))
        return self.eval_reply(msg, model, batches, partition_id=site.partition_id)


def make_client_app(model_fn: ModelFn, batches_fn: BatchesFn, **options: Any) -> ClientApp:
    """The Flower ``ClientApp`` of a user's model: ``DatacenterClient(model_fn, batches_fn,
    **options).app``.

    ``options`` are `DatacenterClient`'s keyword-only fields (``eval_batches_fn``,
    ``optimizer_fn``, ``lr_schedule``, ``loss_fn``, ``tokens_fn``, ``blocks``), with its defaults:
    the class is the one place they are declared, so the two cannot drift apart. An unknown
    option is a TypeError naming it.
    """
    return DatacenterClient(model_fn, batches_fn, **options).app
