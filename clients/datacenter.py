"""The datacenter ClientApp: one site's inner training between outer steps.

A message carries the global model (in the configured downlink precision) and the run's client,
model and data sections. The client loads the model, trains ``inner_steps`` AdamW steps on its
partition, and replies with the pseudo-gradient Δ = θ_global − θ_local in the uplink precision plus
the numbers the server needs (tokens, steps, mean loss, step time). What must survive between
rounds (the AdamW moments and the LR-schedule position, ALGORITHMS.md §1) lives in
``context.state``, which Flower keeps per node for the whole run; module-level caches only hold
things that are cheap to rebuild (the model object, the tokenised partition), because deployment
starts a fresh process per message.
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.builders import inner_config, make_model, model_config, partitions
from fl_geo.clients.persist import load_inner_state, save_inner_state, state_path
from fl_geo.clients.ps_transfer import has_followers, pull_model, push_update
from fl_geo.data import BatchNoise, BatchSampler, eval_batches
from fl_geo.device import pick_device
from fl_geo.dispatch import PROFILE_KEY
from fl_geo.distributed import DataParallelTrainer, model_spec, resolve_devices
from fl_geo.model import Decoder
from fl_geo.quantize import quantize_record
from fl_geo.state import ParamSpec, flatten, load_flat_into, pseudo_grad
from fl_geo.streaming import (
    Fragments,
    cocodc_compensate,
    fragment_record,
    fragment_spec,
    streaming_merge,
)
from fl_geo.training import InnerConfig, InnerTrainer, evaluate_loss
from fl_geo.wire import decode, decode_into, encode

log = logging.getLogger("fl_geo")

app = ClientApp()

OPT_STATE_KEY = "inner_opt"
PROGRESS_KEY = "inner_progress"
PREV_OPT_STATE_KEY = "inner_opt_prev"  # the inner state before the last round (run.checkpoint_every)
PREV_PROGRESS_KEY = "inner_progress_prev"
INNER_STATE_KEYS = (OPT_STATE_KEY, PROGRESS_KEY, PREV_OPT_STATE_KEY, PREV_PROGRESS_KEY)


def _partition_ids(context: Context) -> tuple[int, int]:
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise KeyError(
            "node_config needs 'partition-id' and 'num-partitions' "
            "(simulation sets them; a SuperNode takes --node-config 'partition-id=0 num-partitions=4')"
        )
    return int(nc["partition-id"]), int(nc["num-partitions"])


@lru_cache(maxsize=2)
def _model(model_json: str, seed: int) -> tuple[Decoder, ParamSpec]:
    model = make_model(model_json, seed)
    return model, ParamSpec.from_state_dict(model.state_dict())


def _load_global(msg: Message, cfg: ConfigRecord, device: torch.device) -> tuple[Decoder, ParamSpec, torch.Tensor]:
    """Decode the received model (validated against our own spec) into the cached model."""
    model, spec = _model(str(cfg["model"]), int(cfg["seed"]))
    base = torch.empty(spec.numel, dtype=torch.float32)
    if has_followers(cfg):  # sharded Di-PS: the model comes over the data path, not in the message
        PULLED["version"] = pull_model(cfg, base)
    else:
        for offset, piece in decode(msg.content.array_records["arrays"], spec, str(cfg["wire_down"])):
            base[offset : offset + piece.numel()].copy_(piece)
    load_flat_into(model, base, spec)
    model.to(device)
    return model, spec, base


# The model version the last pull from the follower PSs returned (one train message at a time
# per ClientApp process, so one slot suffices).
PULLED = {"version": -1}


def _set_threads(cfg: ConfigRecord) -> None:
    threads = int(cfg.get("threads", 1))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _first_device(setting: str) -> str:
    """A node's ``device`` may list the devices of a data-parallel site (``"cuda:0,cuda:2"``,
    fl_geo.distributed); a handler that uses one device takes the first."""
    return setting.split(",", 1)[0].strip()


def _setup(msg: Message, context: Context) -> tuple[ConfigRecord, int, int, InnerConfig, Decoder, ParamSpec, torch.Tensor]:
    """What every handler needs: config, partition, inner settings, and the received model loaded."""
    cfg = msg.content.config_records["config"]
    _set_threads(cfg)
    pid, nparts = _partition_ids(context)
    icfg = inner_config(str(cfg["client"]), int(cfg["schedule_total"]))
    # A node may override its device (e.g. --node-config 'device="cuda:1"'); else the run's choice.
    device = pick_device(_first_device(str(context.node_config.get("device", icfg.device))))
    model, spec, base = _load_global(msg, cfg, device)
    return cfg, pid, nparts, icfg, model, spec, base


def _num_devices(cfg: ConfigRecord, context: Context) -> int:
    """Processes for this site's inner loop: node config ``devices`` (a site knows its hardware:
    ``--node-config 'devices=8'``), else ``client.devices``; a client section without the key
    (from an older run) means one."""
    client = json.loads(str(cfg["client"]))
    return int(context.node_config.get("devices", client.get("devices", 1)))


def _setup_data_parallel(
    msg: Message, context: Context, count: int
) -> tuple[ConfigRecord, int, int, InnerConfig, DataParallelTrainer, ParamSpec, torch.Tensor]:
    """``_setup`` for a data-parallel job of ``count`` ranks (fl_geo.distributed).

    This process builds no trainable model: the received model is decoded straight into the
    job's shared-memory parameter buffer (which the ranks train from and rank 0 writes back
    into), and ``base`` keeps θ_global for the pseudo-gradient. The devices are checked here, on
    the site's own machine (the server that validated the config may have no GPU).
    """
    cfg = msg.content.config_records["config"]
    _set_threads(cfg)
    pid, nparts = _partition_ids(context)
    client = json.loads(str(cfg["client"]))
    icfg = inner_config(client, int(cfg["schedule_total"]))
    device = str(context.node_config.get("device", icfg.device))
    devices, backend = resolve_devices(device, count, str(client.get("dist_backend", "auto")))
    model_cfg = model_config(str(cfg["model"]))
    spec = model_spec(model_cfg)
    trainer = DataParallelTrainer(model_cfg, icfg, spec, devices, backend, threads=int(cfg.get("threads", 1)))
    if has_followers(cfg):
        PULLED["version"] = pull_model(cfg, trainer.params)
    else:
        decode_into(msg.content.array_records["arrays"], spec, str(cfg["wire_down"]), out=trainer.params)
    base = trainer.params.clone()
    return cfg, pid, nparts, icfg, trainer, spec, base


def make_sampler(
    data_cfg: dict[str, Any], tokens: torch.Tensor, icfg: InnerConfig, pid: int, vocab_size: int, data_seed: int
) -> BatchSampler:
    """This partition's training sampler; partitions in ``data.noise_partitions`` get a fraction of
    low-quality batches (``data.noise_*``, EDiT-style loss spikes). Keys missing from an older
    data section mean no noise."""
    noise = None
    fraction = float(data_cfg.get("noise_fraction", 0.0) or 0.0)
    if fraction > 0 and pid in {int(p) for p in data_cfg.get("noise_partitions") or []}:
        noise = BatchNoise(
            fraction=fraction,
            kind=str(data_cfg.get("noise_kind", "random")),
            block=int(data_cfg.get("noise_block", 1)),
            vocab_size=int(vocab_size),
            shared=bool(data_cfg.get("noise_shared", False)),
        )
    return BatchSampler(tokens, icfg.seq_len, icfg.batch_size, seed=data_seed, stream=pid, noise=noise)


def _train_metrics(result: Any, train_time: float, pid: int, noisy_steps: int) -> dict[str, Any]:
    """The metrics every train reply carries (strategies/replies.py REPLY_METRICS and more)."""
    return {
        "tokens": int(result.tokens),
        "num-examples": int(result.tokens),  # the key Flower's own strategies weight by
        "steps": int(result.steps),
        "train_loss": float(result.mean_loss),
        "final_loss": float(result.final_loss),
        "step_time_s": float(result.step_time_s),
        "train_time_s": float(train_time),
        "partition_id": pid,
        "noisy_steps": int(noisy_steps),  # batches replaced by data.noise_* garbage in this job
    }


def _state_file(context: Context, cfg: ConfigRecord, pid: int) -> Path | None:
    """Where this node keeps its inner state on disk: its node config ``state-dir``, else the
    run's ``run.client_state_dir`` (simulation); off when neither is set."""
    state_dir = str(context.node_config.get("state-dir", "") or cfg.get("state_dir", "") or "")
    return state_path(state_dir, str(cfg.get("run_name", "run")), pid) if state_dir else None


