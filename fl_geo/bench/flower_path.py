"""Flower's own message path on loopback deployment, measured: the baseline for our data path.

:func:`measure_flower_path` starts a plaintext SuperLink and one SuperNode on 127.0.0.1 (free
ports, ``FLWR_HOME`` and logs in ``workdir``) with :mod:`fl_geo.deploy.lifecycle`, submits the probe app
``apps/flower-path-probe`` with ``flwr run``, waits for it, reads the JSON the probe's ServerApp
wrote and always stops every process again. The probe sends one float32 array of ``payload_mib``
MiB to the node in a train message; the ClientApp sends it back with every word XOR 1 (new
content: Flower's object store is content-addressed, a byte-identical echo could skip the
upload); the ServerApp times push → reply pulled and checks every word of the reply.

``mb_per_s_each_way`` = 2 × payload bytes / 1e6 / median round trip. A round trip also pays
Flower's fixed costs (the SuperNode polls every 3 s when idle and starts a new ClientApp process
per message); ``small_round_trip_s`` (a 1-element array) shows them, and
``mb_per_s_each_way_excl_small`` divides by the median minus that one small round trip instead (a
rough estimate: the 3 s poll lands at a random phase, so it is noisy for small payloads and None
when the payload round trip was the faster one). While the run is going, the
resident memory of the SuperLink and SuperNode process trees (with their ``flower-superexec``,
ServerApp and ClientApp children) is sampled every ``SAMPLE_S``.

Usage::

    fl-geo bench flower-path --mib 64 [--repeats 2] [--json] [--workdir DIR] [--timeout S]

    from fl_geo.bench.flower_path import measure_flower_path
    r = measure_flower_path(64, repeats=2)   # r["mb_per_s_each_way"], r["setup_s"], ...
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fl_geo.deploy import flower_config, launch, lifecycle, processes, topology
from fl_geo.deploy.processes import free_ports
from fl_geo.deploy.topology import DeployError
from fl_geo.paths import APPS_DIR

__all__ = ["APP_DIR", "format_flower_path", "main", "measure_flower_path"]

APP_DIR = APPS_DIR / "flower-path-probe"
SAMPLE_S = 0.25
MIB = 1 << 20


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _MemorySampler(threading.Thread):
    """Peak summed VmRSS of each recorded process tree (role → MiB), sampled every ``SAMPLE_S``.

    Short-lived processes (a ClientApp) can peak between two samples; the ServerApp reports its
    own exact VmHWM.
    """

    def __init__(self, records: Sequence[processes.ProcRecord]) -> None:
        super().__init__(daemon=True, name="flower-path-memory")
        self.records = list(records)
        self.peak: dict[str, float] = {}
        self.peak_total = 0.0
        self.seen: set[int] = set()  # every pid of the trees seen, for the caller's leak check
        self._stop_event = threading.Event()

    def sample(self) -> None:
        total = 0.0
        for rec in self.records:
            pids = {rec.pid} | processes._descendants([rec.pid])
            self.seen |= pids
            mib = sum(_status_kib(p, "VmRSS") for p in pids) / 1024
            key = f"{rec.role}_tree"
            self.peak[key] = max(self.peak.get(key, 0.0), mib)
            total += mib
        self.peak_total = max(self.peak_total, total)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


def _topology(workdir: Path, app_dir: Path) -> topology.Topology:
    link, node = free_ports(2)
    data = {
        "name": "flower-path",
        "superlink": {"host": "127.0.0.1", "port": link},
        "app_dir": str(app_dir),
        "flwr_home": str(workdir / "flwr"),
        "state_dir": str(workdir / "state"),
        "security": {"tls": False, "auth": False},
        "nodes": [{"name": "probe", "port": node,
                   "node_config": {"partition-id": 0, "num-partitions": 1, "site": "probe",
                                   "region": "loopback", "device": "cpu"}}],
    }
    return topology.parse_topology(data, workdir, str(workdir / "topology"))


def _flwr_log_tail(topo: topology.Topology, run_id: int | None, lines: int = 30) -> str:
    if run_id is None:
        return ""
    try:
        proc = processes.flwr_cli(topo, ["log", str(run_id), topo.name, "--show"], timeout_s=30)
    except Exception as exc:  # only a diagnostic
        return f"(flwr log failed: {exc})"
    text = (proc.stdout + proc.stderr).rstrip().splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def _diagnostics(topo: topology.Topology, run_id: int | None) -> str:
    parts = []
    flwr_log = _flwr_log_tail(topo, run_id)
    if flwr_log:
        parts.append(f"flwr log {run_id} (tail):\n{flwr_log}")
    for rec in processes.load_records(topo):
        tail = processes._tail(rec.log, 15)
        if tail:
            parts.append(f"{rec.log} (tail):\n{tail}")
    return "\n".join(parts)


def _prepare_workdir(payload_mib: int, workdir: Path | None) -> tuple[Path, topology.Topology, Path]:
    """The probe's working folder (a new temporary one without ``workdir``), its loopback
    topology, and the path of the probe's result file (any earlier file there removed)."""
    work = Path(tempfile.mkdtemp(prefix="fl-geo-flower-path-")) if workdir is None else Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    topo = _topology(work, APP_DIR)
    out = work / f"probe-{payload_mib}mib-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.unlink(missing_ok=True)
    return work, topo, out


