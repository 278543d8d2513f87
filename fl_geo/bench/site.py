"""``fl-geo bench site``: what a persistent site group saves per round against spawning the ranks.

A multi-device site runs each round's inner loop as a data-parallel job (docs/multidevice.md).
Started per message (`DataParallelTrainer`, its ranks spawned as a fresh ClientApp process pays
them: `_ranks_spawned`), every round pays process start, imports,
process-group set-up, model and optimizer construction and tear-down; the persistent group
(`SiteGroupTrainer`, fl_geo.clients.site_group) pays them once and then, per round, a socket
round trip, the state files and the ranks' reload of parameters and AdamW state.

Both paths train the same model from the same start on the same batches for ``rounds`` rounds of
``steps`` steps, carrying the parameters and AdamW state from round to round as the ClientApp
does through ``context.state``. Per round: the wall time of the whole job as the coordinator sees
it (trainer, state in, train, state out), the time in training steps (the ranks' own
steps x step time), and their difference, the **overhead outside training steps**. Medians over
rounds 2..R (round 1 of the group starts the daemon and its ranks; it is shown on its own). Also:
tokens/s per round and within the steps, each rank's peak resident memory (and peak CUDA memory on
GPUs), and the largest parameter difference between the two paths after the last round (same
arithmetic, so 0 up to float summation order). Target: >= 5x less overhead per round.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fl_geo.clients.site_group import SiteGroup, SiteGroupTrainer
from fl_geo.core.state import flatten
from fl_geo.data import BatchSampler
from fl_geo.fork_server import RANK_START_ENV
from fl_geo.inner.distributed import DataParallelTrainer, as_factory, model_spec, resolve_devices
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, TrainResult

__all__ = ["format_site_bench", "main", "run_site_bench"]

TARGET = 5.0  # x less overhead per round
_VOCAB, _TOKENS = 256, 200_000


@functools.lru_cache(maxsize=2)
def _tokens(count: int) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (count,), generator=torch.Generator().manual_seed(0))


def bench_source(seq_len: int, batch: int) -> BatchSampler:
    """The benchmark's per-rank batches: a fixed random token stream (each rank builds it once)."""
    return BatchSampler(_tokens(_TOKENS), seq_len, batch, seed=0, stream=0)


def _stats(result: TrainResult, wall: float) -> dict[str, float]:
    in_steps = result.steps * result.step_time_s
    return {"wall_s": wall, "steps_s": in_steps, "overhead_s": wall - in_steps,
            "tokens_per_s": result.tokens / wall, "tokens_per_s_steps": result.tokens / in_steps}