def rewind_to_round(state: RecordDict, cfg: ConfigRecord) -> None:
    """A synchronous server that resumed from a checkpoint may send a round this node already
    trained (it crashed after the node replied). With ``keep_prev`` the node kept the inner state
    from before its last round: it goes back to it, so the round is redone from the same start and
    the run stays bit-identical to one that never stopped. Anything older cannot be rewound: the
    node continues from its current state and says so."""
    if not bool(cfg.get("keep_prev", False)) or "round" not in cfg:
        return
    progress = state.config_records.get(PROGRESS_KEY)
    if progress is None or "last_round" not in progress:
        return
    rnd, last = int(cfg["round"]), int(progress["last_round"])
    if rnd > last:
        return
    prev = state.config_records.get(PREV_PROGRESS_KEY)
    if rnd == last and prev is not None:
        if PREV_OPT_STATE_KEY in state.array_records:
            state[OPT_STATE_KEY] = state.array_records[PREV_OPT_STATE_KEY]
        else:  # the round being redone was this node's first: it started with a fresh optimizer
            del state[OPT_STATE_KEY]
        state[PROGRESS_KEY] = prev
        log.info("round %d sent again (server resumed): rewound the inner state to before it", rnd)
        return
    log.warning("round %d sent again but this node's state is from round %d and only one round can be "
                "rewound: continuing from the current inner state (the run is no longer bit-identical)", rnd, last)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the server who we are: partition, device and site (NodeInfo carries no node_config)."""
    pid, nparts = _partition_ids(context)
    device = str(context.node_config.get("device", "auto"))
    profile = ConfigRecord(
        {
            "partition_id": pid,
            "num_partitions": nparts,
            "device": str(pick_device(_first_device(device))),
            "site": str(context.node_config.get("site", f"dc{pid}")),
        }
    )
    return Message(RecordDict({PROFILE_KEY: profile}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the inner loop from the received global model; reply with the pseudo-gradient.

    One process by default. With ``client.devices`` (or node config ``devices``) > 1 the inner
    loop runs as a data-parallel job across the site's devices (fl_geo.distributed,
    docs/multidevice.md), each rank with batch ``client.batch_size``; the state handling and the
    reply are the same. (The streaming handler ``train.stream`` always runs in one process.)
    """
    trainer: InnerTrainer | DataParallelTrainer
    count = _num_devices(msg.content.config_records["config"], context)
    if count > 1:
        cfg, pid, nparts, icfg, trainer, spec, base = _setup_data_parallel(msg, context, count)
        vocab_size = trainer.model_cfg.vocab_size
    else:
        cfg, pid, nparts, icfg, model, spec, base = _setup(msg, context)
        trainer = InnerTrainer(model, icfg)
        vocab_size = model.cfg.vocab_size
    state = context.state
    disk = _state_file(context, cfg, pid)
    if disk is not None and bool(cfg.get("resumed", False)) and PROGRESS_KEY not in state.config_records:
        load_inner_state(state, disk)  # a restarted server is a new Flower run: context.state is empty
    rewind_to_round(state, cfg)
    start_opt = state.array_records.get(OPT_STATE_KEY)
    if start_opt is not None:
        trainer.load_optimizer_state({k: torch.from_numpy(a.numpy()) for k, a in start_opt.items()})
    progress = state.config_records.get(PROGRESS_KEY, ConfigRecord({"step": 0, "rounds": 0}))
    start_progress = progress
    # schedule_clock (ALGORITHMS.md §1): "local" continues our own step count; asynchronous
    # strategies send a global position so a slow worker does not linger at a high learning rate.
    local_step = int(progress["step"])
    start_step = int(cfg["start_step"]) if "start_step" in cfg else local_step

    parts, _ = partitions(cfg["data"], nparts)
    part = parts[pid]
    data_cfg = json.loads(str(cfg["data"]))
    data_seed = int(data_cfg["seed"]) * 1_000_003 + int(cfg["seed"])
    sampler = make_sampler(data_cfg, part.train, icfg, pid, vocab_size, data_seed)

    t0 = time.perf_counter()
    budget = float(cfg.get("time_budget_s", 0.0))  # A-EDiT: train for a time, H is a cap
    result = trainer.train(sampler, int(cfg["inner_steps"]), start_step, time_budget_s=budget)
    train_time = time.perf_counter() - t0
    noisy_steps = sum(sampler.is_noisy(start_step + i) for i in range(result.steps))

    # One process: copy the trained model out. Data-parallel: rank 0 wrote it into shared memory.
    local = trainer.params if isinstance(trainer, DataParallelTrainer) else flatten(model.state_dict())
    update = local
    if str(cfg.get("send", "pseudo_grad")) != "params":
        # (with send=params, Di-PS's "current" base of Algorithm 1 line 10, the server subtracts
        # from its own current model, so the worker ships its parameters)
        update = pseudo_grad(base, local, out=local)  # reuse the local buffer: no extra model copy
    records: dict[str, Any] = {}
    pushed: dict[str, int] = {}
    if has_followers(cfg):  # the update goes to the follower PSs; the reply carries control only
        pushed = {"ps_pushed_bytes": push_update(cfg, update), "ps_version": PULLED["version"]}
    else:
        records["arrays"] = encode(update, spec, str(cfg["wire_up"]))

    if bool(cfg.get("keep_prev", False)):
        # What this round started from (the same objects, no copy): a resumed server that sends
        # this round again gets the same result (rewind_to_round).
        if start_opt is not None:
            state[PREV_OPT_STATE_KEY] = start_opt
        state[PREV_PROGRESS_KEY] = ConfigRecord(dict(start_progress))
    state[OPT_STATE_KEY] = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in trainer.optimizer_state().items()})
    state[PROGRESS_KEY] = ConfigRecord({"step": local_step + result.steps, "rounds": int(progress["rounds"]) + 1,
                                        "last_round": int(cfg.get("round", -1))})
    if disk is not None:
        save_inner_state(state, INNER_STATE_KEYS, disk)

    metrics = MetricRecord(
        {
            **_train_metrics(result, train_time, pid, noisy_steps),
            "base_version": int(cfg.get("base_version", 0)),
            **pushed,
        }
    )
    return Message(RecordDict({**records, "metrics": metrics}), reply_to=msg)