def _run_probe(topo: topology.Topology, work: Path, out: Path, payload_mib: int, repeats: int,
               timeout_s: float, deadline: float, say: Callable[[str], None]) -> tuple[int, float]:
    """Submit the probe app with ``flwr run`` and wait until its result file is written.

    Returns the run id and the seconds from submission until the run finished. Raises
    `DeployError` (with diagnostics) when the submission fails, when the run outlasts
    ``deadline`` (it is stopped first) or when it ends without completing or without a result.
    """
    run_config = work / "run-config.toml"
    run_config.write_text(flower_config.dumps_toml({
        "payload_mib": int(payload_mib), "repeats": int(repeats), "out": str(out),
        "reply-timeout-s": float(max(60.0, timeout_s)),
    }), encoding="utf-8")
    t_run = time.monotonic()
    submit = processes.flwr_cli(topo, ["run", str(APP_DIR), topo.name, "--run-config", str(run_config),
                                    "--format", "json"], timeout_s=max(60.0, deadline - time.monotonic()))
    res = processes._json_out(submit)
    if not res.get("success") or not res.get("run-id"):
        raise DeployError("flwr run of the probe failed: "
                          f"{res.get('error-message') or submit.stderr.strip() or submit.stdout.strip()}\n"
                          f"{_diagnostics(topo, None)}")
    run_id = int(res["run-id"])
    say(f"run {run_id} submitted: {payload_mib} MiB x {repeats}")

    # The probe's result file is the cheap local sign that the run is done (each status check
    # is a `flwr ls` process, whose CPU and memory would also disturb the measurement).
    state, details = launch.wait_for_run(topo, run_id, out.is_file,
                                         timeout_s=max(1.0, deadline - time.monotonic()))
    if state == "timeout":
        processes.flwr_cli(topo, ["stop", str(run_id), topo.name])
        raise DeployError(f"probe run {run_id} did not finish within {timeout_s:.0f} s (stopped); "
                          f"workdir {work}\n{_diagnostics(topo, run_id)}")
    run_s = time.monotonic() - t_run
    if state != "finished:completed" or not out.is_file():
        raise DeployError(f"probe run {run_id} ended {state}"
                          f"{f' ({details})' if details and details != 'N/A' else ''}"
                          f"{'' if out.is_file() else f', no result at {out}'}; workdir {work}\n"
                          f"{_diagnostics(topo, run_id)}")
    return run_id, run_s


def _peak_memory(sampler: _MemorySampler, records: Sequence[processes.ProcRecord]) -> dict[str, float]:
    """Stop the sampler and report its peaks (MiB, per process tree and in total) together with
    the VmHWM of each long-lived process still alive."""
    sampler.stop()
    sampler.sample()
    peaks = {k: round(v, 1) for k, v in sampler.peak.items()}
    peaks["total"] = round(sampler.peak_total, 1)
    for rec in records:  # exact high-water marks of the long-lived processes
        if rec.alive():
            peaks[f"{rec.role}_vmhwm"] = round(_status_kib(rec.pid, "VmHWM") / 1024, 1)
    return peaks


