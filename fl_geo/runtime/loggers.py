"""Optional experiment trackers next to the JSONL file and TensorBoard: Weights & Biases and MLflow.

``run.loggers: [wandb]`` (or ``[mlflow]``, or both) sends every logged record to the tracker as
well. Neither package is a dependency of fl-geo (``pip install fl-geo[wandb]`` / ``fl-geo[mlflow]``);
naming one that is not installed is a one-line config error before the run starts. The JSONL file
stays the record the compare tool reads; a tracker that fails mid-run is logged and dropped, never
the run.

Settings come from the trackers' own environment variables, so nothing secret is in a config:
``WANDB_PROJECT`` (default ``fl-geo``), ``WANDB_MODE=offline``, ``WANDB_API_KEY``;
``MLFLOW_TRACKING_URI`` (default ``./mlruns``), ``MLFLOW_EXPERIMENT_NAME`` (default ``fl-geo``).
Each run is named after ``run.name`` and carries the resolved config (W&B ``config``, MLflow
params of the flattened config).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from fl_geo.errors import ConfigError

__all__ = ["TRACKERS", "MlflowTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers"]

log = logging.getLogger("fl_geo")

TRACKERS = ("wandb", "mlflow")
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


class Tracker(Protocol):
    """What `MetricsLogger` hands each record to."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


def check_trackers(names: list[str]) -> None:
    """A `ConfigError` for an unknown tracker or one whose package is not installed."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"run.loggers: '{name}' is unknown; valid: {', '.join(TRACKERS)} "
                              "(metrics.jsonl is always written; TensorBoard is run.tensorboard)")
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ConfigError(f"run.loggers includes {name}, which is not installed: pip install 'fl-geo[{name}]'")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class WandbTracker:
    """One W&B run; metric names as fl-geo logs them (``val/loss`` groups under ``val``)."""

    def __init__(self, run_name: str, config: Mapping[str, Any], run_dir: str) -> None:
        wandb = importlib.import_module("wandb")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fl-geo"), name=run_name,
                               config=dict(config), dir=run_dir, reinit=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """One MLflow run in ``MLFLOW_EXPERIMENT_NAME`` (default ``fl-geo``)."""

    def __init__(self, run_name: str, config: Mapping[str, Any], run_dir: str) -> None:
        self._mlflow = importlib.import_module("mlflow")
        self._mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "fl-geo"))
        self._run = self._mlflow.start_run(run_name=run_name)
        params = {k: str(v)[:500] for k, v in _flatten(config).items()}  # MLflow caps a value at 500 chars
        self._mlflow.log_params(params)
        self._mlflow.set_tag("fl_geo.run_dir", run_dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


_CLASSES = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(names: list[str], run_name: str, config: Mapping[str, Any], run_dir: str) -> list[Tracker]:
    """Start one tracker run per name (after `check_trackers`)."""
    check_trackers(names)
    return [_CLASSES[name](run_name, config, run_dir) for name in names]