# ---- Streaming DiLoCo / CoCoDC (ALGORITHMS.md §7; server side: strategies/streaming.py) --------
#
# One "train.stream" message = one tick of the streaming schedule: (1) apply the global fragments
# attached to it, (2) train `stream_steps` inner steps, (3) start syncing the fragments listed in
# `stream_sync`: reply with Δ_p = θ^g_p − θ^m_p and keep θ^m_p as the snapshot CoCoDC needs when
# the new θ^g_p comes back. The worker's own model lives in context.state between messages
# (deployment starts a fresh process per message), next to the AdamW state and step counter of
# the plain `train` handler.
STREAM_LOCAL_KEY = "stream_local"  # ArrayRecord {"flat": θ^m}: the worker's full model, fp32
STREAM_GLOBAL_KEY = "stream_global"  # ArrayRecord {"flat": θ^g}: fragment p = the last θ^g_p received
STREAM_SNAPSHOT_KEY = "stream_snapshot"  # ArrayRecord {"<p>": θ^m_p(t_p)} per fragment in flight
STREAM_META_KEY = "stream_meta"  # ConfigRecord: fragments, numel, snapshot_steps (JSON {p: local step})


@lru_cache(maxsize=4)
def _fragments(model_json: str, seed: int, num_fragments: int) -> tuple[Fragments, tuple[ParamSpec, ...]]:
    _, spec = _model(model_json, seed)
    fragments = Fragments(spec, num_fragments)
    return fragments, tuple(fragment_spec(fragments, p) for p in range(num_fragments))


