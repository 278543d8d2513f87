"""Run metrics: one JSONL file (what tools read back) and TensorBoard scalars (what people look at).

One name space for every strategy (docs/design.md): ``train/loss``, ``val/loss``, ``val/ppl``,
``outer/step``, ``outer/accepted``, ``outer/rejected``, ``comm/bytes_up``, ``comm/bytes_down``,
``train/tokens``, ``time/wall_s``, ``time/virtual_s``, ... Each JSONL line is one outer step (or one event) with its
step number and wall time, so a comparison tool can compute time-to-loss without TensorBoard.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_geo.atomic import write_text_atomic
from fl_geo.errors import OutputError

log = logging.getLogger("fl_geo")

# Losses also written against other x axes, so asynchronous and synchronous runs (whose outer
# steps mean different things) and virtual time compare in TensorBoard: ``by_virtual_s/val/loss``
# has the modelled seconds as its step, ``by_tokens/val/loss`` the tokens consumed.
LOSS_KEYS = ("val/loss", "val/worker_loss", "train/loss")
EXTRA_AXES = {"by_virtual_s": "time/virtual_s", "by_tokens": "train/tokens"}


def tensorboard_points(step: int, record: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(tag, value, x) for every TensorBoard scalar of one record: each finite metric at the outer
    step, and each loss again at every other axis the record carries (`EXTRA_AXES`)."""
    points = [(key, val, int(step)) for key, val in record.items()
              if key not in ("step", "time/wall_s") and val is not None]
    for prefix, axis in EXTRA_AXES.items():
        x = record.get(axis)
        if x is None:
            continue
        points.extend((f"{prefix}/{key}", record[key], int(round(x))) for key in LOSS_KEYS if record.get(key) is not None)
    return points


def metrics_record(step: int, wall_s: float, metrics: dict[str, float | int]) -> dict[str, Any]:
    """One step's record: its step, wall time and every metric as a float (None when not finite)."""
    record: dict[str, Any] = {"step": int(step), "time/wall_s": round(wall_s, 4)}
    for key, val in metrics.items():
        fval = float(val)
        record[key] = fval if math.isfinite(fval) else None
    return record


class MetricsLogger:
    """Append-only metrics sink for one run directory."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, trackers: Sequence[Any] = (),
                 wall_offset_s: float = 0.0) -> None:
        """``trackers``: optional experiment trackers (`fl_geo.runtime.loggers`) that get every
        record's finite metrics too; one that raises is logged and dropped, the run goes on.
        ``wall_offset_s``: the wall seconds the run had already spent when this logger starts (a
        resumed run's, up to its checkpoint: `history_wall_s`), so ``time/wall_s`` keeps rising
        across a restart and a resumed run's wall time to a target compares with an uninterrupted
        one's."""
        self.trackers = list(trackers)
        self.wall_offset_s = float(wall_offset_s)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._fh = self.path.open("a", encoding="utf-8")
        self._t0 = time.perf_counter()
        self._tb = None
        if tensorboard:
            # Imported lazily: TensorBoard's import costs ~1 s and clients never need it.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    @property
    def wall_s(self) -> float:
        """The run's wall clock: seconds since the logger was created, plus ``wall_offset_s``."""
        return self.wall_offset_s + time.perf_counter() - self._t0

    def log(self, step: int, metrics: dict[str, float | int]) -> dict[str, Any]:
        """Write one record; non-finite values are kept in JSONL as null, skipped in TensorBoard."""
        record = metrics_record(step, self.wall_s, metrics)
        if self._tb is not None:
            for tag, val, x in tensorboard_points(step, record):
                self._tb.add_scalar(tag, val, global_step=x)
        try:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        except OSError as exc:  # a full disk: readers skip a torn last line, the rest is whole
            raise OutputError(f"cannot append to {self.path}: {exc.strerror or exc} (free space there or "
                              "point run.out_dir elsewhere; the records before this one are intact)") from None
        if self.trackers:
            finite = {k: v for k, v in record.items() if k != "step" and v is not None}
            for tracker in list(self.trackers):
                try:
                    tracker.log(int(step), finite)
                except Exception as exc:  # noqa: BLE001 - a tracker's outage must not end the run
                    log.warning("experiment tracker %s failed (%s); it gets no more metrics", type(tracker).__name__, exc)
                    self.trackers.remove(tracker)
        return record

    def write_json(self, name: str, payload: dict[str, Any]) -> Path:
        """Write a side file (run metadata, final summary) atomically next to the metrics
        (`fl_geo.atomic`: a full disk is one line naming the file, the previous one intact)."""
        return write_text_atomic(self.run_dir / name, json.dumps(payload, indent=2, sort_keys=True, default=str))

    def close(self) -> None:
        self._fh.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - the run's own files are already written
                log.warning("experiment tracker %s failed to close (%s)", type(tracker).__name__, exc)
        self.trackers = []
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Load a run's ``metrics.jsonl`` (a directory or the file itself): one dict per record.

    The file is appended to one record at a time, so a run killed mid-write can leave a torn
    last line (a prefix of a record, no newline). That line is skipped with a warning naming
    the file: every record before it is intact. An unreadable line anywhere else is not a
    crash's trace but damage, and raises ValueError naming the line (readers turn it into a
    one-line error)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    with p.open(encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    rows: list[dict[str, Any]] = []
    for k, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not a JSON object")
        except ValueError as exc:
            if k == len(numbered) - 1:
                log.warning("%s: skipping line %d, a torn last record (%d bytes; the run was stopped while "
                            "writing it?): %s", p, lineno, len(line), exc)
                break
            raise ValueError(f"{p}: line {lineno} is not a metrics record: {exc}") from None
        rows.append(record)
    return rows


def history_wall_s(history: Sequence[str]) -> float:
    """The wall seconds a checkpoint's history had reached: ``time/wall_s`` of its last record
    that has a finite, non-negative one (0 when none has). The time between that checkpoint and
    the crash is not counted: that work was lost and is done again after the resume."""
    for line in reversed(history):
        try:
            value = json.loads(line).get("time/wall_s")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            return float(value)
    return 0.0


class MemoryLogger:
    """The `MetricsLogger` interface without files: records are kept in ``records`` only.

    What a public strategy logs to when its user passes no logger: a Flower user's own ServerApp
    gets the figures back in the `Result` and decides itself where they go.
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self.records: list[dict[str, Any]] = []

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self._t0

    def log(self, step: int, metrics: dict[str, float | int]) -> dict[str, Any]:
        record = metrics_record(step, self.wall_s, metrics)
        self.records.append(record)
        return record

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        """Side files are dropped: there is no run directory."""

    def close(self) -> None:
        """Nothing to flush."""
