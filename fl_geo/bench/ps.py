"""Benchmark of the sharded parameter server on loopback: memory, outer-step time, data path.

What it shows (issue: Di-PS at scale), for one model of ``--params`` fp32 parameters (default
300 M: 1.2 GB in fp32) and F = ``--followers`` (default 1, 2, 4) follower processes:

- **per-follower peak memory** (VmHWM of each follower process): θ_s, the fp32 outer state and
  the running sum scale as 1/F; the receive buffers as (unhandled pushes)/F;
- **outer-step wall time**: from the first control request of the step (norms, fold per client,
  normalise, clip factor, step and the follower's checkpoint) to the last follower's answer;
- **bytes moved per step**: each client pulls θ and pushes its update, both in the wire precision;
- **data path vs Flower**: one client's push + pull of the model, alone, against Flower's own
  message path for the same payload (`fl_geo.bench.flower_path`: a SuperLink and a SuperNode on
  loopback, one message there and back), both as "MB/s each way" = 2 x payload / (time there +
  time back), measured in the same run; the target is at least 5x. The per-client rates with
  all clients transferring at once (sharing the machine's cores) are reported too.

The clients are threads of this process holding a full model each (as a datacenter does); the
followers are real processes started by `fl_geo.ps.supervisor.FollowerSupervisor`, so every byte
crosses a loopback TCP connection. Usage::

    fl-geo bench ps [--params N] [--followers 1,2,4] [--clients 2] [--steps 2] [--wire bf16]
                    [--flower-mib M | --no-flower] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fl_geo.core.shards import ShardPlan, global_norm
from fl_geo.core.state import ParamSpec
from fl_geo.ps.follower import WIRE_DTYPES

__all__ = ["main", "run_ps_bench", "synthetic_spec"]

DEFAULT_PARAMS = 300_000_000
TARGET_SPEEDUP = 5.0


def synthetic_spec(num_params: int, layers: int = 24) -> ParamSpec:
    """An LLM-shaped layout: an embedding, ``layers`` equal blocks and a final norm."""
    if num_params < layers * 1024:
        raise ValueError(f"--params {num_params} is too small for {layers} layers")
    width = 4096
    embed_rows = max(1, num_params // 10 // width)
    block = (num_params - embed_rows * width - width) // layers
    rows = max(1, block // width)
    names = ["embed.weight", *[f"blocks.{i}.w" for i in range(layers)], "norm.weight"]
    shapes = [(embed_rows, width), *[(rows, width)] * layers, (width,)]
    return ParamSpec(tuple(names), tuple(shapes), ("float32",) * len(names))


def _rss(pid: int, key: str = "VmHWM") -> float:
    """A process's memory figure from /proc in MiB (NaN where unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def _one_config(spec: ParamSpec, followers: int, clients: int, steps: int, wire: str, workdir: Path,
                seed: int) -> dict[str, Any]:
    from fl_geo.ps.supervisor import FollowerSupervisor

    plan = ShardPlan.build(spec, followers)
    gen = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(spec.numel, generator=gen) * 0.02
    sup = FollowerSupervisor(plan, workdir=workdir / f"F{followers}", optimizer_name="nesterov",
                             optimizer_kwargs={"lr": 0.7, "momentum": 0.8}, wire=wire, send="pseudo_grad",
                             keep=1, heartbeat_s=1.0, fork=False)  # fresh processes: RSS of the follower alone
    dtype = WIRE_DTYPES[wire]
    out: dict[str, Any] = {"followers": followers, "clients": clients}
    t0 = time.perf_counter()
    sup.start(theta0)
    out["start_s"] = time.perf_counter() - t0
    del theta0
    leader = [sup.client(i) for i in range(followers)]  # they hold the key: control calls

    def token(job: str, version: int) -> str:  # what the leader sends each job (fl_geo.ps.auth)
        return sup.auth.mint_job(job, range(followers), version, ttl_s=3600.0)

    models = [torch.empty(spec.numel) for _ in range(clients)]
    pull_s, push_s, step_s = [], [], []
    try:
        for step in range(steps):
            jobs = [f"s{step}-c{c}" for c in range(clients)]
            tokens = [token(job, step) for job in jobs]
            with ThreadPoolExecutor(max_workers=clients) as pool:
                pull_s.extend(pool.map(_pull_all, [plan] * clients, [sup.addresses] * clients, [wire] * clients,
                                       models, tokens))
            updates = [(torch.randn(spec.numel, generator=gen) * 1e-3).to(dtype) for _ in range(clients)]
            with ThreadPoolExecutor(max_workers=clients) as pool:
                push_s.extend(pool.map(_push_all, [plan] * clients, [sup.addresses] * clients, jobs, updates,
                                       range(clients), tokens))
            updates.clear()
            t = time.perf_counter()
            versions = _leader_step(leader, jobs)
            step_s.append(time.perf_counter() - t)
            if versions != [step + 1] * followers:
                raise RuntimeError(f"followers at versions {versions} after step {step + 1}")
        out["follower_peak_rss_mib"] = [round(_rss(sup.pid(i)), 1) for i in range(followers)]
        # One client alone, as Flower's probe sends one message: the apples-to-apples transfer.
        solo = (torch.randn(spec.numel, generator=gen) * 1e-3).to(dtype)
        solo_token = token("solo", steps)
        out["solo_push_s"] = _push_all(plan, sup.addresses, "solo", solo, 0, solo_token)
        out["solo_pull_s"] = _pull_all(plan, sup.addresses, wire, models[0], solo_token)
        for fc in leader:
            fc.control("drop", job="solo")
    finally:
        for fc in leader:
            fc.close()
        sup.stop()
    payload = spec.numel * dtype.itemsize
    out.update({
        "payload_bytes": payload,
        "bytes_per_step": 2 * clients * payload,
        "pull_s": [round(x, 3) for x in pull_s],
        "push_s": [round(x, 3) for x in push_s],
        "step_s": [round(x, 3) for x in step_s],
        # per client: the model in and the update out, each one payload
        "pull_mb_s": payload / 1e6 / min(pull_s),
        "push_mb_s": payload / 1e6 / min(push_s),
        # both directions over their total time: the definition of Flower's "MB/s each way"
        "solo_mb_s_each_way": 2 * payload / 1e6 / (out["solo_push_s"] + out["solo_pull_s"]),
    })
    return out