def merge_fragment(
    rule: str,
    local_now: torch.Tensor,
    global_new: torch.Tensor,
    local_at_start: torch.Tensor | None,
    overlap: int,
    H: int,
    alpha: float,
    lam: float,
) -> torch.Tensor:
    """The worker's new fragment p when the new global fragment θ^g_p arrives (a new tensor).

    ``streaming``: (1 − α)·θ^m_p(now) + α·θ^g_p (`streaming_merge`). ``cocodc``: Algorithm 1's
    delay compensation from the snapshot θ^m_p(t_p) over the *measured* ``overlap`` steps
    (`cocodc_compensate`); with no snapshot (the worker joined after the sync started) or no
    step in between (τ = 0) there is no local progress to carry over, so the result is θ^g_p.
    """
    if rule == "streaming":
        return streaming_merge(local_now, global_new, alpha)
    if rule != "cocodc":
        raise ValueError(f"unknown stream_rule {rule!r} (streaming or cocodc)")
    if local_at_start is None or overlap < 1:
        return global_new.clone()
    return cocodc_compensate(local_at_start, local_now, global_new, overlap, H, lam)


def _flat_array(t: torch.Tensor) -> Array:
    return Array(t.detach().to("cpu", torch.float32).contiguous().numpy())


@app.train("stream")
def train_stream(msg: Message, context: Context) -> Message:
    """One tick of Streaming DiLoCo / CoCoDC on this worker (message type ``train.stream``).

    Always one process: ``client.devices`` applies to the plain ``train`` handler only.
    """
    cfg = msg.content.config_records["config"]
    _set_threads(cfg)
    pid, nparts = _partition_ids(context)
    icfg = inner_config(str(cfg["client"]), int(cfg["schedule_total"]))
    device = pick_device(_first_device(str(context.node_config.get("device", icfg.device))))
    model, spec = _model(str(cfg["model"]), int(cfg["seed"]))
    fragments, frag_specs = _fragments(str(cfg["model"]), int(cfg["seed"]), int(cfg["fragments"]))
    rule, H = str(cfg["stream_rule"]), int(cfg["H"])
    alpha, lam = float(cfg["alpha"]), float(cfg["lambda"])
    wire_down, wire_up = str(cfg["wire_down"]), str(cfg["wire_up"])
    state = context.state
    progress = state.config_records.get(PROGRESS_KEY, ConfigRecord({"step": 0, "rounds": 0}))
    local_step = int(progress["step"])

    # The worker's model, its copies of the global fragments and the snapshots of syncs in flight
    arrays = msg.content.array_records
    snapshots: dict[int, tuple[torch.Tensor, int]] = {}
    if "arrays" in arrays:  # the first message (or a re-initialisation): the full global model
        local = decode_into(arrays["arrays"], spec, wire_down)
        global_copy = local.clone()
    else:
        if STREAM_LOCAL_KEY not in state.array_records or STREAM_META_KEY not in state.config_records:
            raise RuntimeError("train.stream: this node holds no streaming state and the message "
                               "carries no initial model ('arrays'); the server must initialise it")
        meta = state.config_records[STREAM_META_KEY]
        if int(meta["fragments"]) != fragments.num_fragments or int(meta["numel"]) != spec.numel:
            raise RuntimeError(f"train.stream: stored state is for {meta['fragments']} fragments of "
                               f"{meta['numel']} parameters, the message for "
                               f"{fragments.num_fragments} of {spec.numel}")
        local = torch.from_numpy(state.array_records[STREAM_LOCAL_KEY]["flat"].numpy())
        global_copy = torch.from_numpy(state.array_records[STREAM_GLOBAL_KEY]["flat"].numpy())
        steps_at = {int(k): int(v) for k, v in json.loads(str(meta["snapshot_steps"])).items()}
        for key, array in state.array_records[STREAM_SNAPSHOT_KEY].items():
            snapshots[int(key)] = (torch.from_numpy(array.numpy()), steps_at[int(key)])

    # (1) apply the new global fragments
    overlaps: list[int] = []
    for p in json.loads(str(cfg["stream_apply"])):
        name = fragment_record(p)
        if name not in arrays:
            raise ValueError(f"train.stream: stream_apply lists fragment {p} but the message has no {name!r}")
        global_new = decode_into(arrays[name], frag_specs[p], wire_down)
        snapshot = snapshots.pop(p, None)
        overlap = local_step - snapshot[1] if snapshot is not None else 0
        if snapshot is not None:
            overlaps.append(overlap)
        merged = merge_fragment(rule, fragments.gather(local, p), global_new,
                                snapshot[0] if snapshot is not None else None, overlap, H, alpha, lam)
        fragments.scatter_(local, p, merged)
        fragments.scatter_(global_copy, p, global_new)

    # (2) train
    load_flat_into(model, local, spec)
    model.to(device)
    trainer = InnerTrainer(model, icfg)
    if OPT_STATE_KEY in state.array_records:
        opt = state.array_records[OPT_STATE_KEY]
        trainer.load_optimizer_state({k: torch.from_numpy(a.numpy()) for k, a in opt.items()})
    parts, _ = partitions(cfg["data"], nparts)
    data_cfg = json.loads(str(cfg["data"]))
    data_seed = int(data_cfg["seed"]) * 1_000_003 + int(cfg["seed"])
    sampler = make_sampler(data_cfg, parts[pid].train, icfg, pid, model.cfg.vocab_size, data_seed)
    t0 = time.perf_counter()
    result = trainer.train(sampler, int(cfg["stream_steps"]), local_step)
    train_time = time.perf_counter() - t0
    noisy_steps = sum(sampler.is_noisy(local_step + i) for i in range(result.steps))
    local = flatten(model.state_dict())
    step_after = local_step + result.steps

    # (3) start the requested syncs: Δ_p = θ^g_p − θ^m_p against our copy of the global fragment
    content: dict[str, Any] = {}
    quantize = str(cfg.get("stream_quantize", "none"))
    for p in json.loads(str(cfg["stream_sync"])):
        local_p = fragments.gather(local, p)
        delta = torch.sub(fragments.gather(global_copy, p), local_p)
        if quantize == "none":
            content[fragment_record(p)] = encode(delta, frag_specs[p], wire_up)
        else:
            content[fragment_record(p)] = quantize_record(delta, quantize, int(cfg["stream_quantize_block"]))
        snapshots[p] = (local_p, step_after)

    state[STREAM_LOCAL_KEY] = ArrayRecord({"flat": _flat_array(local)})
    state[STREAM_GLOBAL_KEY] = ArrayRecord({"flat": _flat_array(global_copy)})
    state[STREAM_SNAPSHOT_KEY] = ArrayRecord({str(p): _flat_array(t) for p, (t, _) in sorted(snapshots.items())})
    state[STREAM_META_KEY] = ConfigRecord({
        "fragments": fragments.num_fragments,
        "numel": spec.numel,
        "snapshot_steps": json.dumps({str(p): s for p, (_, s) in sorted(snapshots.items())}),
    })
    state[OPT_STATE_KEY] = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in trainer.optimizer_state().items()})
    state[PROGRESS_KEY] = ConfigRecord({"step": step_after, "rounds": int(progress["rounds"]) + 1})

    content["metrics"] = MetricRecord(
        {
            **_train_metrics(result, train_time, pid, noisy_steps),
            # measured τ of the fragments applied by this message (local steps since their sync start)
            "overlap_count": len(overlaps),
            "overlap_sum": int(sum(overlaps)),
            "overlap_max": int(max(overlaps, default=-1)),
            "overlap_min": int(min(overlaps, default=-1)),
        }
    )
    return Message(RecordDict(content), reply_to=msg)


