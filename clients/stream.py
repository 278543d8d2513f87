"""Streaming DiLoCo / CoCoDC on a worker (docs/algorithms.md §7; server side: strategies/streaming.py).

One "train.stream" message = one tick of the streaming schedule: (1) apply the global fragments
attached to it, (2) train `stream_steps` inner steps, (3) start syncing the fragments listed in
`stream_sync`: reply with Δ_p = θ^g_p − θ^m_p and keep θ^m_p as the snapshot CoCoDC needs when
the new θ^g_p comes back. The worker's own model lives in context.state between messages
(deployment starts a fresh process per message), next to the optimizer state and step counter of
the plain `train` handler. With ``wire_compress`` each Δ_p travels as a `fl_geo.core.compress`
payload, with one error-feedback residual per fragment kept in context.state beside the model
(`STREAM_RESIDUAL_KEY`); a worker (re)initialised from the full model starts from zero residuals. Fragments are strided over the *user's* blocks
(`DatacenterClient.fragments`), so any model with repeated blocks streams.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fl_geo.clients.api import (
    OPT_STATE_KEY,
    PROGRESS_KEY,
    declared,
    noisy_steps,
    opt_from_record,
    opt_record,
    request_of,
    set_threads,
    train_metrics,
)
from fl_geo.clients.persist import (
    load_inner_state,
    progress_record,
    save_inner_state,
    start_opt_state,
    state_file,
)
from fl_geo.core.compress import Compressor
from fl_geo.core.state import flatten, load_flat_into
from fl_geo.core.streaming import cocodc_compensate, fragment_record, streaming_merge
from fl_geo.runtime import protocol
from fl_geo.runtime.compressed import compress_record
from fl_geo.runtime.wire import check_finite_and_norm, decode_into, encode
from fl_geo.runtime.wire_settings import uplink_from_json

if TYPE_CHECKING:
    from fl_geo.clients.api import DatacenterClient
    from fl_geo.core.state import ParamSpec
    from fl_geo.core.streaming import Fragments

log = logging.getLogger("fl_geo")

__all__ = [
    "STREAM_GLOBAL_KEY",
    "STREAM_LOCAL_KEY",
    "STREAM_META_KEY",
    "STREAM_RESIDUAL_KEY",
    "STREAM_SNAPSHOT_KEY",
    "STREAM_STATE_KEYS",
    "evaluate_stream",
    "merge_fragment",
    "train_stream",
]

STREAM_LOCAL_KEY = "stream_local"  # ArrayRecord {"flat": θ^m}: the worker's full model, fp32
STREAM_GLOBAL_KEY = "stream_global"  # ArrayRecord {"flat": θ^g}: fragment p = the last θ^g_p received
STREAM_SNAPSHOT_KEY = "stream_snapshot"  # ArrayRecord {"<p>": θ^m_p(t_p)} per fragment in flight
STREAM_META_KEY = "stream_meta"  # ConfigRecord: fragments, numel, snapshot_steps (JSON {p: local step})
# ArrayRecord {"<p>": e_p}: the error-feedback residual of fragment p's compressed Δ_p (wire.compress),
# fp32, one per fragment that has synced; absent = zero
STREAM_RESIDUAL_KEY = "stream_residual"
# Everything a worker's streaming state is made of: what it keeps at a checkpoint's step and what
# it writes to its state file (clients/persist.py) after every tick.
STREAM_STATE_KEYS = (STREAM_LOCAL_KEY, STREAM_GLOBAL_KEY, STREAM_SNAPSHOT_KEY, STREAM_META_KEY, STREAM_RESIDUAL_KEY,
                     OPT_STATE_KEY, PROGRESS_KEY)
# The state kept at the start of a tick with ``stream_keep`` (the server checkpointed at that step):
# each record of STREAM_STATE_KEYS under "<key>.kept", and a ConfigRecord naming the step and the
# records that existed then (a record absent then is absent after a rewind).
KEPT_SUFFIX = ".kept"
STREAM_KEPT_KEY = "stream_kept"


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


# A worker's snapshots of the syncs in flight: fragment p -> (θ^m_p at the sync start, local step)
_Snapshots = dict[int, tuple[torch.Tensor, int]]


class _MergeParams(NamedTuple):
    """How an arriving global fragment is merged into the worker's model (see `merge_fragment`)."""

    rule: str
    H: int
    alpha: float
    lam: float


