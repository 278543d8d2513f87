"""One run's directory and the process settings a ServerApp holds while it runs.

Every ServerApp fl-geo ships (the ServerApp of ``fl-geo run`` / ``flwr run .`` and HALoS's regional
and global tiers) opens its run the same way: a fresh run directory (or the one given) locked
against a second writer (`fl_geo.runtime.run_lock`), a new run refused where an earlier run's
results are (on resume, the metrics up to the checkpoint written back instead), the JSONL + TensorBoard logger, ``config.yaml`` with the resolved
config, and torch's intra-op threads set to ``run.server_threads``. On leaving, the threads are
restored, the logger closed and the lock released, whatever happened. Every file it writes is
replaced atomically (`fl_geo.atomic`): a full disk is one line naming the file, never a torn one. `RunSession` is that set-up, once.

The final model is written twice by `RunSession.save_model`: ``final_model.pt`` (the flat fp32
buffer and its `ParamSpec`, what the tests and older tools read) and, when the optional
``safetensors`` package is installed (``pip install fl-geo[safetensors]``),
``final_model.safetensors``: the model's state dict as named fp32 tensors, loadable without
fl-geo. ``fl_geo.results.load_run_model`` reads either.
"""

from __future__ import annotations

import logging
import shutil
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from fl_geo.atomic import atomic_path, write_bytes_atomic, write_text_atomic
from fl_geo.config import FlGeoConfig, section_to_json, to_dict, to_yaml
from fl_geo.core.state import ParamSpec, unflatten
from fl_geo.errors import OutputError
from fl_geo.runtime.loggers import open_trackers
from fl_geo.runtime.metrics import MetricsLogger, history_wall_s
from fl_geo.runtime.run_lock import RunLock

__all__ = ["RESULT_FILES", "SAFETENSORS_FORMAT", "RunSession", "new_run_dir", "write_history"]

log = logging.getLogger("fl_geo")

# What a finished run writes; a new run into the same directory must not inherit any of it.
RESULT_FILES = ("metrics.jsonl", "summary.json", "meta.json", "final_model.pt", "final_model.safetensors")

# The ``format`` entry of final_model.safetensors' metadata; bump it if the layout ever changes.
SAFETENSORS_FORMAT = "fl-geo-final-model/1"

_safetensors_hint_given = False  # the "pip install fl-geo[safetensors]" hint is logged once per process


def _fl_geo_version() -> str:
    try:
        return version("fl-geo")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def save_safetensors(path: Path, params: torch.Tensor, spec: ParamSpec, cfg: FlGeoConfig) -> Path | None:
    """``params`` as the model's state dict (named fp32 tensors, ``spec``'s names and shapes) in a
    safetensors file at ``path`` (written atomically), with string metadata: ``format``
    (`SAFETENSORS_FORMAT`), ``fl_geo_version``, ``run_name``, ``strategy`` and ``model_config``
    (JSON of the ``model`` section). Returns ``None`` without writing when ``safetensors`` is not
    installed (logged once at INFO)."""
    global _safetensors_hint_given
    try:
        from safetensors.torch import save
    except ImportError:
        if not _safetensors_hint_given:
            _safetensors_hint_given = True
            log.info("fl-geo: final_model.safetensors not written; `pip install fl-geo[safetensors]` enables it")
        return None
    flat = params.detach().to("cpu", torch.float32)
    # one contiguous tensor per name: safetensors refuses views that share the flat buffer's storage
    tensors = {name: t.clone() for name, t in unflatten(flat, spec).items()}
    metadata = {
        "format": SAFETENSORS_FORMAT,
        "fl_geo_version": _fl_geo_version(),
        "run_name": cfg.run.name,
        "strategy": cfg.strategy.name,
        "model_config": section_to_json(cfg.model),
    }
    # serialised in memory and written by `write_bytes_atomic`: safetensors' own file writer
    # reports a full disk as its own error type, which could not be told apart from a bug
    return write_bytes_atomic(path, save(tensors, metadata=metadata))


