"""A datacenter's inner state: its records in ``context.state`` (the AdamW moments and the
schedule position, `opt_record`; the state at the server's newest checkpoint, `rewind_to_round`) and
their copy on the node's own disk, so that they survive a restarted server.

Flower keeps ``context.state`` per node *per run*: when a crashed ServerApp is started again with
``flwr run`` it is a new run, and every node would start over with fresh AdamW moments and step
count. A SuperNode started with ``--node-config 'state-dir="/var/lib/fl-geo"'`` writes its inner
state (the AdamW moments, the schedule position, the compressed uplink's error-feedback residual
and, with checkpoints on, the state it had at the
server's newest checkpoint) after every train job to ``<state-dir>/<run name>/partition-<id>.pt`` (atomic
write then rename, sha256-verified like the server's checkpoints) and reads it back only when a
server that *resumed from a checkpoint* sends it work with an empty ``context.state``. A new run
that merely reuses the name never picks up stale state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fl_geo.core.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint
from fl_geo.runtime import protocol
from fl_geo.runtime.wire import array_of, tensor_of

if TYPE_CHECKING:
    from flwr.app import Context

    from fl_geo.inner.distributed import DataParallelTrainer
    from fl_geo.inner.training import InnerTrainer

log = logging.getLogger("fl_geo")

# The records of a node's inner state in ``context.state`` (and in its file on disk)
OPT_STATE_KEY = "inner_opt"
PROGRESS_KEY = "inner_progress"
PREV_OPT_STATE_KEY = "inner_opt_prev"  # the inner state at the server's newest checkpoint (run.checkpoint_every)
PREV_PROGRESS_KEY = "inner_progress_prev"
# The field of the PREV_PROGRESS_KEY record naming the server checkpoint (its outer step) the kept
# state belongs to; absent in a record from before it was kept, which held the state from before
# the node's last round.
KEPT_AT_FIELD = "checkpoint_step"
# The error-feedback residual of the compressed uplink (wire.compress, docs/compression.md): one fp32
# array "residual" of the model's numel, per site and per run; absent = zero (a site that joins or
# restarts without it starts from zero). With checkpoints on, the residual at the newest checkpoint too.
EF_RESIDUAL_KEY = "uplink_residual"
PREV_EF_RESIDUAL_KEY = "uplink_residual_prev"
# The field of the progress record naming the optimizer kind whose state OPT_STATE_KEY holds
# (InnerTrainer.optimizer_kind: adamw, muon or custom); absent in a record from before it was kept.
OPTIMIZER_FIELD = "optimizer"
INNER_STATE_KEYS = (OPT_STATE_KEY, PROGRESS_KEY, PREV_OPT_STATE_KEY, PREV_PROGRESS_KEY, EF_RESIDUAL_KEY,
                    PREV_EF_RESIDUAL_KEY)


def state_path(state_dir: str, run_name: str, partition_id: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name) or "run"
    return Path(state_dir) / safe / f"partition-{partition_id}.pt"


def save_inner_state(state: RecordDict, keys: tuple[str, ...], path: Path) -> None:
    """Write the named records of ``state`` (ArrayRecords and ConfigRecords) atomically."""
    payload: dict[str, dict] = {"arrays": {}, "configs": {}}
    for key in keys:
        if key in state.array_records:
            payload["arrays"][key] = {k: tensor_of(a) for k, a in state.array_records[key].items()}
        elif key in state.config_records:
            payload["configs"][key] = dict(state.config_records[key])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(encode_checkpoint(payload))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def load_inner_state(state: RecordDict, path: Path) -> bool:
    """Fill ``state`` from ``path``; False (and a warning for a damaged file) when nothing was
    loaded. Nothing is changed unless the whole file verifies."""
    if not path.is_file():
        return False
    try:
        payload = decode_checkpoint(path.read_bytes())
        arrays = {k: ArrayRecord({n: array_of(t) for n, t in v.items()}) for k, v in payload["arrays"].items()}
        configs = {k: ConfigRecord(dict(v)) for k, v in payload["configs"].items()}
    except (CheckpointError, KeyError, AttributeError, TypeError) as exc:
        log.warning("inner state file %s is unusable (%s): starting from a fresh inner optimizer", path, exc)
        return False
    for k, v in {**arrays, **configs}.items():
        state[k] = v
    log.info("restored the inner state from %s", path)
    return True


def opt_record(trainer: InnerTrainer | DataParallelTrainer) -> ArrayRecord:
    """The trainer's inner optimizer state as the ArrayRecord kept under `OPT_STATE_KEY` (one
    array per parameter and state key, written by `array_of`: dozens per train message)."""
    return ArrayRecord({k: array_of(v) for k, v in trainer.optimizer_state().items()})


def opt_from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The optimizer state `opt_record` kept, as the tensors a trainer loads."""
    return {k: tensor_of(a) for k, a in record.items()}


