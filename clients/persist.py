"""A datacenter's inner state on its own disk, so that it survives a restarted server.

Flower keeps ``context.state`` per node *per run*: when a crashed ServerApp is started again with
``flwr run`` it is a new run, and every node would start over with fresh AdamW moments and step
count. A SuperNode started with ``--node-config 'state-dir="/var/lib/fl-geo"'`` writes its inner
state (the AdamW moments, the schedule position and, with checkpoints on, the state from before
its last round) after every train job to ``<state-dir>/<run name>/partition-<id>.pt`` (atomic
write then rename, sha256-verified like the server's checkpoints) and reads it back only when a
server that *resumed from a checkpoint* sends it work with an empty ``context.state``. A new run
that merely reuses the name never picks up stale state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_geo.core.checkpoint import CheckpointError, decode_checkpoint, encode_checkpoint

log = logging.getLogger("fl_geo")


def state_path(state_dir: str, run_name: str, partition_id: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name) or "run"
    return Path(state_dir) / safe / f"partition-{partition_id}.pt"


def save_inner_state(state: RecordDict, keys: tuple[str, ...], path: Path) -> None:
    """Write the named records of ``state`` (ArrayRecords and ConfigRecords) atomically."""
    payload: dict[str, dict] = {"arrays": {}, "configs": {}}
    for key in keys:
        if key in state.array_records:
            payload["arrays"][key] = {k: torch.from_numpy(a.numpy()) for k, a in state.array_records[key].items()}
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
        arrays = {k: ArrayRecord({n: Array(t.numpy()) for n, t in v.items()}) for k, v in payload["arrays"].items()}
        configs = {k: ConfigRecord(dict(v)) for k, v in payload["configs"].items()}
    except (CheckpointError, KeyError, AttributeError, TypeError) as exc:
        log.warning("inner state file %s is unusable (%s): starting from a fresh inner optimizer", path, exc)
        return False
    for k, v in {**arrays, **configs}.items():
        state[k] = v
    log.info("restored the inner state from %s", path)
    return True
