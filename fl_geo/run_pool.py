"""``--jobs N`` of ``fl-geo compare`` and ``fl-geo sweep``: the planned runs, N at a time.

Each run is its own ``fl-geo run CONFIG --out OUT/runs`` process (the config resolved and written to
``OUT/runs/.configs/<run.name, '=' as '_'>.yaml``, its output to ``OUT/runs/.logs/<run.name>.log``: dot folders stay out of ``OUT/runs/*``), so runs share no
torch state, a crash takes down one run only, and each run is exactly what ``fl-geo run`` makes of
the same config: with the same threads a run gives the same bits whether it ran alone or beside
others. The table is then built from the finished runs' folders, as ``--resume`` reads them.

Why processes and not one pool of threads: a simulation sets torch's thread count and seeds for its
whole process; two in one process would change each other's numbers.

Threads: a run uses the threads its config gives it (``run.sim_cpus``); N runs of ``sim_cpus`` c
want N·c cores, and more than the machine has slows every run down far more than N-fold (a warning
says so). Nothing in a config is changed behind the user's back.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from fl_geo.config_files import to_yaml
from fl_geo.errors import ConfigError
from fl_geo.run_reuse import RunPlan, plan_run

if TYPE_CHECKING:
    from fl_geo.config import FlGeoConfig

__all__ = ["run_in_parallel"]

log = logging.getLogger("fl_geo")


def _plans(cfgs: list[FlGeoConfig], runs_dir: Path, resume: bool) -> list[RunPlan]:
    """What each run needs (`plan_run` with ``resume``); without it, a folder already there is
    refused for every run before any starts, as one ``fl-geo run`` would refuse it."""
    if resume:
        for cfg in cfgs:  # every folder checked before anything moves
            plan_run(cfg, runs_dir / cfg.run.name, dry=True)
        return [plan_run(cfg, runs_dir / cfg.run.name) for cfg in cfgs]
    taken = [cfg.run.name for cfg in cfgs if (runs_dir / cfg.run.name).exists()]
    if taken:
        raise ConfigError(f"{runs_dir} already holds run(s) {', '.join(taken)}: add --resume to reuse or continue "
                          "them, or choose another --out")
    return [RunPlan("start", cfg) for cfg in cfgs]


def run_in_parallel(cfgs: list[FlGeoConfig], runs_dir: str | Path, jobs: int, resume: bool = False) -> None:
    """Run ``cfgs`` into ``runs_dir/<run.name>``, ``jobs`` processes at a time (finished ones
    reused and interrupted ones continued with ``resume``). Returns when every run has its
    ``summary.json``; raises RuntimeError naming the log of a run that ended without one."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    runs_dir = Path(runs_dir)
    plans = [p for p in _plans(cfgs, runs_dir, resume) if p.summary is None]
    cores = os.cpu_count() or 1
    wanted = max((p.cfg.run.sim_cpus for p in plans), default=0) * min(jobs, len(plans))
    if wanted > cores:
        log.warning("--jobs %d with run.sim_cpus up to %d wants %d cores, this machine has %d: every run slows "
                    "down by more than that (set run.sim_cpus=%d)", jobs, wanted // max(1, min(jobs, len(plans))),
                    wanted, cores, max(1, cores // jobs))
    config_dir, log_dir = runs_dir / ".configs", runs_dir / ".logs"
    config_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(exist_ok=True)

    def one(k: int, plan: RunPlan) -> tuple[str, int]:
        name = plan.cfg.run.name
        path = config_dir / f"{name.replace('=', '_')}.yaml"  # a '=' would make the CLI read it as an override
        path.write_text(to_yaml(plan.cfg), encoding="utf-8")
        started = time.perf_counter()
        print(f"run {k}/{len(plans)} started: {name}", file=sys.stderr, flush=True)
        with (log_dir / f"{name}.log").open("w", encoding="utf-8") as out:
            rc = subprocess.run([sys.executable, "-m", "fl_geo.cli", "run", str(path), "--out", str(runs_dir)],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                check=False).returncode
        print(f"run {k}/{len(plans)} ended: {name} (exit {rc}, {time.perf_counter() - started:.0f} s)",
              file=sys.stderr, flush=True)
        return name, rc

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda kp: one(*kp), enumerate(plans, start=1)))
    missing = [(name, rc) for name, rc in results if not (runs_dir / name / "summary.json").is_file()]
    if missing:
        raise RuntimeError("; ".join(f"run {name} ended without a summary (exit {rc}): see {log_dir / (name + '.log')}"
                                     for name, rc in missing))