def _pull_all(plan: ShardPlan, addresses: list[str], wire: str, model: torch.Tensor, token: str) -> float:
    """One client's pull with its job token: every shard in parallel (one stream per follower); seconds."""
    from fl_geo.ps.client import FollowerClient

    def one(i: int) -> None:
        s = plan.shards[i]
        with FollowerClient(addresses[i]) as fc:
            _, x = fc.pull(0, s.numel, wire=wire, token=token)
        model[s.begin:s.end].copy_(x)

    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=plan.num_shards) as pool:
        list(pool.map(one, range(plan.num_shards)))
    return time.perf_counter() - t


def _push_all(plan: ShardPlan, addresses: list[str], job: str, update: torch.Tensor, rank: int,
              token: str) -> float:
    """One client's push, shard by shard, starting at follower ``rank mod F`` (clients that
    finish together start on different followers, as the leader's schedule has them); seconds."""
    from fl_geo.ps.client import FollowerClient

    t = time.perf_counter()
    for k in range(plan.num_shards):
        i = (rank + k) % plan.num_shards
        s = plan.shards[i]
        with FollowerClient(addresses[i]) as fc:
            fc.push(job, i, update[s.begin:s.end], token=token)
    return time.perf_counter() - t


def _leader_step(leader: list[Any], jobs: list[str]) -> list[int]:
    """The control sequence of one outer step: norms and a fold per update, normalise, clip
    factor, step (each follower checkpoints before it answers); the followers' new versions."""
    for job in jobs:
        sums = [fc.control("norms", job=job)["sq_sums"] for fc in leader]
        if not math.isfinite(global_norm(sums)):
            raise RuntimeError(f"update {job} is not finite")
        for fc in leader:
            fc.control("fold", job=job, weight=1.0, rescale=1.0)
    sums = [fc.control("mean_sq_sums", total_weight=float(len(jobs)))["sq_sums"] for fc in leader]
    factor = min(1.0, 1.0 / (global_norm(sums) + 1e-6))
    with ThreadPoolExecutor(max_workers=len(leader)) as pool:
        return list(pool.map(lambda fc: int(fc.control("step", clip_factor=factor)["version"]), leader))


def _idle_follower_rss(workdir: Path) -> float:
    """Peak RSS of a follower process holding a negligible shard: the interpreter, torch and
    gRPC, which every follower pays whatever its shard (subtracted to see the 1/F part)."""
    from fl_geo.ps.supervisor import FollowerSupervisor

    spec = ParamSpec(("blocks.0.w",), ((1024,),), ("float32",))
    with FollowerSupervisor(ShardPlan.build(spec, 1), workdir=workdir / "idle", keep=1, fork=False) as sup:
        sup.start(torch.zeros(spec.numel))
        return _rss(sup.pid(0))


