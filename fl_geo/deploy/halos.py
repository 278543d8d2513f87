"""``fl-geo deploy halos-up|halos-run|halos-status|halos-down``: HALoS's two tiers on one host.

A two-tier topology file (``configs/deploy/halos_loopback.yaml``) describes a global SuperLink
with one bridge SuperNode per region, and per region a SuperLink with its worker SuperNodes
(docs/deploy.md "HALoS across regions"). It is turned into ordinary `fl_geo.deploy.topology.Topology`
objects, one per tier (``<name>-global``, ``<name>-<region>``), so the process handling
(process groups, ``pids.json``, ``down`` with descendants, TLS/auth options, health and node
checks) is exactly that of ``fl-geo deploy up/down``; this module only adds the layout, the bridge
node configs, and the three coordinated runs.

Runs: each region's regional ServerApp (``apps/halos-regional``) is submitted first (it hosts the
LPS socket its bridge dials), then the global ServerApp (``apps/halos-global``); the regional runs
end when the GPS sends them ``stop``, so `run_halos` waits for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.deploy import warm_apps
from fl_geo.deploy.flower_config import dumps_toml, write_flwr_config
from fl_geo.deploy.launch import STATUS_EVERY_S, StatusPacer, run_status, summary_written
from fl_geo.deploy.lifecycle import down, up
from fl_geo.deploy.processes import _json_out, flwr_cli
from fl_geo.deploy.topology import (
    DeployError,
    NodeSpec,
    Topology,
    _check_keys,
    _port,
    _str,
    parse_topology,
    read_topology_file,
)

__all__ = [
    "HalosRunResult",
    "HalosTopology",
    "halos_down",
    "halos_status",
    "halos_up",
    "load_halos_topology",
    "parse_halos_topology",
    "run_halos",
]

_TOP_KEYS = {"name", "flwr_home", "state_dir", "ipc_dir", "app_dir", "security", "global", "regions", "warm_apps"}
_GLOBAL_KEYS = {"superlink"}
_REGION_KEYS = {"name", "superlink", "bridge_port", "nodes"}
REGIONAL_APP = "apps/halos-regional"
GLOBAL_APP = "apps/halos-global"


@dataclass(frozen=True)
class HalosTopology:
    """The validated two-tier layout: one `Topology` per SuperLink, plus the LPS socket paths."""

    name: str
    source: str
    app_dir: Path
    ipc_dir: Path
    global_tier: Topology  # the global SuperLink and the bridge SuperNodes
    regions: tuple[tuple[str, Topology], ...]  # (region name, its SuperLink and workers)

    def lps_address(self, region: str) -> str:
        return f"unix://{self.ipc_dir / f'{region}.sock'}"

    @property
    def tiers(self) -> list[Topology]:
        return [self.global_tier, *(t for _, t in self.regions)]

    @property
    def num_workers(self) -> int:
        return sum(len(t.nodes) for _, t in self.regions)


def parse_halos_topology(data: Any, base_dir: Path, source: str = "<halos topology>") -> HalosTopology:
    """Validate a two-tier topology mapping (unknown keys and repeated ports are errors)."""
    d = _check_keys(source, data, _TOP_KEYS, required=("global", "regions"))
    name = _str(f"{source}: name", d.get("name", "halos"))
    flwr_home = d.get("flwr_home", f".flwr-deploy/{name}")
    state_dir = Path(str(d.get("state_dir", f"{flwr_home}/state")))
    security = d.get("security") or {}
    app_dir = d.get("app_dir", ".")
    # Every tier (each region's and the global one) gets the same setting, and its own app server.
    warm = {"warm_apps": d["warm_apps"]} if "warm_apps" in d else {}
    ipc = Path(_str(f"{source}: ipc_dir", str(d.get("ipc_dir", f"/tmp/fl-geo-{name}")))).expanduser()
    ipc = (ipc if ipc.is_absolute() else base_dir / ipc).resolve()

    regions_raw = d["regions"]
    if not isinstance(regions_raw, list) or not regions_raw:
        raise DeployError(f"{source}: regions must be a non-empty list")
    region_names: list[str] = []
    regions: list[tuple[str, Topology]] = []
    bridges: list[NodeSpec] = []
    for i, raw in enumerate(regions_raw):
        r = _check_keys(f"{source}: regions[{i}]", raw, _REGION_KEYS, required=("name", "superlink", "bridge_port", "nodes"))
        rname = _str(f"{source}: regions[{i}].name", r["name"])
        if rname in region_names:
            raise DeployError(f"{source}: duplicate region name {rname!r}")
        region_names.append(rname)
        tier = parse_topology({"name": f"{name}-{rname}", "superlink": r["superlink"], "flwr_home": flwr_home,
                               "state_dir": str(state_dir / rname), "app_dir": app_dir, "security": security,
                               "nodes": r["nodes"], **warm}, base_dir, f"{source}: regions[{i}] ({rname})")
        for node in tier.nodes:
            if node.node_config.get("region") != rname:
                raise DeployError(f"{source}: regions[{i}] ({rname}): node {node.name} has region "
                                  f"{node.node_config.get('region')!r}, expected {rname!r}")
        regions.append((rname, tier))
        bridges.append(NodeSpec(name=f"bridge-{rname}", port=_port(f"{source}: regions[{i}].bridge_port", r["bridge_port"]),
                                node_config={"lps-address": f"unix://{ipc / f'{rname}.sock'}", "region": rname,
                                             "region-id": i, "num-regions": len(regions_raw)}))

    g = _check_keys(f"{source}: global", d["global"], _GLOBAL_KEYS, required=("superlink",))
    # Parse the global tier with a placeholder node (the parser wants the worker node schema),
    # then put the bridges in: their node_config is the bridge's, not a datacenter's.
    placeholder = {"name": "placeholder", "port": bridges[0].port,
                   "node_config": {"partition-id": 0, "num-partitions": 1, "site": "x", "region": "x", "device": "cpu"}}
    gtier = parse_topology({"name": f"{name}-global", "superlink": g["superlink"], "flwr_home": flwr_home,
                            "state_dir": str(state_dir / "global"), "app_dir": app_dir, "security": security,
                            "nodes": [placeholder], **warm}, base_dir, f"{source}: global")
    gtier = dataclasses.replace(gtier, nodes=tuple(bridges))

    ports = [t.port for t in [gtier, *(t for _, t in regions)]]
    ports += [n.port for t in [gtier, *(t for _, t in regions)] for n in t.nodes]
    dup = sorted({p for p in ports if ports.count(p) > 1})
    if dup:
        raise DeployError(f"{source}: port(s) {', '.join(map(str, dup))} used twice")
    parts = [n.node_config["partition-id"] for _, t in regions for n in t.nodes]
    if len(set(parts)) != len(parts):
        raise DeployError(f"{source}: a partition-id is assigned to more than one worker across regions")
    nparts = {n.node_config["num-partitions"] for _, t in regions for n in t.nodes}
    if nparts != {len(parts)}:
        raise DeployError(f"{source}: every worker needs num-partitions = {len(parts)} (the workers of all regions)")
    if len(str(ipc)) > 80:
        raise DeployError(f"{source}: ipc_dir {ipc} is too long for Unix socket paths (keep it under 80 chars)")
    return HalosTopology(name=name, source=source, app_dir=gtier.app_dir, ipc_dir=ipc, global_tier=gtier,
                         regions=tuple(regions))


def load_halos_topology(path: str | Path) -> HalosTopology:
    """Read a two-tier topology YAML; relative paths resolve against the project root."""
    data, base = read_topology_file(path)
    return parse_halos_topology(data, base, str(Path(path)))


def halos_up(topo: HalosTopology, timeout_s: float = 120.0, echo: bool = False) -> dict[str, float]:
    """Start every tier (in parallel threads: each mostly waits on polls); all or nothing.

    Returns seconds until each tier's nodes were online. On any failure every tier is stopped.
    """
    topo.ipc_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    t0 = time.monotonic()
    # One app server for every tier on this host (warm_apps, the same setting on every tier): the
    # global tier starts and records it, and `halos_down` stops the global tier last.
    socket = warm_apps.new_socket_name() if topo.global_tier.warm_apps else None
    try:
        with ThreadPoolExecutor(max_workers=len(topo.tiers)) as pool:
            futures = {t.name: pool.submit(up, t, timeout_s, echo, app_socket=socket,
                                           own_app_server=t is topo.global_tier) for t in topo.tiers}
            return {name: f.result().nodes_online_s for name, f in futures.items()} | {"total": time.monotonic() - t0}
    except BaseException:
        halos_down(topo)
        raise


def halos_down(topo: HalosTopology, grace_s: float = 10.0) -> dict[str, Any]:
    """Stop every tier (regions first: their runs end before the global one); safe to call twice."""
    out: dict[str, Any] = {}
    for tier in [*(t for _, t in topo.regions), topo.global_tier]:
        out[tier.name] = down(tier, grace_s=grace_s)
    # Sockets of an LPS that was killed before it could remove its own.
    for sock in topo.ipc_dir.glob("*.sock") if topo.ipc_dir.is_dir() else []:
        with contextlib.suppress(OSError):
            sock.unlink()
    return out


def halos_status(topo: HalosTopology) -> dict[str, Any]:
    from fl_geo.deploy.lifecycle import status

    return {t.name: status(t) for t in topo.tiers}


@dataclass
class HalosRunResult:
    """The three (or more) runs of one HALoS experiment and their summaries."""

    run_ids: dict[str, int]  # tier name -> Flower run id
    statuses: dict[str, str]
    run_dirs: dict[str, Path | None]
    summaries: dict[str, dict[str, Any] | None]
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(s == "finished:completed" for s in self.statuses.values()) and all(
            s is not None for s in self.summaries.values())


def _submit(tier: Topology, app: Path, run_config: dict[str, Any], state_name: str) -> int:
    write_flwr_config(tier)
    tier.state_dir.mkdir(parents=True, exist_ok=True)
    path = tier.state_dir / f"run-config-{state_name}-{time.strftime('%Y%m%d-%H%M%S')}.toml"
    path.write_text(dumps_toml(run_config), encoding="utf-8")
    proc = flwr_cli(tier, ["run", str(app), tier.name, "--run-config", str(path), "--format", "json"], timeout_s=300)
    res = _json_out(proc)
    if not res.get("success") or not res.get("run-id"):
        raise DeployError(f"flwr run of {app.name} on {tier.name} failed: "
                          f"{res.get('error-message') or proc.stderr.strip() or proc.stdout.strip()}")
    return int(res["run-id"])


# One run to submit: the tier it runs on, its app, its run config and its run name
_RunPlan = tuple[Topology, Path, dict[str, Any], str]


def _plan_runs(topo: HalosTopology, cfg_path: Path, base: list[str], name: str,
               ipc_timeout_s: float) -> list[_RunPlan]:
    """One regional run per region, then the global run, each with its tier's overrides."""
    plans: list[_RunPlan] = []
    for region, tier in topo.regions:
        ov = [*base, f"run.name={name}-{region}", f"run.num_clients={len(tier.nodes)}"]
        plans.append((tier, topo.app_dir / REGIONAL_APP, {
            "config": str(cfg_path), "overrides": shlex.join(ov), "lps-address": topo.lps_address(region),
            "region": region, "ipc-timeout-s": float(ipc_timeout_s)}, f"{name}-{region}"))
    ov = [*base, f"run.name={name}-global", f"run.num_clients={topo.num_workers}"]
    plans.append((topo.global_tier, topo.app_dir / GLOBAL_APP, {
        "config": str(cfg_path), "overrides": shlex.join(ov), "regions": len(topo.regions),
        "exchange-timeout-s": float(ipc_timeout_s), "connect-timeout-s": 120.0}, f"{name}-global"))
    return plans