@app.evaluate("stream")
def evaluate_stream(msg: Message, context: Context) -> Message:
    """Validation loss of this worker's *own* model θ^m (message type ``evaluate.stream``).

    Why: in Streaming DiLoCo and CoCoDC no moment exists at which the server's global model is
    what the workers hold. Its fragments were last stepped at different times (with the fixed
    schedule up to H − H/P steps apart), and the workers train on from the merged fragments.
    The server therefore asks each worker to score θ^m as it stands, on the same held-out batches
    (``run.eval_batches`` of the global held-out text) that ``val/loss`` uses. Read-only: nothing
    in ``context.state`` changes, and fragments still in flight are not merged first.
    """
    cfg = msg.content.config_records["config"]
    _set_threads(cfg)
    state = context.state
    if STREAM_LOCAL_KEY not in state.array_records:
        raise RuntimeError("evaluate.stream: this node holds no streaming model yet (no train.stream message ran)")
    _, nparts = _partition_ids(context)
    icfg = inner_config(str(cfg["client"]), int(cfg["schedule_total"]))
    device = pick_device(_first_device(str(context.node_config.get("device", icfg.device))))
    model, spec = _model(str(cfg["model"]), int(cfg["seed"]))
    local = torch.from_numpy(state.array_records[STREAM_LOCAL_KEY]["flat"].numpy())
    if local.numel() != spec.numel:
        raise RuntimeError(f"evaluate.stream: stored model has {local.numel()} parameters, the run's {spec.numel}")
    load_flat_into(model, local, spec)
    model.to(device)
    _, val_tokens = partitions(cfg["data"], nparts)
    batches = eval_batches(val_tokens, icfg.seq_len, icfg.batch_size, int(cfg["eval_batches"]))
    return _eval_reply(msg, model, batches)


def _eval_reply(msg: Message, model: Decoder, batches: list[tuple[torch.Tensor, torch.Tensor]],
                **extra: int) -> Message:
    """The reply of an evaluate handler: ``val_loss`` and ``val_tokens`` (what
    `OuterLoop.collect_val_losses` reads; ``num-examples`` too, Flower's weighting key) of
    ``model`` on ``batches``, plus ``extra`` metrics."""
    loss = evaluate_loss(model, batches)
    tokens = sum(int(y.numel()) for _, y in batches)
    metrics = MetricRecord({"val_loss": float(loss), "val_tokens": tokens, "num-examples": tokens, **extra})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Validation loss of the received model on this node's held-out text."""
    cfg, pid, nparts, icfg, model, _, _ = _setup(msg, context)
    parts, _ = partitions(cfg["data"], nparts)
    eval_count = int(json.loads(str(cfg["client"]))["eval_batches"])
    batches = eval_batches(parts[pid].val, icfg.seq_len, icfg.batch_size, eval_count)
    return _eval_reply(msg, model, batches, partition_id=pid)