def _restore_stream_state(
    arrays: Mapping[str, ArrayRecord], state: RecordDict, spec: ParamSpec, fragments: Fragments, wire_down: str
) -> tuple[torch.Tensor, torch.Tensor, _Snapshots]:
    """The worker's model θ^m, its copy of θ^g and the snapshots of the syncs in flight.

    A message carrying ``arrays`` (the first one, or a re-initialisation) sets both models to the
    full global model and drops every snapshot; otherwise all three come back from
    ``context.state``, which must hold state for the same fragments and parameter count.
    """
    snapshots: _Snapshots = {}
    if "arrays" in arrays:  # the first message (or a re-initialisation): the full global model
        local = decode_into(arrays["arrays"], spec, wire_down)
        check_finite_and_norm([(0, local)], spec)
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
    return local, global_copy, snapshots


def _apply_global_fragments(
    req: protocol.StreamRequest,
    arrays: Mapping[str, ArrayRecord],
    fragments: Fragments,
    frag_specs: tuple[ParamSpec, ...],
    merge: _MergeParams,
    wire_down: str,
    local: torch.Tensor,
    global_copy: torch.Tensor,
    snapshots: _Snapshots,
    local_step: int,
) -> list[int]:
    """Step (1): merge each fragment in ``stream_apply`` into ``local`` and record it in ``global_copy``.

    Both tensors are updated in place and the snapshot of each applied fragment is taken out of
    ``snapshots``. Returns the measured overlaps τ (local steps since the sync started) of the
    fragments that had a snapshot.
    """
    overlaps: list[int] = []
    for p in json.loads(req.stream_apply):
        name = fragment_record(p)
        if name not in arrays:
            raise ValueError(f"train.stream: stream_apply lists fragment {p} but the message has no {name!r}")
        global_new = decode_into(arrays[name], frag_specs[p], wire_down)
        check_finite_and_norm([(0, global_new)], frag_specs[p])
        snapshot = snapshots.pop(p, None)
        overlap = local_step - snapshot[1] if snapshot is not None else 0
        if snapshot is not None:
            overlaps.append(overlap)
        merged = merge_fragment(merge.rule, fragments.gather(local, p), global_new,
                                snapshot[0] if snapshot is not None else None, overlap,
                                merge.H, merge.alpha, merge.lam)
        fragments.scatter_(local, p, merged)
        fragments.scatter_(global_copy, p, global_new)
    return overlaps


def _start_syncs(
    req: protocol.StreamRequest,
    fragments: Fragments,
    frag_specs: tuple[ParamSpec, ...],
    wire_up: str,
    local: torch.Tensor,
    global_copy: torch.Tensor,
    snapshots: _Snapshots,
    step_after: int,
    compressor: Compressor | None,
    residuals: dict[int, torch.Tensor],
) -> dict[str, Any]:
    """Step (3): the reply records Δ_p = θ^g_p − θ^m_p for each fragment in ``stream_sync``.

    Each Δ_p is encoded in ``wire_up`` precision or, with ``compressor`` (the request's
    ``wire_compress``), compressed with
    fragment p's error-feedback residual from ``residuals`` (updated in place: e_p ← Δ_p + e_p − Δ̂_p;
    a missing one is zero); θ^m_p and ``step_after`` are kept in ``snapshots`` for the merge when
    θ^g_p returns.
    """
    content: dict[str, Any] = {}
    for p in json.loads(req.stream_sync):
        local_p = fragments.gather(local, p)
        delta = torch.sub(fragments.gather(global_copy, p), local_p)
        if compressor is None:
            content[fragment_record(p)] = encode(delta, frag_specs[p], wire_up)
        else:
            payload, residual = compressor.compress(delta, residuals.get(p))
            content[fragment_record(p)] = compress_record(payload)
            if residual is not None:
                residuals[p] = residual
        snapshots[p] = (local_p, step_after)
    return content


def _restore_residuals(arrays: Mapping[str, ArrayRecord], state: RecordDict, fragments: Fragments,
                       error_feedback: bool) -> dict[int, torch.Tensor]:
    """Each fragment's kept residual; none after a (re)initialisation from the full model (a
    worker that joins or rejoins starts from zero, by rule), with error feedback off, or for a
    fragment whose residual does not fit it (dropped with a warning)."""
    kept = state.array_records.get(STREAM_RESIDUAL_KEY)
    if "arrays" in arrays or kept is None or not error_feedback:
        return {}
    out: dict[int, torch.Tensor] = {}
    for key, array in kept.items():
        p, residual = int(key), torch.from_numpy(array.numpy())
        if p < fragments.num_fragments and residual.dtype == torch.float32 and residual.shape == (fragments.numel(p),):
            out[p] = residual
        else:
            log.warning("the kept residual of fragment %s (%s %s) does not fit this model: starting it from zero",
                        key, residual.dtype, tuple(residual.shape))
    return out


