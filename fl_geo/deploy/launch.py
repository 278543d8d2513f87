"""Multi-site deployment: running an experiment on a topology (``fl-geo deploy run``).

``fl-geo run`` simulates datacenters inside one machine. A real multi-site run is one Flower
SuperLink (where the ServerApp, i.e. the outer optimizer, runs) and one SuperNode per site (where
that site's ClientApp trains), joined over the WAN. The package turns that into steps a platform
engineer can script and CI can test on loopback: `fl_geo.deploy.certificates` (certificates and
SuperNode keys), `fl_geo.deploy.topology` (the YAML topology), `fl_geo.deploy.lifecycle` (up,
down, status of its processes, `fl_geo.deploy.processes`) and, here, :func:`run_experiment`,
which submits an fl-geo config with ``flwr run``, waits for it, and finds the run's
``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.deploy.app_stage import staged_app
from fl_geo.deploy.flower_config import dumps_toml, write_flwr_config
from fl_geo.deploy.processes import _json_out, flower_env, flower_exe, flwr_cli
from fl_geo.deploy.topology import DeployError, Topology

log = logging.getLogger("fl_geo")

__all__ = ["RunResult", "StatusPacer", "run_experiment", "run_status", "summary_written", "wait_for_run"]

# Each status check is one `flwr ls` process: about 1.5 s of CPU to start Python and Flower.
STATUS_EVERY_S = 10.0


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """A submitted run: Flower's id and final status, and where fl-geo wrote its results."""

    run_id: int
    status: str
    details: str
    run_dir: Path | None
    summary: dict[str, Any] | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed" and self.summary is not None


def _override_value(overrides: Sequence[str], key: str) -> str | None:
    for item in reversed(overrides):
        k, _, v = item.partition("=")
        if k.strip() == key:
            return v.strip()
    return None


def _config_arg(config: Path, app_dir: Path) -> str:
    """The config path as the ServerApp should see it: project-relative when inside the app
    (the ServerApp resolves it against its own checkout), absolute otherwise."""
    p = config.resolve()
    try:
        return str(p.relative_to(app_dir))
    except ValueError:
        return str(p)


def run_status(topo: Topology, run_id: int) -> tuple[str, str]:
    """(status, details) of one run, e.g. ("finished:completed", ""); ("unknown", why) when Flower
    could not say, e.g. ``flwr ls`` did not answer in time on a loaded host (the caller asks again
    at its next poll: a slow answer is no reason to abandon a run). Asked in this process
    through the Control API (`fl_geo.deploy.control`), else by ``flwr ls``."""
    from fl_geo.deploy.control import ControlUnavailable, query_run_status

    try:
        return query_run_status(topo, run_id)
    except ControlUnavailable as exc:
        log.debug("run status through the flwr CLI: %s", exc)
    try:
        proc = flwr_cli(topo, ["ls", topo.name, "--run-id", str(run_id), "--format", "json"])
    except subprocess.TimeoutExpired as exc:
        return "unknown", f"flwr ls did not answer within {exc.timeout:.0f} s"
    out = _json_out(proc)
    runs = out.get("runs") or []
    if not out.get("success") or not runs:
        return "unknown", str(out.get("error-message", ""))
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


class StatusPacer:
    """When to ask Flower about one run: every ``every_s``, and every second once ``hint()`` (a
    cheap local check, such as "the run wrote its summary") is true.

    Asking costs a ``flwr ls`` process (about 1.5 s of CPU), so asking every second or two keeps
    most of a core busy for the whole run, on the host that runs the ServerApp. ``every_s``
    bounds how late a failed run is noticed; the hint makes a completed run seen within about a
    second. Shared by :func:`wait_for_run` and the HALoS launcher (one pacer per tier).
    """

    def __init__(self, hint: Callable[[], bool] | None = None, every_s: float = STATUS_EVERY_S) -> None:
        self.hint, self.every_s = hint, every_s
        self.last = time.monotonic()

    def due(self) -> bool:
        since = time.monotonic() - self.last
        return since >= self.every_s or (since >= 1.0 and self.hint is not None and self.hint())

    def asked(self) -> None:
        self.last = time.monotonic()


def wait_for_run(topo: Topology, run_id: int, finished_hint: Callable[[], bool] | None = None,
                 timeout_s: float = 0.0, status_every_s: float = STATUS_EVERY_S,
                 tick_s: float = 0.25) -> tuple[str, str]:
    """Wait until Flower reports ``run_id`` finished; return its (status, details).

    Flower is asked as :class:`StatusPacer` says. Returns ``("timeout", ...)`` once ``timeout_s``
    (0 = no limit) has passed; stopping the run is the caller's choice.
    """
    t0 = time.monotonic()
    pacer = StatusPacer(finished_hint, status_every_s)
    while True:
        if pacer.due():
            state, details = run_status(topo, run_id)
            pacer.asked()
            if state.startswith("finished"):
                return state, details
        if timeout_s and time.monotonic() - t0 > timeout_s:
            return "timeout", f"run did not finish within {timeout_s:.0f} s"
        time.sleep(tick_s)


