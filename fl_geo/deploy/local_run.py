"""``fl-geo flwr-run``: the app through Flower's own CLI, ``flwr run``, on a local simulation SuperLink.

A bare ``flwr run .`` trips a new user four ways: it returns after one line unless given
``--stream``; it starts a local SuperLink in the background that outlives it; the SuperLink may
build a fresh environment for the app's dependencies (with the CUDA build of torch); and Flower's
default local federation has 2 SuperNodes where fl-geo's configs ask for 4, so the ServerApp waits
and then fails with an error that only ``flwr log`` shows. This module runs the same ``flwr run``
with each of those settled:

* the SuperLink connection ``fl-geo-local`` (address ``:local:``) in ``$FLWR_HOME/config.toml``
  (``FLWR_HOME`` defaults to ``.flwr`` in the project, so a user's own Flower config is untouched);
* ``--federation-config``: as many SuperNodes as the config's ``run.num_clients``, Ray with
  ``run.sim_cpus`` CPUs and one CPU per client (Flower 1.41, which lacks the option, gets the
  same figures as ``options.`` fields of the connection);
* ``--run-config FILE``: the config path and the overrides, as a TOML file (no nested quoting);
* ``--stream`` for live output, runtime dependency installation off, the local SuperLink stopped
  afterwards (also on error and on Ctrl-C);
* the exit code of the run, not of the CLI: 0 only if the run's ``summary.json`` says it trained.

It prints the ``flwr run`` command it runs, so what it does can be repeated by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from fl_geo.deploy.app_stage import staged_app
from fl_geo.deploy.flower_config import dumps_toml
from fl_geo.deploy.processes import flower_exe
from fl_geo.deploy.topology import NO_DEPS_ENV
from fl_geo.paths import PROJECT_ROOT

__all__ = ["FEDERATION", "federation_options", "flwr_run_local", "local_superlinks"]

FEDERATION = "fl-geo-local"


def federation_options(num_supernodes: int, sim_cpus: int) -> dict[str, int | str]:
    """The simulation settings of the local federation (``--federation-config`` keys)."""
    return {"num-supernodes": num_supernodes, "backend": "ray", "init-args-num-cpus": sim_cpus,
            "client-resources-num-cpus": 1}


def _supports_federation_config(flwr: str, env: dict[str, str]) -> bool:
    """Flower 1.42 added ``flwr run --federation-config``; 1.41 reads ``options.`` fields.

    The ``flwr`` beside this interpreter is this environment's Flower: its installed version
    tells (a metadata read). Any other ``flwr`` is asked for its ``run --help`` (a process that
    imports Flower's CLI, ~2 CPU-s)."""
    if Path(flwr).parent == Path(sys.executable).parent:
        with contextlib.suppress(metadata.PackageNotFoundError, ValueError):
            major, minor = (int(part) for part in metadata.version("flwr").split(".")[:2])
            return (major, minor) >= (1, 42)
    help_text = subprocess.run([flwr, "run", "--help"], capture_output=True, text=True, env=env, check=False)
    return "--federation-config" in help_text.stdout + help_text.stderr


def _write_connection(home: Path, options: dict[str, int | str] | None) -> None:
    entry: dict[str, object] = {"address": ":local:"}
    if options is not None:  # Flower 1.41: the deprecated per-connection options
        entry["options"] = {"num-supernodes": options["num-supernodes"],
                            "backend": {"name": "ray", "init-args": {"num-cpus": options["init-args-num-cpus"]},
                                        "client-resources": {"num-cpus": 1}}}
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        "# Written by fl-geo flwr-run (fl_geo/deploy/local_run.py); rewritten on every run.\n"
        + dumps_toml({"superlink": {"default": FEDERATION, FEDERATION: entry}}), encoding="utf-8")


def local_superlinks(home: Path) -> list[int]:
    """PIDs of local SuperLinks started for this ``FLWR_HOME`` (their command line names it)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and str(home) in cmd and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def _stop_superlinks(home: Path, grace_s: float = 10.0) -> None:
    pids = local_superlinks(home)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def flwr_run_local(config: str | None, overrides: Sequence[str] = (), *, app_dir: Path = PROJECT_ROOT,
                   flwr_home: Path | None = None, echo: bool = True) -> int:
    """Run ``config`` + ``overrides`` with ``flwr run APP fl-geo-local --stream``; the run's exit code.

    The config is resolved and validated first (a `ConfigError` before anything starts). Returns 0
    when the run wrote a summary without a failure, 1 otherwise (the reason printed in one line).
    """
    from fl_geo.config import load_config

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if echo else (lambda msg: None)
    config_path = Path(config) if config else app_dir / "configs" / "quickstart_diloco.yaml"
    out_dir = Path.cwd() / "runs"
    given = [o for o in overrides if o.partition("=")[0].strip() == "run.out_dir"]
    if given:
        out_dir = Path(given[-1].partition("=")[2].strip()).expanduser()
        out_dir = out_dir if out_dir.is_absolute() else Path.cwd() / out_dir
    overrides = [o for o in overrides if o.partition("=")[0].strip() != "run.out_dir"]
    overrides.append(f"run.out_dir={out_dir.resolve()}")  # the ServerApp's cwd is not ours
    cfg = load_config(config_path, overrides)
    home = (flwr_home or Path(os.environ.get("FLWR_HOME") or app_dir / ".flwr")).resolve()
    env = dict(os.environ, **NO_DEPS_ENV, FLWR_HOME=str(home), PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    flwr = flower_exe("flwr")
    options = federation_options(cfg.run.num_clients, cfg.run.sim_cpus)
    new_cli = _supports_federation_config(flwr, env)
    _write_connection(home, None if new_cli else options)
    run_config = home / "run-config.toml"
    run_config.write_text(dumps_toml({"config": str(config_path.resolve()), "overrides": shlex.join(overrides)}),
                          encoding="utf-8")
    args = [FEDERATION, "--stream", "--run-config", str(run_config)]
    if new_cli:
        args += ["--federation-config", " ".join(f"{k}={json.dumps(v)}" for k, v in options.items())]
    say(f"fl-geo: FLWR_HOME={home} {shlex.join(['flwr', 'run', str(app_dir), *args])}")
    before = {p.resolve() for p in out_dir.glob(f"{cfg.run.name}-*")}
    try:
        with staged_app(app_dir, home / "staged") as app:  # the FAB without walking .venv (app_stage)
            code = subprocess.run([flwr, "run", str(app), *args], env=env, cwd=app_dir, check=False).returncode
    except KeyboardInterrupt:
        say("fl-geo: interrupted; stopping the local SuperLink (and the run on it)")
        return 130
    finally:
        _stop_superlinks(home)
    runs = sorted({p.resolve() for p in out_dir.glob(f"{cfg.run.name}-*")} - before)
    summary_path = runs[-1] / "summary.json" if runs else None
    if summary_path is None or not summary_path.is_file():
        say(f"fl-geo: the run wrote no summary under {out_dir} (flwr exited with {code}); see its log above")
        return 1
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    if summary.get("failure"):
        say(f"fl-geo: run {summary.get('name')} FAILED: {summary['failure']} ({runs[-1]})")
        return 1
    loss = summary.get("final_val_loss")
    say(f"fl-geo: run {summary.get('name')}: final val loss {'n/a' if loss is None else f'{loss:.4f}'} -> {runs[-1]}")
    return 0