def _store_stream_state(
    state: RecordDict,
    local: torch.Tensor,
    global_copy: torch.Tensor,
    snapshots: _Snapshots,
    num_fragments: int,
    numel: int,
    stream_end: int,
) -> None:
    """Write θ^m, θ^g, the in-flight snapshots and their metadata into ``context.state``
    (``stream_end``: the schedule step this state is at, the end of the tick just trained)."""
    state[STREAM_LOCAL_KEY] = ArrayRecord({"flat": _flat_array(local)})
    state[STREAM_GLOBAL_KEY] = ArrayRecord({"flat": _flat_array(global_copy)})
    state[STREAM_SNAPSHOT_KEY] = ArrayRecord({str(p): _flat_array(t) for p, (t, _) in sorted(snapshots.items())})
    state[STREAM_META_KEY] = ConfigRecord({
        "fragments": num_fragments,
        "numel": numel,
        "snapshot_steps": json.dumps({str(p): s for p, (_, s) in sorted(snapshots.items())}),
        "stream_end": int(stream_end),
    })


def _has(state: RecordDict, key: str) -> bool:
    return key in state.array_records or key in state.config_records


def _keep_state(state: RecordDict, stream_step: int) -> None:
    """Keep the state this tick starts from (the same record objects: each tick stores new ones)."""
    present = [k for k in STREAM_STATE_KEYS if _has(state, k)]
    for key in STREAM_STATE_KEYS:
        if key in present:
            state[key + KEPT_SUFFIX] = state[key]
        elif _has(state, key + KEPT_SUFFIX):
            del state[key + KEPT_SUFFIX]
    state[STREAM_KEPT_KEY] = ConfigRecord({"stream_step": int(stream_step), "keys": json.dumps(present)})


def _rewind_to_kept(state: RecordDict, req: protocol.StreamRequest) -> None:
    """A server that resumed from a checkpoint sends the tick of the checkpoint's step again,
    while this worker may have trained ticks past it (the server died after they were sent).
    The worker goes back to the state it kept at that step (`_keep_state`), so the resumed run
    stays bit-identical to one that never stopped. A worker already at that step continues; one
    with nothing kept there continues from its current state and says so."""
    meta = state.config_records.get(STREAM_META_KEY)
    at = int(meta["stream_end"]) if meta is not None and "stream_end" in meta else None
    if at is None or at == req.stream_step:
        return
    kept = state.config_records.get(STREAM_KEPT_KEY)
    if kept is None or int(kept["stream_step"]) != req.stream_step:
        if req.resumed:
            log.warning("train.stream: the tick of step %d was sent but this worker's state is at step %d and "
                        "none was kept there: continuing from its current state (the run is no longer "
                        "bit-identical to an uninterrupted one)", req.stream_step, at)
        return
    present = set(json.loads(str(kept["keys"])))
    for key in STREAM_STATE_KEYS:
        if key in present:
            state[key] = state[key + KEPT_SUFFIX]
        elif _has(state, key):
            del state[key]
    log.info("train.stream: the tick of step %d sent again (server resumed): rewound from step %d", req.stream_step, at)