def start_opt_state(state: RecordDict, kind: str) -> ArrayRecord | None:
    """The stored inner optimizer state this job starts from, or None for a fresh optimizer.

    A state another optimizer kind wrote (``client.optimizer`` changed between runs that share the
    node's state, e.g. a resumed server reading the state from disk) cannot be loaded: AdamW's
    moments are not Muon's momentum. It is dropped with a warning, together with the copy kept for
    a rewind, and the optimizer starts fresh; the schedule position is kept. A state without a
    kind tag (written before the tag existed) is loaded as before.
    """
    record = state.array_records.get(OPT_STATE_KEY)
    progress = state.config_records.get(PROGRESS_KEY)
    stored = None if progress is None else progress.get(OPTIMIZER_FIELD)
    if record is None or stored is None or stored == kind:
        return record
    log.warning("the stored inner optimizer state is %s's but this job's inner optimizer is %s "
                "(client.optimizer changed): starting from a fresh optimizer state", stored, kind)
    del state[OPT_STATE_KEY]
    if PREV_OPT_STATE_KEY in state.array_records:
        del state[PREV_OPT_STATE_KEY]
    return None


def progress_record(step: int, rounds: int, kind: str, **extra: int) -> ConfigRecord:
    """The progress record kept under `PROGRESS_KEY`: schedule position, rounds trained, the kind of
    the optimizer state stored beside it (`start_opt_state`) and ``extra`` (``last_round``)."""
    return ConfigRecord({"step": int(step), "rounds": int(rounds), OPTIMIZER_FIELD: kind, **extra})


def keeps_state_for(state: RecordDict, req: protocol.TrainRequest) -> bool:
    """Whether this train job must keep the state it starts from: checkpoints are on and what the
    node kept is not from the server's newest checkpoint (``req.checkpoint_step``), so this is the
    node's first round since it. The state a round starts from is the state the node had at the
    checkpoint: it trained nothing in between."""
    if req.checkpoint_step is None:
        return False
    kept = state.config_records.get(PREV_PROGRESS_KEY)
    return kept is None or kept.get(KEPT_AT_FIELD) != req.checkpoint_step


def kept_progress(start_progress: ConfigRecord, req: protocol.TrainRequest) -> ConfigRecord:
    """The progress record kept beside the state a round starts from (`keeps_state_for`), tagged
    with the checkpoint it belongs to."""
    return ConfigRecord({**dict(start_progress), KEPT_AT_FIELD: int(req.checkpoint_step or 0)})


def rewind_to_round(state: RecordDict, req: protocol.TrainRequest) -> None:
    """A synchronous server that resumed from a checkpoint sends again the rounds after it, which
    this node may have trained already (the server crashed after the node replied, up to
    ``run.checkpoint_every`` rounds later). The node kept the inner state it had at that
    checkpoint (`keeps_state_for`): it goes back to it, so the rounds are redone from the same
    start and the run stays bit-identical to one that never stopped. A state kept at another
    checkpoint (the server resumed from an older one, its newest did not verify) cannot be used:
    the node continues from its current state and says so."""
    if req.checkpoint_step is None:
        return
    progress = state.config_records.get(PROGRESS_KEY)
    if progress is None or "last_round" not in progress:
        return
    rnd, last = req.round, int(progress["last_round"])
    if rnd > last:
        return
    kept = state.config_records.get(PREV_PROGRESS_KEY)
    at = None if kept is None else kept.get(KEPT_AT_FIELD)
    # a record without the tag (written before it was kept) held the state from before the last round
    if kept is not None and (at == req.checkpoint_step or (at is None and rnd == last)):
        if PREV_OPT_STATE_KEY in state.array_records:
            state[OPT_STATE_KEY] = state.array_records[PREV_OPT_STATE_KEY]
        elif OPT_STATE_KEY in state.array_records:  # the node's first round came after it: a fresh optimizer
            del state[OPT_STATE_KEY]
        if PREV_EF_RESIDUAL_KEY in state.array_records:  # the compressed uplink's residual, likewise
            state[EF_RESIDUAL_KEY] = state.array_records[PREV_EF_RESIDUAL_KEY]
        elif EF_RESIDUAL_KEY in state.array_records:
            del state[EF_RESIDUAL_KEY]
        state[PROGRESS_KEY] = ConfigRecord({k: v for k, v in kept.items() if k != KEPT_AT_FIELD})
        log.info("round %d sent again (server resumed from its checkpoint after step %d): rewound the inner "
                 "state to that checkpoint", rnd, req.checkpoint_step)
        return
    where = ("no checkpoint" if kept is None else f"the checkpoint after step {at}" if at is not None
             else f"the start of round {last} (a state file of an older fl-geo)")
    log.warning("round %d sent again by a server resumed from its checkpoint after step %d, but this node kept "
                "its state at %s: continuing from its inner state after round %d (the run is no longer "
                "bit-identical)", rnd, req.checkpoint_step, where, last)


def state_file(context: Context, req: protocol.JobRequest, pid: int) -> Path | None:
    """Where this node keeps its inner state on disk: its node config ``state-dir``, else the
    run's ``run.client_state_dir`` (simulation); off when neither is set."""
    state_dir = str(context.node_config.get("state-dir", "") or req.state_dir or "")
    return state_path(state_dir, req.run_name, pid) if state_dir else None