def summary_written(out: Path, name: str, before: set[Path]) -> Callable[[], bool]:
    """A check for a run directory ``<out>/<name>-*`` that is new since ``before`` and holds the
    ``summary.json`` a ServerApp writes last (visible only on the SuperLink's host)."""
    def check() -> bool:
        return any(p.resolve() not in before and (p / "summary.json").is_file() for p in out.glob(f"{name}-*"))

    return check


def run_experiment(topo: Topology, config: str | Path, overrides: Sequence[str] = (), out_dir: str | Path | None = None,
                   stream: bool = False, wait: bool = True, timeout_s: float = 0.0,
                   status_every_s: float = STATUS_EVERY_S, echo: bool = True) -> RunResult:
    """Submit ``config`` (+ ``overrides``) with ``flwr run`` and, unless ``wait=False``, wait for it.

    ``run.out_dir`` is set to an absolute folder (``out_dir``, default ``<app>/runs``; the run
    directory is created on the SuperLink's host) so the caller can find the run's directory:
    the one folder ``<out_dir>/<run.name>-*`` that appeared during the run. ``stream`` prints
    Flower's log stream while waiting. A run still going after ``timeout_s`` (0 = no limit) is
    stopped with ``flwr stop``. Waiting asks Flower for the run's status every ``status_every_s``
    and sooner once the run's summary appears (see :func:`wait_for_run`).
    """
    from fl_geo.config import load_config

    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    overrides = list(overrides)
    cfg_path = Path(config)
    if not cfg_path.is_absolute() and not cfg_path.exists() and (topo.app_dir / cfg_path).exists():
        cfg_path = topo.app_dir / cfg_path
    user_out = _override_value(overrides, "run.out_dir")
    if user_out is not None:
        out = Path(user_out).expanduser()
        out = out if out.is_absolute() else topo.app_dir / out
    else:
        out = Path(out_dir).expanduser() if out_dir else topo.app_dir / "runs"
        out = out if out.is_absolute() else Path.cwd() / out
    out = out.resolve()
    overrides = [o for o in overrides if o.partition("=")[0].strip() != "run.out_dir"] + [f"run.out_dir={out}"]
    cfg = load_config(cfg_path, overrides)  # validate here: a typo fails before anything is submitted
    name = cfg.run.name

    write_flwr_config(topo)
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    run_config = topo.state_dir / f"run-config-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.toml"
    # A TOML file, not a `--run-config 'k="v"'` string: Flower's parser cannot escape quotes, and
    # overrides such as data.files='[a.txt, "b c.txt"]' need them.
    run_config.write_text(dumps_toml({"config": _config_arg(cfg_path, topo.app_dir),
                                      "overrides": shlex.join(overrides)}), encoding="utf-8")
    before = {p.resolve() for p in out.glob(f"{name}-*")}
    t0 = time.monotonic()
    with staged_app(topo.app_dir, topo.state_dir) as app:  # the FAB is uploaded by the time flwr run returns
        submit = flwr_cli(topo, ["run", str(app), topo.name, "--run-config", str(run_config),
                                 "--format", "json"], timeout_s=300)
    res = _json_out(submit)
    if not res.get("success") or not res.get("run-id"):
        raise DeployError(f"flwr run failed: {res.get('error-message') or submit.stderr.strip() or submit.stdout.strip()}")
    run_id = int(res["run-id"])
    say(f"run {run_id} submitted to {topo.name} ({topo.address}): {cfg_path} {' '.join(overrides)}")
    if not wait:
        return RunResult(run_id, "submitted", "", None, None, time.monotonic() - t0)

    streamer = None
    if stream:
        streamer = subprocess.Popen([flower_exe("flwr"), "log", str(run_id), topo.name, "--stream"],
                                    env=flower_env(topo), cwd=topo.app_dir, stdin=subprocess.DEVNULL)
    try:
        left = max(1.0, timeout_s - (time.monotonic() - t0)) if timeout_s else 0.0
        state, details = wait_for_run(topo, run_id, summary_written(out, name, before), timeout_s=left,
                                      status_every_s=status_every_s)
        if state == "timeout":
            flwr_cli(topo, ["stop", str(run_id), topo.name])
            details += " (stopped)"
    finally:
        if streamer is not None:
            try:
                streamer.wait(timeout=5)
            except subprocess.TimeoutExpired:
                streamer.terminate()
                streamer.wait(timeout=5)
    wall = time.monotonic() - t0
    new_dirs = sorted({p.resolve() for p in out.glob(f"{name}-*")} - before, key=lambda p: p.stat().st_mtime)
    run_dir = new_dirs[-1] if new_dirs else None
    summary = None
    if run_dir is not None and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    note = f" ({details})" if details and details != "N/A" else ""
    say(f"run {run_id}: {state}{note} after {wall:.1f} s; run dir {run_dir}")
    return RunResult(run_id, state, details, run_dir, summary, wall)