def train_stream(client: DatacenterClient, msg: Message, context: Context) -> Message:
    """One tick of Streaming DiLoCo / CoCoDC on this worker (message type ``train.stream``).

    Always one process: ``client.devices`` applies to the plain ``train`` handler only.
    """
    req: protocol.StreamRequest = request_of(msg)
    set_threads(req)
    site = client.site(req, context, msg)
    device = client.device(site)
    model, spec = client.model(site)
    fragments, frag_specs = client.fragments(site, req.fragments)
    merge = _MergeParams(req.stream_rule, req.H, req.alpha, req.lambda_)
    wire_down, wire_up = req.wire_down, req.wire_up
    state = context.state
    disk = state_file(context, req, site.partition_id)
    if disk is not None and req.resumed and not _has(state, STREAM_META_KEY):
        load_inner_state(state, disk)  # a restarted server is a new Flower run: context.state is empty
    _rewind_to_kept(state, req)
    if req.stream_keep:
        _keep_state(state, req.stream_step)
    progress = state.config_records.get(PROGRESS_KEY, ConfigRecord({"step": 0, "rounds": 0}))
    local_step = int(progress["step"])

    # The worker's model, its copies of the global fragments and the snapshots of syncs in flight
    arrays = msg.content.array_records
    local, global_copy, snapshots = _restore_stream_state(arrays, state, spec, fragments, wire_down)

    # (1) apply the new global fragments
    overlaps = _apply_global_fragments(req, arrays, fragments, frag_specs, merge, wire_down,
                                       local, global_copy, snapshots, local_step)

    # (2) train
    load_flat_into(model, local, spec)
    model.to(device)
    trainer = client.trainer(model, site)
    start_opt = start_opt_state(state, trainer.optimizer_kind)
    if start_opt is not None:
        trainer.load_optimizer_state(opt_from_record(start_opt))
    source = client.batches(site)
    t0 = time.perf_counter()
    result = trainer.train(source, req.stream_steps, local_step)
    train_time = time.perf_counter() - t0
    noisy = noisy_steps(source, local_step, result.steps)
    local = flatten(model.state_dict(), spec)
    step_after = local_step + result.steps

    # (3) start the requested syncs: Δ_p = θ^g_p − θ^m_p against our copy of the global fragment
    settings = uplink_from_json(req.wire_compress)
    compressor = Compressor(settings) if settings is not None else None
    residuals = _restore_residuals(arrays, state, fragments, settings is not None and settings.error_feedback)
    content = _start_syncs(req, fragments, frag_specs, wire_up, local, global_copy, snapshots, step_after,
                           compressor, residuals)
    if residuals:
        state[STREAM_RESIDUAL_KEY] = ArrayRecord({str(p): _flat_array(r) for p, r in sorted(residuals.items())})
    elif STREAM_RESIDUAL_KEY in state.array_records:
        del state[STREAM_RESIDUAL_KEY]

    _store_stream_state(state, local, global_copy, snapshots, fragments.num_fragments, spec.numel,
                        req.stream_step + req.stream_steps)
    state[OPT_STATE_KEY] = opt_record(trainer)
    state[PROGRESS_KEY] = progress_record(step_after, int(progress["rounds"]) + 1, trainer.optimizer_kind)
    if disk is not None:
        save_inner_state(state, (*STREAM_STATE_KEYS, *(k + KEPT_SUFFIX for k in STREAM_STATE_KEYS), STREAM_KEPT_KEY),
                         disk)

    content["metrics"] = train_metrics(
        result, train_time, site.partition_id, noisy,
        # measured τ of the fragments applied by this message (local steps since their sync start)
        overlap_count=len(overlaps),
        overlap_sum=int(sum(overlaps)),
        overlap_max=int(max(overlaps, default=-1)),
        overlap_min=int(min(overlaps, default=-1)),
        # which message this answers: the server refuses a reply of another tick (a replay)
        stream_step=req.stream_step,
        base_version=req.base_version,
    )
    payload = "fragments" if any(k != "metrics" for k in content) else "none"
    return Message(RecordDict(declared(content, payload, req.wire_up)), reply_to=msg)


def evaluate_stream(client: DatacenterClient, msg: Message, context: Context) -> Message:
    """Validation loss of this worker's *own* model θ^m (message type ``evaluate.stream``).

    Why: in Streaming DiLoCo and CoCoDC no moment exists at which the server's global model is
    what the workers hold. Its fragments were last stepped at different times (with the fixed
    schedule up to H − H/P steps apart), and the workers train on from the merged fragments.
    The server therefore asks each worker to score θ^m as it stands, on the same held-out batches
    (``run.eval_batches`` of the global held-out set, ``site.eval_scope == "global"``) that
    ``val/loss`` uses. Read-only: nothing in ``context.state`` changes, and fragments still in
    flight are not merged first.
    """
    req: protocol.EvaluateRequest = request_of(msg)
    set_threads(req)
    state = context.state
    if STREAM_LOCAL_KEY not in state.array_records:
        raise RuntimeError("evaluate.stream: this node holds no streaming model yet (no train.stream message ran)")
    site = client.site(req, context, msg)
    device = client.device(site)
    model, spec = client.model(site)
    local = torch.from_numpy(state.array_records[STREAM_LOCAL_KEY]["flat"].numpy())
    if local.numel() != spec.numel:
        raise RuntimeError(f"evaluate.stream: stored model has {local.numel()} parameters, the run's {spec.numel}")
    load_flat_into(model, local, spec)
    model.to(device)
    if req.eval_batches is None:
        raise protocol.ProtocolError("evaluate.stream names no eval_batches (how many held-out batches to score)")
    batches = client.eval_batches(site.for_eval("global", req.eval_batches))
    return client.eval_reply(msg, model, batches)
