"""The fl-geo ServerApp: builds the global model and runs the configured outer loop on the grid.

Two ways in, one code path:
- ``fl-geo run CONFIG`` resolves the config itself and hands it to :func:`make_server_app`;
- ``flwr run .`` loads the module-level ``app``, which reads ``config`` (a YAML path) and
  ``overrides`` (dotted ``key=value`` pairs) from the Flower run config (``[tool.flwr.app.config]``).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import shlex
from pathlib import Path
from typing import Any

import flwr
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fl_geo import __version__
from fl_geo.config import (
    ConfigError,
    FlGeoConfig,
    load_config,
    run_identity,
    to_dict,
)
from fl_geo.core.checkpoint import Checkpoint, CheckpointStore, identity_diff
from fl_geo.core.state import ParamSpec
from fl_geo.paths import PROJECT_ROOT
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.evaluation import GlobalEvaluator
from fl_geo.runtime.progress import Progress
from fl_geo.runtime.session import RESULT_FILES, RunSession
from fl_geo.strategies import build_strategy

log = logging.getLogger("fl_geo")




def config_from_run_config(run_config: dict[str, Any]) -> FlGeoConfig:
    """Resolve the YAML path + overrides that ``flwr run`` passes in the run config."""
    name = str(run_config.get("config", "")).strip()
    if not name:
        raise ConfigError("run config key 'config' (a YAML file under configs/) is empty")
    path = Path(name)
    if not path.is_absolute() and not path.exists():
        path = PROJECT_ROOT / name  # the app directory when run from a checkout
    overrides = shlex.split(str(run_config.get("overrides", "")))
    # Flat keys (``run.rounds=4``, declared in pyproject.toml's [tool.flwr.app.config]); "" = unset.
    flat = [f"{key}={_flat_value(value)}" for key, value in run_config.items()
            if key not in ("config", "overrides") and value != ""]
    return load_config(path, overrides + flat)


def _flat_value(value: Any) -> str:
    """A run-config value as an override's right-hand side (TOML ``true`` is Python ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def machine_record() -> dict[str, Any]:
    """What of the machine can change a run's bits for the same seed: the CPU architecture and
    model, the kernel set torch dispatches to (``AVX512``, ``AVX2``, ``DEFAULT``: the width of the
    vectorised reductions) and torch's thread count. The same seed and config on two machines
    can end a few tenths of a percent apart, more for an unstable setting (long-budget study, H
    sweep re-run); recorded so that a kept result says which machine it came from."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"machine": platform.machine(), "cpu": cpu or platform.processor(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads()}


def _meta(cfg: FlGeoConfig, spec: ParamSpec, evaluator: GlobalEvaluator | None) -> dict[str, Any]:
    from fl_geo.data import get_corpus
    from fl_geo.runtime.builders import tokenizer

    corpus = get_corpus(cfg.data.corpus, cfg.data.data_dir or None, list(cfg.data.files) or None, cfg.data.text_key,
                        cfg.data.path, cfg.data.text_field)
    return {
        "fl_geo": __version__,
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **machine_record(),
        "num_params": spec.numel,
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "tokenizer": cfg.data.tokenizer,
        "tokenizer_sha256": tokenizer(cfg.data).sha256,
        "param_spec_sha256": hashlib.sha256(spec.to_json().encode()).hexdigest(),
        "val_tokens": evaluator.num_tokens if evaluator else 0,
        "config": to_dict(cfg),
    }


def open_checkpoints(cfg: FlGeoConfig, run_dir: Path) -> tuple[CheckpointStore | None, Checkpoint | None]:
    """The run's checkpoint store (when ``run.checkpoint_every`` > 0 or ``run.resume``) and,
    with ``run.resume``, the checkpoint to continue from. Raises ConfigError, before anything
    on disk changes, whenever going on could lose or mix results:

    - a new run (no ``run.resume``) whose checkpoint directory already holds checkpoint files:
      they are an earlier run's (of this config or another), and writing ours beside them would
      let a later resume or the pruning confuse the two;
    - ``run.resume`` where checkpoint files exist but none verifies (all damaged): starting
      fresh would silently throw the run's progress away;
    - ``run.resume`` where the newest checkpoint that verifies was written by another run
      configuration (its run identity, `fl_geo.config.run_identity`, differs): the message names
      the keys that differ;
    - ``run.resume`` with no checkpoint file at all while ``run_dir`` holds results of an
      earlier run (`RESULT_FILES`): a fresh start would replace them.

    ``run.resume`` with no checkpoint file and nothing to replace starts a new run (logged at
    WARNING), so one command serves a first start and a restart. A damaged newest checkpoint
    is skipped for the previous one that verifies (warning), as before."""
    r = cfg.run
    if not r.checkpoint_every and not r.resume:
        return None, None
    identity = run_identity(cfg)
    store = CheckpointStore(Path(r.checkpoint_dir) if r.checkpoint_dir else run_dir / "checkpoints",
                            r.checkpoint_keep, identity=identity)
    present = store.steps()
    if not r.resume:
        if present:
            newest = store.path_for(present[-1])
            whose = ("this config's" if store.owns(present[-1])
                     else "another config's or an unreadable one")
            raise ConfigError(
                f"{store.directory} already holds {len(present)} checkpoint file(s) of an earlier run (newest "
                f"{newest.name}: {whose}); a new run does not write beside them. Continue that run with "
                "run.resume=true, or move them away, or set run.checkpoint_dir to an empty directory")
        return store, None
    if not present:
        earlier = [name for name in RESULT_FILES if (run_dir / name).exists()]
        if earlier:
            raise ConfigError(
                f"run.resume=true but {store.directory} holds no checkpoint, and {run_dir} holds results of an "
                f"earlier run ({', '.join(earlier)}) that a fresh start would replace; nothing was changed. "
                "Point run.checkpoint_dir at the run's checkpoints, or start a new run in another directory")
        log.warning("fl-geo: run.resume=true but %s holds no checkpoint: starting a new run", store.directory)
        return store, None
    latest = store.load_latest()
    if latest is None:
        raise ConfigError(
            f"run.resume=true but none of the {len(present)} checkpoint file(s) in {store.directory} verifies "
            "(each was skipped with a warning above: truncated, damaged or of another format); nothing was "
            "changed. Move them away to start a new run")
    if latest.identity != identity:
        raise ConfigError(
            f"cannot resume from {latest.path}: it was written by another run configuration "
            f"({identity_diff(identity, latest.identity)}); resume with the config that wrote it, or start a "
            "new run with another run.checkpoint_dir")
    return store, latest


def run_server(grid: Grid, cfg: FlGeoConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one experiment to completion on ``grid``; returns (and writes) the run summary.

    The method is the public strategy class the registry names (`build_strategy`), driven through
    Flower's ``start()`` exactly as a user's own ServerApp would; this function adds what the CLI
    owns: the run directory, metrics files, checkpoints and resume, the built-in model and the
    held-out-text evaluator, the final model and summary.json.
    """
    session = RunSession(cfg, run_dir)
    run_dir = session.run_dir
    session.lock()  # before the checkpoints are read: a second run into this directory stops here
    try:
        store, checkpoint = open_checkpoints(cfg, run_dir)
        # a resumed run gets back the metrics up to its checkpoint; a new one starts clean
        logger = session.open(history=checkpoint.state["history"] if checkpoint is not None else None)
    except BaseException:
        session.close()
        raise
    with session:
        model = make_model(cfg.model, cfg.run.seed)
        initial_arrays = ArrayRecord(model.state_dict())
        del model

        def on_ready(spec: ParamSpec, profiles: dict[int, Any], evaluator: GlobalEvaluator) -> None:
            logger.write_json("meta.json", _meta(cfg, spec, evaluator))
            log.info("fl-geo: %s with %d nodes, %d parameters, run dir %s",
                     cfg.strategy.name, len(profiles), spec.numel, run_dir)

        strategy = build_strategy(
            cfg, logger=logger, checkpoints=store, resume_from=checkpoint,
            progress=Progress(cfg.run.name, cfg.run.rounds, enabled=cfg.run.progress,
                     max_tokens=cfg.run.max_tokens),
            evaluator=lambda num_partitions: GlobalEvaluator(cfg, num_partitions), on_ready=on_ready,
        )
        strategy.start(grid, initial_arrays, num_rounds=cfg.run.rounds, timeout=cfg.strategy.round_timeout_s)
        stats = strategy.stats
        session.save_model(strategy.loop.global_params, strategy.loop.spec)
        return session.finish({
            "name": cfg.run.name,
            "strategy": cfg.strategy.name,
            "outer_optimizer": cfg.strategy.outer_optimizer,
            "rounds": cfg.run.rounds,
            "outer_steps": stats.outer_steps,
            "final_val_loss": stats.last.get("val/loss"),
            "final_val_bpb": stats.last.get("val/bpb"),  # bits per byte (docs/data.md)
            "final_train_loss": stats.last.get("train/loss"),
            "tokens": stats.tokens,
            "bytes_up": stats.bytes_up,
            "bytes_down": stats.bytes_down,
            "rejected": stats.rejected,
            "accepted_updates": stats.accepted,
            "failed_jobs": stats.failed,
            "lost_to_failures": stats.lost_jobs,
            # share of provisioned node-time that produced folded progress, and where the rest
            # went (fl_geo.runtime.goodput); null on a wall clock
            "goodput": stats.last.get("goodput/ratio"),
            "goodput_s": {k.split("/", 1)[1].removesuffix("_s"): v for k, v in stats.last.items()
                          if k.startswith("goodput/") and k.endswith("_s")} or None,
            "failure": stats.failure,  # one line when the run must not count as a success, else null
            "interrupted": stats.interrupted,
            "late_replies": stats.late_replies,
            # nodes whose jobs were given up at their reply deadline (strategy.round_timeout_s /
            # reply_deadline_*): node id, partition, site, jobs given up, the deadline, late replies
            "late_nodes": stats.late_nodes,
            # the run's wall seconds: a resumed run's include those up to its checkpoint
            "wall_s": round(stats.wall_s + logger.wall_offset_s, 3),
            "virtual_s": stats.virtual_s,
            "scenario": stats.scenario,
            "num_params": stats.num_params,
            # HALoS: what the local servers sent the global one (compressed with halos.compress)
            **({"halos_bytes_to_global": int(stats.last.get("halos/bytes_to_global_total", 0))}
               if cfg.strategy.name == "halos" else {}),
        })


def make_server_app(cfg: FlGeoConfig, run_dir: str | Path | None = None) -> ServerApp:
    """A ServerApp bound to an already-resolved config (used by ``fl-geo run``)."""
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        run_server(grid, cfg, run_dir)

    return server


app = ServerApp()


def _log_to_stderr() -> None:
    """In deployment nothing configures the ``fl_geo`` logger, so its INFO lines (the run dir,
    checkpoints, "resumed from") would be dropped. Flower mirrors the ServerApp's stderr to
    ``flwr log``; ``fl-geo run`` configures the logger itself and is left alone."""
    logger = logging.getLogger("fl_geo")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run .`` (see ``[tool.flwr.app.config]`` in pyproject.toml)."""
    _log_to_stderr()
    summary = run_server(grid, config_from_run_config(dict(context.run_config)))
    if summary.get("failure"):
        # Flower then records the run as failed (``flwr ls``), so a sweep or CI job sees it.
        raise RuntimeError(f"fl-geo run {summary['name']} failed: {summary['failure']}")
