"""A datacenter's inner state: its records in ``context.state`` (the AdamW moments and the
schedule position, `opt_record`; the state from before the last round, `rewind_to_round`) and
their copy on the node's own disk, so that they survive a restarted server.

Flower keeps ``context.state`` per node *per run*: when a crashed ServerApp is started again with
``flwr run`` it is a new run, and every node would start over with fresh AdamW moments and step
count. A SuperNode started with ``--node-config 'state-dir="/var/lib/fl-geo"'`` writes its inner
state (the AdamW moments, the schedule position, the compressed uplink's error-feedback residual
and, with checkpoints on, the state from before
its last round) after every train job to ``<state-dir>/<run name>/partition-<id>.pt`` (atomic
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
PREV_OPT_STATE_KEY = "inner_opt_prev"  # the inner state before the last round (run.checkpoint_every)
PREV_PROGRESS_KEY = "inner_progress_prev"
# The error-feedback residual of the compressed uplink (wire.compress, docs/compression.md): one fp32
# array "residual" of the model's numel, per site and per run; absent = zero (a site that joins or
# restarts without it starts from zero). With checkpoints on, the residual from before the last round too.
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


def rewind_to_round(state: RecordDict, req: protocol.TrainRequest) -> None:
    """A synchronous server that resumed from a checkpoint may send a round this node already
    trained (it crashed after the node replied). With ``keep_prev`` the node kept the inner state
    from before its last round: it goes back to it, so the round is redone from the same start and
    the run stays bit-identical to one that never stopped. Anything older cannot be rewound: the
    node continues from its current state and says so."""
    if not req.keep_prev:
        return
    progress = state.config_records.get(PROGRESS_KEY)
    if progress is None or "last_round" not in progress:
        return
    rnd, last = req.round, int(progress["last_round"])
    if rnd > last:
        return
    prev = state.config_records.get(PREV_PROGRESS_KEY)
    if rnd == last and prev is not None:
        if PREV_OPT_STATE_KEY in state.array_records:
            state[OPT_STATE_KEY] = state.array_records[PREV_OPT_STATE_KEY]
        else:  # the round being redone was this node's first: it started with a fresh optimizer
            del state[OPT_STATE_KEY]
        if PREV_EF_RESIDUAL_KEY in state.array_records:  # the compressed uplink's residual, likewise
            state[EF_RESIDUAL_KEY] = state.array_records[PREV_EF_RESIDUAL_KEY]
        elif EF_RESIDUAL_KEY in state.array_records:
            del state[EF_RESIDUAL_KEY]
        state[PROGRESS_KEY] = prev
        log.info("round %d sent again (server resumed): rewound the inner state to before it", rnd)
        return
    log.warning("round %d sent again but this node's state is from round %d and only one round can be "
                "rewound: continuing from the current inner state (the run is no longer bit-identical)", rnd, last)


def state_file(context: Context, req: protocol.JobRequest, pid: int) -> Path | None:
    """Where this node keeps its inner state on disk: its node config ``state-dir``, else the
    run's ``run.client_state_dir`` (simulation); off when neither is set."""
    state_dir = str(context.node_config.get("state-dir", "") or req.state_dir or "")
    return state_path(state_dir, req.run_name, pid) if state_dir else None