def _submit_all(plans: list[_RunPlan], say: Callable[[str], None]) -> dict[str, int]:
    """Submit every planned run at once; tier name -> run id.

    When any submission fails (or anything else interrupts), the runs already submitted are
    stopped and the error is raised (the failed submissions' messages joined by ``; ``).
    """
    run_ids: dict[str, int] = {}
    try:
        # All at once: the bridges retry connecting to their LPS (connect-timeout-s), so the
        # order does not matter, and each `flwr run` spends seconds starting Python and Flower.
        with ThreadPoolExecutor(max_workers=len(plans)) as pool:
            futures = {tier.name: (app, pool.submit(_submit, tier, app, rc, run_name))
                       for tier, app, rc, run_name in plans}
            errors = []
            for tname, (app, fut) in futures.items():
                try:
                    run_ids[tname] = fut.result()
                    say(f"run {run_ids[tname]} ({app.name}) submitted to {tname}")
                except DeployError as exc:
                    errors.append(str(exc))
            if errors:
                raise DeployError("; ".join(errors))
    except BaseException:
        for tier, _, _, _ in plans:
            if tier.name in run_ids:
                flwr_cli(tier, ["stop", str(run_ids[tier.name]), tier.name])
        raise
    return run_ids


LEFT_FOR_RESUME = "running:left-for-resume"