def _carry(trainer: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return trainer.params.clone(), {k: v.clone() for k, v in trainer.optimizer_state().items()}


def _group_rounds(parallel: str, mcfg: ModelConfig, inner: InnerConfig, spec: Any, start: torch.Tensor,
                  source: Any, devices: Any, backend: str, threads: int, rounds: int,
                  steps: int) -> tuple[list[dict[str, float]], torch.Tensor, list[dict[str, Any]]]:
    """``rounds`` rounds through a fresh site group of ``parallel``; its rows, final θ and rank memory."""
    rows: list[dict[str, float]] = []
    params, opt = start.clone(), {}
    with tempfile.TemporaryDirectory(prefix="fl-geo-bench-site-") as tmp:
        group = SiteGroup(f"unix://{tmp}/site.sock", {"bench": "site", "model": repr(mcfg), "parallel": parallel},
                          devices, backend, threads=threads)
        try:
            for r in range(rounds):
                t0 = time.perf_counter()
                trainer = SiteGroupTrainer(group, as_factory(mcfg), inner, spec, batches=source, parallel=parallel)
                try:
                    trainer.params.copy_(params)
                    trainer.load_optimizer_state(opt)
                    result = trainer.train(None, steps, r * steps)
                    params, opt = _carry(trainer)
                finally:
                    trainer.release()
                rows.append(_stats(result, time.perf_counter() - t0))
            memory = (group.hello() or {}).get("memory", [])
        finally:
            group.stop()
    return rows, params, memory


@contextlib.contextmanager
def _ranks_spawned() -> Iterator[None]:
    """Per-message ranks as a ClientApp pays them: each imports torch itself (``spawn``).

    A ClientApp process lives for one message, so its ranks' fork server (`fl_geo.fork_server`)
    starts with it and pays the imports once per message, about what spawned ranks pay in wall time
    on as many cores as ranks. In this one bench process a fork server would outlive the round and
    serve every later round with the imports done, which no ClientApp sees; and spawned ranks are
    this process's children, whose peak memory ``RUSAGE_CHILDREN`` reads.
    """
    saved = os.environ.get(RANK_START_ENV)
    os.environ[RANK_START_ENV] = "spawn"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(RANK_START_ENV, None)
        else:
            os.environ[RANK_START_ENV] = saved


def run_site_bench(*, rounds: int = 4, steps: int = 5, ranks: int = 2, batch: int = 4, seq_len: int = 64,
                   layers: int = 2, d_model: int = 128, threads: int = 1, device: str = "cpu",
                   parallels: Sequence[str] = ("ddp", "fsdp")) -> dict[str, Any]:
    """Each path (spawned DDP; the group with each of ``parallels``, which must include ddp),
    ``rounds`` rounds each; the numbers `format_site_bench` prints."""
    if "ddp" not in parallels or not set(parallels) <= {"ddp", "fsdp"}:
        raise ValueError(f"parallels must include ddp and name only ddp and fsdp, got {list(parallels)}")
    if rounds < 2 or steps < 1 or ranks < 1:
        raise ValueError(f"need rounds >= 2, steps >= 1, ranks >= 1; got {rounds}, {steps}, {ranks}")
    torch.set_num_threads(threads)
    mcfg = ModelConfig(n_layers=layers, d_model=d_model, n_heads=max(2, d_model // 64), max_seq_len=seq_len)
    inner = InnerConfig(batch_size=batch, seq_len=seq_len, warmup_steps=2, total_steps=rounds * steps, device=device)
    devices, backend = resolve_devices(device, ranks)
    spec = model_spec(mcfg)
    start = flatten(build_model(mcfg, 0).state_dict(), spec)
    source = functools.partial(bench_source, seq_len, batch)

    spawn: list[dict[str, float]] = []
    params, opt = start.clone(), {}
    with _ranks_spawned():
        for r in range(rounds):
            t0 = time.perf_counter()
            job = DataParallelTrainer(mcfg, inner, spec, devices, backend, threads=threads)
            job.params.copy_(params)
            job.load_optimizer_state(opt)
            result = job.train(source(), steps, r * steps)
            params, opt = _carry(job)
            spawn.append(_stats(result, time.perf_counter() - t0))
    spawn_params = params
    spawn_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest rank (KiB on Linux)

    groups = {parallel: _group_rounds(parallel, mcfg, inner, spec, start, source, devices, backend, threads,
                                      rounds, steps) for parallel in parallels}
    group_rounds, params, _ = groups["ddp"]

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows[1:])

    paths = [("spawn", spawn)] + [("group" if p == "ddp" else f"group_{p}", rows) for p, (rows, _, _) in groups.items()]
    summary = {name: {key: median(rows, key) for key in rows[0]} for name, rows in paths}
    ratio = summary["spawn"]["overhead_s"] / max(summary["group"]["overhead_s"], 1e-9)
    return {
        "setup": {"rounds": rounds, "steps": steps, "ranks": ranks, "batch_per_rank": batch, "seq_len": seq_len,
                  "params": spec.numel, "device": device, "backend": backend, "threads_per_rank": threads},
        "spawn": spawn, "group": group_rounds, "median": summary,
        "group_startup_s": group_rounds[0]["overhead_s"],
        "peak_rss_mib": {"spawn_largest_rank": spawn_rss,
                         **{p: [m.get("peak_rss_mib") for m in mem] for p, (_, _, mem) in groups.items()}},
        "peak_device_mib": {p: [m["peak_device_mib"] for m in mem if "peak_device_mib" in m]
                            for p, (_, _, mem) in groups.items()},
        "max_param_diff": float((spawn_params - params).abs().max()),
        "max_param_diff_fsdp": float((groups["fsdp"][1] - params).abs().max()) if "fsdp" in groups else None,
        "overhead_ratio": ratio, "pass": ratio >= TARGET,
    }


def format_site_bench(result: dict[str, Any]) -> str:
    s, m = result["setup"], result["median"]
    lines = [
        f"fl-geo bench site: {s['ranks']} ranks ({s['backend']} on {s['device']}, {s['threads_per_rank']} thread each), "
        f"decoder of {s['params'] / 1e6:.2f} M parameters, {s['steps']} steps x {s['batch_per_rank']} x "
        f"{s['seq_len']} tokens per rank per round; medians of rounds 2..{s['rounds']}",
        f"{'':22}{'per round':>11}{'in steps':>10}{'overhead':>10}{'tokens/s':>10}{'in steps':>10}",
    ]
    for name, label in (("spawn", "spawn per message"), ("group", "persistent group"),
                        ("group_fsdp", "persistent group, FSDP")):
        if name not in m:
            continue
        row = m[name]
        lines.append(f"{label:22}{row['wall_s']:>10.3f}s{row['steps_s']:>9.3f}s{row['overhead_s']:>9.3f}s"
                     f"{row['tokens_per_s']:>10.0f}{row['tokens_per_s_steps']:>10.0f}")
    rss = result["peak_rss_mib"]

    def mib(values: list[Any]) -> str:
        return ", ".join(f"{v:.0f}" for v in values if v is not None) + " MiB"

    lines += [
        f"group start-up (its round 1, outside steps): {result['group_startup_s']:.2f} s",
        f"peak RSS per rank: spawned DDP {rss['spawn_largest_rank']:.0f} MiB (largest rank); group DDP {mib(rss['ddp'])}"
        + (f"; group FSDP {mib(rss['fsdp'])}" if "fsdp" in rss else ""),
    ]
    for parallel, values in result["peak_device_mib"].items():
        if values:
            lines.append(f"peak device memory per rank ({parallel.upper()}): {mib(values)}")
    lines += [
        f"same training: max |θ_spawn − θ_group| after round {s['rounds']} = {result['max_param_diff']:.1e}"
        + (f", max |θ_FSDP − θ_DDP| = {result['max_param_diff_fsdp']:.1e}"
           if result["max_param_diff_fsdp"] is not None else ""),
        f"{result['overhead_ratio']:.1f}x less per-round overhead (target >= {TARGET:g}x: "
        f"{'PASS' if result['pass'] else 'FAIL'})",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench site [--rounds R] [--steps H] [--ranks N] [...] [--json] [--strict]``."""
    parser = argparse.ArgumentParser(prog="fl-geo bench site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per path (>= 2; medians over 2..R)")
    parser.add_argument("--steps", type=int, default=5, help="inner steps per round")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (devices) of the site (1 on a one-GPU machine)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", default="cpu", help="cpu (gloo), or cuda / cuda:k (nccl)")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 group")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 below the target")
    args = parser.parse_args(argv)
    try:
        result = run_site_bench(rounds=args.rounds, steps=args.steps, ranks=args.ranks, batch=args.batch,
                                seq_len=args.seq_len, layers=args.layers, d_model=args.d_model,
                                threads=args.threads, device=args.device,
                                parallels=("ddp",) if args.no_fsdp else ("ddp", "fsdp"))
    except ValueError as exc:
        parser.exit(2, f"fl-geo bench site: {exc}\n")
    print(json.dumps(result, indent=2) if args.json else format_site_bench(result))
    return 1 if args.strict and not result["pass"] else 0
