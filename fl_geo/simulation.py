"""Run an experiment as an in-process Flower simulation (``fl-geo run``).

``flwr run .`` with a local federation starts a detached simulation SuperLink that outlives the
command (docs/flower.md); a laptop tool and its tests must own the processes they start. So
``fl-geo run`` uses Flower's in-process runtime: the ServerApp runs in a thread of this process, the
ClientApps in Ray actors that are shut down when the run ends. Concurrency follows the measured
rule for small CPUs: one actor per Ray CPU, one torch thread per actor.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

from fl_geo.config import ConfigError, FlGeoConfig
from fl_geo.ray_cluster import backend_config as ray_backend_config
from fl_geo.ray_cluster import check_reachable
from fl_geo.runtime.interrupt import stop_on_ctrl_c
from fl_geo.runtime.session import new_run_dir
from fl_geo.server_app import make_server_app

log = logging.getLogger("fl_geo")


class _DropRunSimulationDeprecation(logging.Filter):
    """fl-geo calls ``run_simulation`` on purpose (it owns the processes it starts, unlike
    ``flwr run`` with a local federation); the deprecation notice would only confuse users."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "run_simulation" not in msg and "This is a deprecated feature" not in msg


def backend_config(cfg: FlGeoConfig) -> dict[str, Any]:
    """Ray sizing: a local Ray of ``sim_cpus`` CPUs or the cluster at ``run.ray_address``; each
    actor reserves ``run.client_cpus`` / ``run.client_gpus`` (fl_geo.ray_cluster)."""
    return ray_backend_config(cfg.run)


def run_flower_simulation(cfg: FlGeoConfig, server_app: Any, client_app: Any) -> None:
    """Flower's simulation runtime for ``server_app``/``client_app``, sized and quieted for fl-geo.

    Ray is started and shut down by Flower's ``run_simulation`` within this call.
    """
    from flwr.simulation import run_simulation as flwr_run_simulation

    # Child processes (Ray actors) inherit these: one BLAS/OpenMP thread each, no oversubscription.
    os.environ["OMP_NUM_THREADS"] = str(cfg.run.threads_per_client)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    flwr_logger = logging.getLogger("flwr")
    quiet = _DropRunSimulationDeprecation()
    flwr_logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            flwr_run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=cfg.run.num_clients,
                backend_config=backend_config(cfg),
            )
    finally:
        flwr_logger.removeFilter(quiet)


def preflight(cfg: FlGeoConfig) -> None:
    """Check what the ServerApp needs before any Flower machinery starts, so a missing corpus, a
    wrong ``data.text_key``, a ``client.device`` this machine lacks, a corpus too small for ``run.num_clients`` or an experiment tracker
    that is not installed is one line (a `ConfigError` / `FileNotFoundError`) instead of a
    traceback from inside the ServerApp thread. The corpus is memoised per process, so the
    server's evaluator reuses it."""
    from fl_geo.runtime.builders import partitions
    from fl_geo.runtime.loggers import check_trackers

    check_trackers(list(cfg.run.loggers))  # an uninstalled tracker is one line, before anything starts
    from fl_geo.inner.device import pick_device

    if cfg.run.backend == "ray" and cfg.run.ray_address.strip():
        # the clients run on the cluster's nodes, whose devices this machine cannot check
        check_reachable(cfg.run.ray_address)
    else:
        try:  # a simulation's clients run on this machine: their device must exist here
            pick_device(cfg.client.device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"client.device={cfg.client.device}: {exc} (a simulation's clients run on this "
                              "machine)") from None
        if cfg.run.backend == "ray" and cfg.run.client_gpus > 0:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"run.client_gpus={cfg.run.client_gpus}: this machine has no CUDA GPU for "
                                  "the local Ray to share out (0 = CPU actors)")
    partitions(cfg.data, cfg.run.num_clients)
    if cfg.run.wall_faults:  # a scenario without a failure trace is one line, before Ray starts
        from fl_geo.strategies.loops import make_wall_faults

        make_wall_faults(cfg, 1)


def run_simulation(cfg: FlGeoConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run ``cfg`` with ``run.num_clients`` virtual datacenters; returns the run summary.

    Ctrl-C during the run stops it at the next step and still writes the summary (its
    ``interrupted`` is true; fl_geo/runtime/interrupt.py)."""
    preflight(cfg)
    with stop_on_ctrl_c():
        return _run_simulation(cfg, run_dir)


def _run_simulation(cfg: FlGeoConfig, run_dir: str | Path | None) -> dict[str, Any]:
    import json

    from fl_geo.clients.datacenter import app as client_app

    run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
    if (cfg.run.checkpoint_every or cfg.run.resume) and not cfg.run.client_state_dir:
        # A restarted simulation starts new client processes: their inner state must be on disk.
        cfg.run.client_state_dir = str((run_dir / "client_state").resolve())
    if cfg.run.backend == "inline":
        from fl_geo.runtime.inline import InlineGrid
        from fl_geo.server_app import run_server

        return run_server(InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed), cfg, run_dir)
    run_flower_simulation(cfg, make_server_app(cfg, run_dir), client_app)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the simulation ended without a summary; see the log above and {run_dir}")
    return json.loads(summary_path.read_text())