def _wait_for_runs(plans: list[_RunPlan], run_ids: dict[str, int], out: Path, before: set[Path],
                   t0: float, timeout_s: float, status_every_s: float, keep_regions: bool = False) -> dict[str, str]:
    """Poll the runs until all have finished; tier name -> final status.

    When one run ends without completing, or ``timeout_s`` (counted from ``t0``; 0 = none) is
    up, the runs still going are stopped and marked ``stopped:after-failure`` or ``timeout``.
    With ``keep_regions`` (the tiers keep checkpoints), a failure of one run alone leaves the
    others going, marked `LEFT_FOR_RESUME`: ``--resume-global`` or ``--resume-region`` continues it.
    """
    tiers = {t.name: t for t, _, _, _ in plans}
    statuses = dict.fromkeys(run_ids, "unknown")
    # A region whose run fails also fails the global one (its bridge's exchange errors), so
    # Flower is asked about the regions a third as often as about the global run: each question
    # is a `flwr ls` process (~1.5 s of CPU); a region that ends normally is seen at once (hint).
    pacers = {t.name: StatusPacer(summary_written(out, run_name, before),
                                  status_every_s if "regions" in rc else 3 * status_every_s)  # global: "regions"
              for t, _, rc, run_name in plans}
    while True:
        for tname, rid in run_ids.items():
            if not statuses[tname].startswith("finished") and pacers[tname].due():
                statuses[tname] = run_status(tiers[tname], rid)[0]
                pacers[tname].asked()
        if all(s.startswith("finished") for s in statuses.values()):
            break
        failed = [t for t, s in statuses.items() if s.startswith("finished") and s != "finished:completed"]
        late = timeout_s and time.monotonic() - t0 > timeout_s
        if failed or late:
            # One tier failed (or time is up): the others would wait for it until their IPC timeout,
            # unless checkpoints are on and one tier alone failed: the others are left to its resume.
            spare = keep_regions and not late and len(failed) == 1
            for tname, rid in run_ids.items():
                if not statuses[tname].startswith("finished"):
                    if spare:
                        statuses[tname] = LEFT_FOR_RESUME
                        continue
                    flwr_cli(tiers[tname], ["stop", str(rid), tname])
                    statuses[tname] = "timeout" if late else "stopped:after-failure"
            break
        time.sleep(0.25)
    return statuses