def run_ps_bench(num_params: int = DEFAULT_PARAMS, followers: Sequence[int] = (1, 2, 4), clients: int = 2,
                 steps: int = 2, wire: str = "bf16", flower_mib: int | None = None, workdir: Path | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """Run every F, then Flower's own path for the same payload; returns all figures."""
    spec = synthetic_spec(num_params)
    with tempfile.TemporaryDirectory(prefix="fl-geo-bench-ps-", dir=workdir) as tmp:
        idle = _idle_follower_rss(Path(tmp))
        rows = [_one_config(spec, f, clients, steps, wire, Path(tmp), seed) for f in followers]
        flower = None
        if flower_mib != 0:
            from fl_geo.bench.flower_path import measure_flower_path

            mib = flower_mib or max(1, round(spec.numel * WIRE_DTYPES[wire].itemsize / 2**20))
            flower = measure_flower_path(mib, workdir=Path(tmp) / "flower")
    return {"num_params": spec.numel, "fp32_bytes": spec.numel * 4, "wire": wire, "idle_follower_rss_mib": idle,
            "rows": rows, "flower": flower}


def format_ps_bench(result: dict[str, Any]) -> str:
    """The table the README/docs quote, and the data path vs Flower verdict."""
    lines = [f"model: {result['num_params'] / 1e6:.0f} M parameters ({result['fp32_bytes'] / 2**30:.2f} GiB fp32), "
             f"wire {result['wire']}", "",
             f"an idle follower process (interpreter, torch, gRPC) peaks at {result['idle_follower_rss_mib']:.0f} MiB; "
             "'shard part' is a follower's peak minus that", "",
             "| F | follower peak RSS (MiB each) | shard part, largest (MiB) | vs F=1 | outer step (s) | bytes moved/step (GB) "
             f"| pull MB/s ({result['rows'][0]['clients']} clients at once) | push MB/s (same) | one client alone, MB/s each way |",
             "|---|---|---|---|---|---|---|---|---|"]
    idle = result["idle_follower_rss_mib"]
    base = max(result["rows"][0]["follower_peak_rss_mib"]) - idle
    for r in result["rows"]:
        rss = r["follower_peak_rss_mib"]
        part = max(rss) - idle
        lines.append(f"| {r['followers']} | {', '.join(f'{x:.0f}' for x in rss)} | {part:.0f} | {part / base:.2f} | "
                     f"{min(r['step_s']):.2f} | {r['bytes_per_step'] / 1e9:.2f} | {r['pull_mb_s']:.0f} | {r['push_mb_s']:.0f} | "
                     f"{r['solo_mb_s_each_way']:.0f} |")
    flower = result.get("flower")
    if flower:
        fl = float(flower["mb_per_s_each_way"])
        solo = min(r["solo_mb_s_each_way"] for r in result["rows"])
        loaded = min(min(r["pull_mb_s"], r["push_mb_s"]) for r in result["rows"])
        ok = solo >= TARGET_SPEEDUP * fl
        lines += ["", f"Flower message path, one message of the same payload ({flower['payload_bytes'] / 2**20:.0f} MiB) "
                  f"to one SuperNode and back: {fl:.1f} MB/s each way",
                  f"data path, one client alone (slowest F): {solo:.0f} MB/s each way = {solo / fl:.1f}x Flower "
                  f"(target >= {TARGET_SPEEDUP:.0f}x): {'met' if ok else 'NOT met'}",
                  f"data path, slowest direction with {result['rows'][0]['clients']} clients transferring at once: "
                  f"{loaded:.0f} MB/s per client = {loaded / fl:.1f}x Flower"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fl-geo bench ps", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="model parameters (default 300 M = 1.2 GB fp32)")
    p.add_argument("--followers", default="1,2,4", help="comma-separated follower counts")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--wire", default="bf16", choices=sorted(WIRE_DTYPES))
    p.add_argument("--flower-mib", type=int, default=None, help="Flower path payload (default: the model in the wire precision)")
    p.add_argument("--no-flower", action="store_true", help="skip Flower's path")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = p.parse_args(argv)
    followers = [int(x) for x in a.followers.split(",") if x.strip()]
    result = run_ps_bench(a.params, followers, a.clients, a.steps, a.wire, 0 if a.no_flower else a.flower_mib)
    print(format_ps_bench(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0