def measure_flower_path(payload_mib: int, repeats: int = 1, workdir: Path | None = None,
                        timeout_s: float = 900, echo: bool = False) -> dict[str, Any]:
    """Round-trip ``payload_mib`` MiB ``repeats`` times through a loopback SuperLink + SuperNode.

    Returns the probe's JSON (``payload_bytes``, ``round_trip_s``, ``mb_per_s_each_way``,
    ``peak_rss_serverapp_mib``, ``echo_verified``, ``small_round_trip_s``, ...) plus ``setup_s``
    (SuperLink start until the SuperNode is online), ``run_s`` (``flwr run`` until the run
    finished), ``wall_s``, ``peak_rss_mib`` (sampled peaks per process tree and in total, and the
    SuperLink's and SuperNode's own VmHWM), ``mb_per_s_each_way_excl_small``, ``pids`` (every
    process of the federation seen while sampling) and ``workdir``. ``timeout_s`` bounds the
    whole call. Raises :class:`~fl_geo.deploy.topology.DeployError` with the tails of ``flwr log`` and the
    SuperLink/SuperNode logs when the run fails. Every process started is stopped before it
    returns or raises. Without ``workdir`` a temporary folder is used and removed on success
    (kept, and named in the error, on failure).
    """
    if payload_mib < 1 or repeats < 1:
        raise ValueError(f"payload_mib and repeats must be >= 1, got {payload_mib}, {repeats}")
    if not (APP_DIR / "pyproject.toml").is_file():
        raise DeployError(f"probe app not found at {APP_DIR} (needs an fl-geo checkout, not an installed wheel)")
    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    own_workdir = workdir is None
    work, topo, out = _prepare_workdir(payload_mib, workdir)

    t_start = time.monotonic()
    deadline = t_start + timeout_s
    sampler: _MemorySampler | None = None
    ok = False
    try:
        # The SuperLink and SuperNode in processes of their own (not forked from the app server,
        # whose torch pages a forked process's VmRSS would count): their memory is reported below.
        started = lifecycle.up(topo, timeout_s=min(120.0, timeout_s), echo=echo, fork_daemons=False)
        setup_s = time.monotonic() - t_start
        say(f"loopback federation up in {setup_s:.1f} s ({topo.address}); workdir {work}")
        sampler = _MemorySampler(started.records)
        sampler.start()

        run_id, run_s = _run_probe(topo, work, out, payload_mib, repeats, timeout_s, deadline, say)
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        peaks = _peak_memory(sampler, started.records)
        fixed = result["median_round_trip_s"] - result["small_round_trip_s"]
        result["mb_per_s_each_way_excl_small"] = 2 * result["payload_bytes"] / 1e6 / fixed if fixed > 0 else None
        result.update(setup_s=setup_s, run_s=run_s, run_id=run_id, peak_rss_mib=peaks, workdir=str(work),
                      pids=sorted(sampler.seen))
        ok = True
    finally:
        if sampler is not None:
            sampler.stop()
        gone = lifecycle.down(topo, grace_s=5)
        if gone.survivors and ok:
            raise DeployError(f"processes still alive after stopping the probe federation: {gone.survivors}")
    result["wall_s"] = time.monotonic() - t_start
    if own_workdir:
        shutil.rmtree(work, ignore_errors=True)
        result["workdir"] = None
    return result


def _mbps(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} MB/s"


def format_flower_path(r: dict[str, Any]) -> str:
    mb = r["payload_bytes"] / 1e6
    rtts = ", ".join(f"{t:.2f}" for t in r["round_trip_s"])
    peaks = r.get("peak_rss_mib", {})
    lines = [
        f"Flower loopback deployment path: {r['payload_bytes'] / MIB:.0f} MiB ({mb:.1f} MB) float32 each way, "
        f"{len(r['round_trip_s'])} round trip(s)",
        f"  round trip s:        {rtts} (median {r['median_round_trip_s']:.2f}); push {sum(r['push_s']):.2f} s total",
        f"  throughput:          {r['mb_per_s_each_way']:.1f} MB/s each way (2 x payload / median round trip)",
        f"  without fixed cost:  {_mbps(r.get('mb_per_s_each_way_excl_small'))} each way "
        "(median minus the small round trip; rough)",
        f"  small message:       {r['small_round_trip_s']:.2f} s round trip (fixed cost; first message "
        f"{r['warmup_round_trip_s']:.2f} s)",
        f"  echo verified:       {r['echo_verified']}",
        f"  ServerApp peak RSS:  {r['peak_rss_serverapp_mib']:.0f} MiB",
        "  sampled peak RSS:    " + ", ".join(f"{k} {v:.0f} MiB" for k, v in peaks.items()),
        f"  setup {r['setup_s']:.1f} s, run {r['run_s']:.1f} s, wall {r['wall_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench flower-path --mib N [--repeats R] [--json]``; 1 when the run failed."""
    parser = argparse.ArgumentParser(
        prog="fl-geo bench flower-path",
        description="Round-trip throughput of Flower's own message path on a loopback SuperLink + SuperNode")
    parser.add_argument("--mib", type=int, required=True, help="payload size (MiB of float32) each way")
    parser.add_argument("--repeats", type=int, default=1, help="timed round trips")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="FLWR_HOME, logs and the result JSON (default: a temporary folder, removed)")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit for the whole measurement (s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result = measure_flower_path(args.mib, repeats=args.repeats, workdir=args.workdir,
                                     timeout_s=args.timeout, echo=not args.quiet)
    except (DeployError, ValueError) as exc:
        print(f"fl-geo bench flower-path: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_flower_path(result))
    good = result.get("echo_verified") and math.isfinite(result.get("mb_per_s_each_way", math.nan))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