def new_run_dir(cfg: FlGeoConfig) -> Path:
    """``<run.out_dir>/<run.name>-<timestamp>``, with a ``-N`` suffix if that exists already.

    The directory is created here (``mkdir`` without ``exist_ok`` is the atomic claim), so two
    runs started in the same second get two directories rather than one they would share."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run.out_dir) / f"{cfg.run.name}-{stamp}"
    base.parent.mkdir(parents=True, exist_ok=True)
    path, i = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            path, i = Path(f"{base}-{i}"), i + 1


def write_history(path: Path, history: list[str]) -> None:
    """Rewrite metrics.jsonl from a checkpoint's history (atomically), so a resumed run's file
    has each step once. In deployment the resumed ServerApp writes to a new run directory, which
    does not exist yet at this point."""
    write_text_atomic(path, "".join(h + "\n" for h in history))


class RunSession:
    """Context manager for one ServerApp run; ``logger`` is open between enter and exit.

    ``history``: ``None`` starts a new run, which is refused (`OutputError`, nothing changed) when
    ``run_dir`` holds an earlier run's results: a plain re-run never replaces them. A list of JSONL
    lines (a checkpoint's) is written back as ``metrics.jsonl`` so a resumed run continues its own
    metrics. The directory is held by `RunLock` from `lock` (or `open`) until the session closes,
    so a second run into it fails at once instead of mixing its files with this one's.
    """

    def __init__(self, cfg: FlGeoConfig, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(cfg)
        self.logger: MetricsLogger | None = None
        self._threads_before: int | None = None
        self._lock = RunLock(self.run_dir)

    def lock(self) -> None:
        """Take the run directory's lock (idempotent); call before reading anything in it."""
        self._lock.acquire()

    def open(self, history: list[str] | None = None) -> MetricsLogger:
        """Lock and check the directory, open the logger, write ``config.yaml``, set torch's threads."""
        self.lock()
        if history is None:
            earlier = [name for name in RESULT_FILES if (self.run_dir / name).exists()]
            if earlier:
                self.close()
                raise OutputError(
                    f"{self.run_dir} holds the results of an earlier run ({', '.join(earlier)}); a new run does "
                    "not replace them: give it another run.name or --out, continue that run with "
                    "run.resume=true, or move the directory away")
            shutil.rmtree(self.run_dir / "tb", ignore_errors=True)  # an aborted start's, before any metrics
        else:
            write_history(self.run_dir / "metrics.jsonl", history)
        trackers = open_trackers(list(self.cfg.run.loggers), self.cfg.run.name, to_dict(self.cfg), str(self.run_dir))
        self.logger = MetricsLogger(self.run_dir, tensorboard=self.cfg.run.tensorboard, trackers=trackers,
                                    wall_offset_s=history_wall_s(history) if history else 0.0)
        write_text_atomic(self.run_dir / "config.yaml", to_yaml(self.cfg))
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.cfg.run.server_threads)
        return self.logger

    def __enter__(self) -> RunSession:
        if self.logger is None:
            self.open()
        return self

    def save_model(self, params: torch.Tensor, spec: ParamSpec) -> Path:
        """The final flat model and its layout, as ``final_model.pt`` (returned), and the same
        weights as ``final_model.safetensors`` when safetensors is installed (`save_safetensors`)."""
        path = self.run_dir / "final_model.pt"
        # through a Python file object: torch.save to a path reports a full disk as a bare
        # RuntimeError from its C++ writer; a file object's write raises OSError (ENOSPC), which
        # `atomic_path` turns into one line naming the file, the previous final_model.pt intact
        with atomic_path(path) as tmp, tmp.open("wb") as fh:
            torch.save({"params": params, "spec": spec.to_json()}, fh)
        save_safetensors(self.run_dir / "final_model.safetensors", params, spec, self.cfg)
        return path

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` (with ``run_dir``) and return the summary."""
        summary = {**summary, "run_dir": str(self.run_dir)}
        assert self.logger is not None, "RunSession.finish before open"
        self.logger.write_json("summary.json", summary)
        return summary

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Restore torch's threads, close the logger, release the directory (idempotent)."""
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self.logger is not None:
            self.logger.close()
        self._lock.release()