def _collect_outputs(plans: list[_RunPlan], out: Path, name: str, before: set[Path]
                     ) -> tuple[dict[str, Path | None], dict[str, dict[str, Any] | None]]:
    """Each tier's newest new run folder under ``out`` and its ``summary.json`` (None if absent)."""
    new = {p.resolve() for p in out.glob(f"{name}-*")} - before
    run_dirs: dict[str, Path | None] = {}
    summaries: dict[str, dict[str, Any] | None] = {}
    for tier, _, _, run_name in plans:
        mine = sorted((p for p in new if p.name.startswith(f"{run_name}-")), key=lambda p: p.stat().st_mtime)
        run_dirs[tier.name] = mine[-1] if mine else None
        sfile = mine[-1] / "summary.json" if mine else None
        summaries[tier.name] = json.loads(sfile.read_text(encoding="utf-8")) if sfile and sfile.is_file() else None
    return run_dirs, summaries


def run_halos(topo: HalosTopology, config: str | Path, overrides: list[str] | tuple[str, ...] = (),
              out_dir: str | Path | None = None, timeout_s: float = 0.0, ipc_timeout_s: float = 600.0,
              status_every_s: float = STATUS_EVERY_S, echo: bool = True, resume: str | None = None) -> HalosRunResult:
    """Submit the regional runs, then the global run, and wait until all have finished.

    ``config`` + ``overrides`` is one fl-geo config for both tiers (validated here first);
    ``run.name`` becomes ``<name>-global`` / ``<name>-<region>``, ``run.num_clients`` the tier's
    worker count, ``run.out_dir`` ``out_dir`` (absolute; default ``<project>/runs``). A run still
    going after ``timeout_s`` (0 = none) is stopped with ``flwr stop``, every one of them.

    ``resume``: ``"global"`` or a region's name: submit that tier's run only, with
    ``run.resume=true``, after it failed in an earlier ``halos-run`` (same config and overrides)
    while the other tiers go on. Its checkpoints must be in a fixed ``run.checkpoint_dir`` (each
    deployed run writes a new run folder; every tier has its folder under it), else a DeployError
    before anything is submitted.
    """
    from fl_geo.config import load_config

    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    cfg_path = Path(config)
    if not cfg_path.is_absolute() and not cfg_path.exists():
        cfg_path = topo.app_dir / cfg_path
    out = Path(out_dir).expanduser() if out_dir else topo.app_dir / "runs"
    out = (out if out.is_absolute() else Path.cwd() / out).resolve()
    base = [o for o in overrides if o.partition("=")[0].strip() not in ("run.out_dir", "run.num_clients")]
    base.append(f"run.out_dir={out}")
    cfg = load_config(cfg_path, [*base, "run.clock=wall"])
    if cfg.strategy.name != "halos":
        raise DeployError(f"{cfg_path}: strategy.name must be halos for a HALoS deployment, got {cfg.strategy.name!r}")
    base.append("run.clock=wall")
    name = cfg.run.name
    if resume and not cfg.run.checkpoint_dir:
        raise DeployError("resuming a tier needs its checkpoints in a fixed run.checkpoint_dir (the interrupted "
                          "halos-run's run.checkpoint_every and run.checkpoint_dir overrides)")
    topo.ipc_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    plans = _plan_runs(topo, cfg_path, base, name, ipc_timeout_s)
    if resume:  # the other tiers go on; only this one starts again, from its checkpoint
        names = [region for region, _ in topo.regions]
        if resume != "global" and resume not in names:
            raise DeployError(f"--resume-region {resume!r}: the topology's regions are {names}")
        tier, app, rc, run_name = plans[-1] if resume == "global" else plans[names.index(resume)]
        plans = [(tier, app, {**rc, "overrides": f"{rc['overrides']} run.resume=true"}, run_name)]

    before = {p.resolve() for p in out.glob(f"{name}-*")}
    t0 = time.monotonic()
    run_ids = _submit_all(plans, say)
    statuses = _wait_for_runs(plans, run_ids, out, before, t0, timeout_s, status_every_s,
                              keep_regions=bool(cfg.run.checkpoint_every and cfg.run.checkpoint_dir))
    wall = time.monotonic() - t0
    run_dirs, summaries = _collect_outputs(plans, out, name, before)
    say(f"HALoS runs {statuses} after {wall:.1f} s")
    if LEFT_FOR_RESUME in statuses.values():
        (failed,) = [t for t, st in statuses.items() if st.startswith("finished") and st != "finished:completed"]
        regional = {t.name: region for region, t in topo.regions}
        flag = f"--resume-region {regional[failed]}" if failed in regional else "--resume-global"
        say(f"the run of {failed} failed; the others go on and wait up to {ipc_timeout_s:.0f} s for it: run the "
            f"same command with {flag} to continue it from its newest checkpoint")
    return HalosRunResult(run_ids, statuses, run_dirs, summaries, wall)
