"""``--resume`` of ``fl-geo run``, ``fl-geo compare`` and ``fl-geo sweep``: run a command again and
it goes on where it stopped, instead of refusing the runs it already made. The study scripts
(``examples/*study*.sh``, ``examples/method_table.sh``) resume through ``fl-geo run --resume`` too,
so these rules live here only.

For each run the command plans (``OUT/<run.name>`` for ``run``, ``OUT/runs/<run.name>`` for the
others), `plan_run` decides from what is on disk:

- **nothing there**: the run starts;
- **finished** (``summary.json`` is written last) with the same run identity
  (`fl_geo.run_identity.run_identity` of its ``config.yaml``: every config value that shapes the
  training; ``run.rounds``, ``run.max_tokens`` and the other `RESUME_MAY_CHANGE` keys aside): it
  is reused as it is, not run again;
- **interrupted** after writing a checkpoint (the config has ``run.checkpoint_every``): it
  continues from its newest checkpoint (``run.resume=true``; synchronous and streaming methods
  then end bit-identical to an uninterrupted run);
- **interrupted** before any checkpoint: its folder is moved aside to
  ``<name>.interrupted-<epoch seconds>`` (kept, never deleted) and the run starts again;
- a run of **another config** in that folder (a finished or interrupted one): a one-line
  `ConfigError` naming the keys that differ, before anything runs or moves;
- a run that is **still going** (the same command started twice: its ``run.lock`` is held): a
  one-line `OutputError` naming its pid; it is neither continued nor moved.

A run's ``config.yaml`` is written when it starts, so every case above can be told apart; a folder
without one is not a run of ours and is refused too.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.errors import ConfigError
from fl_geo.runtime.run_lock import RunLock

if TYPE_CHECKING:
    from fl_geo.config import FlGeoConfig

__all__ = ["RunPlan", "check_resumable", "plan_run"]

log = logging.getLogger("fl_geo")


@dataclass(frozen=True)
class RunPlan:
    """What `plan_run` decided: ``action`` is ``start``, ``reuse`` or ``continue``; ``cfg`` the config
    to run (``run.resume`` set for ``continue``); ``summary`` the finished run's (``reuse``)."""

    action: str
    cfg: FlGeoConfig
    summary: dict[str, Any] | None = None


def _identity_diff(ours: dict[str, Any], theirs: dict[str, Any], limit: int = 4) -> str:
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k, "<unset>") != theirs.get(k, "<unset>"))
    parts = [f"{k}: {theirs.get(k, '<unset>')!r} there, {ours.get(k, '<unset>')!r} now" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts)


def _checkpoint_dir(cfg: FlGeoConfig, run_dir: Path) -> Path:
    return Path(cfg.run.checkpoint_dir) if cfg.run.checkpoint_dir else run_dir / "checkpoints"


def plan_run(cfg: FlGeoConfig, run_dir: str | Path, dry: bool = False) -> RunPlan:
    """Decide what ``--resume`` does with the run ``cfg`` would make in ``run_dir`` (module
    docstring); moves an interrupted run without a checkpoint aside unless ``dry`` (the check of
    every planned run before the first one starts). Raises ConfigError for a folder holding
    another config's run."""
    from fl_geo.config import load_config
    from fl_geo.run_identity import run_identity

    run_dir = Path(run_dir)
    if not run_dir.exists():
        return RunPlan("start", cfg)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume: {run_dir} exists but holds no fl-geo run (no config.yaml); move it away "
                          "or use another --out")
    try:
        earlier = run_identity(load_config(path))
    except Exception as exc:  # noqa: BLE001 (a damaged config.yaml, whatever it raises, is one line)
        raise ConfigError(f"--resume: {path} is unreadable ({type(exc).__name__}: {exc}); move {run_dir} away") from None
    ours = run_identity(cfg)
    if earlier != ours:
        raise ConfigError(f"--resume: {run_dir} holds a run of another config ({_identity_diff(ours, earlier)}); "
                          "use another --out, or move it away")
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--resume: {summary_path} is unreadable ({exc}); move {run_dir} away") from None
        if not dry:
            log.info("--resume: %s finished earlier with this config: reused", run_dir)
        return RunPlan("reuse", cfg, {**summary, "run_dir": str(run_dir)})
    # not finished: a run that is still going (this command started twice) holds its lock; it is
    # neither continued nor moved from under its writer
    probe = RunLock(run_dir)
    probe.acquire()  # OutputError naming the holder
    probe.release()
    if CheckpointStore(_checkpoint_dir(cfg, run_dir)).steps():
        resumed = copy.deepcopy(cfg)
        resumed.run.resume = True
        if not dry:
            log.info("--resume: %s was interrupted: it continues from its newest checkpoint", run_dir)
        return RunPlan("continue", resumed)
    if dry:
        return RunPlan("start", cfg)
    aside = run_dir.with_name(f"{run_dir.name}.interrupted-{int(time.time())}")
    run_dir.rename(aside)
    log.warning("--resume: %s was interrupted before any checkpoint (set run.checkpoint_every to continue such "
                "runs): moved to %s, it runs again", run_dir, aside.name)
    return RunPlan("start", cfg)


def check_resumable(cfgs: list[FlGeoConfig], runs_dir: str | Path) -> None:
    """`plan_run` of every planned run with nothing moved: a folder of another config anywhere is
    a ConfigError before the first run starts."""
    for cfg in cfgs:
        plan_run(cfg, Path(runs_dir) / cfg.run.name, dry=True)
