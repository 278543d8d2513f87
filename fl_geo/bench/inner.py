"""``fl-geo bench inner``: how fast the datacenter client's inner loop is, and how much of a
simulation's wall time it gets.

1. **Loop**: tokens/s of `InnerTrainer.train` (what every ClientApp runs: schedule, autocast, loss,
   clip, AdamW, losses kept on the device) against a plain torch training loop written the way a
   user would (same model and initial weights, same batches from the same sampler, same AdamW
   groups, schedule, clip and device, same seed). Blocks of ``steps`` steps alternate between the
   two (ABBA order, so drift and warm caches favour neither); both continue from where their
   previous block stopped at the same schedule positions, so both train the same model on the same
   data and their losses must agree — a check that the comparison is like for like. Target: the
   ratio of the median tokens/s >= 0.95.

2. **Simulation share**: a short `fl-geo run` of the config (the quickstart by default) on Ray,
   then, from its metrics.jsonl, the share of the wall time after start-up (rounds 2..R: round 1
   carries Ray's start, the actors' imports and the first model build) that the clients spent in
   their inner loops: sum over replies of steps x step_time_s (timers the clients already
   report), over (slots x wall), where slots is the number of clients that train at once. Target:
   >= 80 %. The rest is apportioned from the same round's structure with costs measured in this
   process on the same model (no timer added to the run): the server's evaluation, its
   aggregation (decode, checked fold, outer step) and encode of the broadcast, the clients'
   encode/decode and per-round set-up (optimizer and its state in and out); what remains is
   Ray / Flower dispatch and everything else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fl_geo.config import FlGeoConfig, load_config

__all__ = ["format_inner_bench", "loop_bench", "main", "plain_loop", "share_from_metrics"]

DEFAULT_CONFIG = "configs/quickstart_diloco.yaml"
LOOP_TARGET = 0.95
SHARE_TARGET = 0.80
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32", "client.seq_len=32",
        "client.batch_size=4", "client.warmup_steps=2", "data.corpus=pydoc", "data.partition=iid",
        "run.eval_batches=2", "strategy.inner_steps=3"]


# ---------------------------------------------------------------------------------------------
# 1. The inner loop against a plain torch loop


def _setup(cfg: FlGeoConfig, device: str) -> tuple[Any, Callable[[], torch.nn.Module], Any]:
    """The sampler of partition 0, a model factory (same weights every call) and the inner config."""
    from fl_geo.data import BatchSampler
    from fl_geo.runtime.builders import inner_config, make_model, partitions

    icfg = inner_config(cfg.client, total_steps=10_000)
    icfg.device = device
    parts, _ = partitions(cfg.data, cfg.run.num_clients)
    sampler = BatchSampler(parts[0].train, icfg.seq_len, icfg.batch_size, seed=cfg.data.seed, stream=0)
    return sampler, lambda: make_model(cfg.model, cfg.run.seed), icfg


class PlainLoop:
    """A plain torch training loop: what a user writes without fl-geo (same maths as the inner loop)."""

    def __init__(self, model: torch.nn.Module, icfg: Any) -> None:
        from fl_geo.inner.device import autocast_dtype, pick_device
        from fl_geo.inner.muon import hidden_matrices

        self.device = pick_device(icfg.device)
        self.amp = autocast_dtype(self.device, icfg.precision)
        self.model = model.to(self.device)
        self.icfg = icfg
        # client.optimizer=muon: what a user writes, torch's Muon on the hidden matrices beside AdamW
        matrices = set(hidden_matrices(self.model)) if icfg.optimizer == "muon" else set()
        named = [(n, p) for n, p in self.model.named_parameters() if n not in matrices]
        self.muon = None if not matrices else torch.optim.Muon(
            [p for n, p in self.model.named_parameters() if n in matrices], lr=icfg.muon_lr,
            momentum=icfg.muon_momentum, nesterov=icfg.muon_nesterov, ns_steps=icfg.muon_ns_steps,
            weight_decay=icfg.muon_weight_decay, adjust_lr_fn=icfg.muon_adjust_lr)
        decay = [p for _, p in named if p.ndim >= 2]
        rest = [p for _, p in named if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": icfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=icfg.lr, betas=tuple(icfg.betas), eps=icfg.eps)

    def train(self, sampler: Any, steps: int, start: int) -> float:
        """``steps`` steps at schedule positions ``start…``; returns the mean loss."""
        from fl_geo.inner.training import lr_at

        self.model.train()
        losses = []
        for i in range(steps):
            for group in self.opt.param_groups:
                group["lr"] = lr_at(start + i, self.icfg)
            if self.muon is not None:
                self.muon.param_groups[0]["lr"] = lr_at(start + i, self.icfg) * self.icfg.muon_lr / self.icfg.lr
            x, y = sampler.batch(start + i)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            if self.icfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.icfg.grad_clip)
            self.opt.step()
            if self.muon is not None:
                self.muon.step()
            losses.append(loss.detach())
        return float(torch.stack(losses).mean())  # one device sync per block, as the inner loop


def plain_loop(model: torch.nn.Module, icfg: Any) -> PlainLoop:
    return PlainLoop(model, icfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop_bench(cfg: FlGeoConfig, *, steps: int = 20, repeats: int = 5, warmup: int = 3,
               device: str = "", threads: int | None = 1) -> dict[str, Any]:
    """Interleaved timings of ``InnerTrainer.train`` and `PlainLoop` on the same model and data.

    Returns per-block tokens/s of both (wall clock, and per second of this process's CPU time),
    their medians, the ratio (median of the per-repeat ratios; CPU time on a CPU device, wall time
    on an accelerator) and the largest difference between the two loops' block losses (0 on CPU:
    identical arithmetic).
    """
    from fl_geo.inner.training import InnerTrainer

    if steps < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, repeats >= 1, warmup >= 0; got {steps}, {repeats}, {warmup}")
    if threads:
        torch.set_num_threads(threads)
    sampler, build, icfg = _setup(cfg, device or cfg.client.device)
    torch.manual_seed(cfg.run.seed)
    ours = InnerTrainer(build(), icfg)
    plain = PlainLoop(build(), icfg)
    tokens_per_block = steps * icfg.batch_size * icfg.seq_len
    position = 0
    if warmup:  # allocator, autotuning, first-touch of the optimizer state: outside the timings
        ours.train(sampler, warmup, 0)
        plain.train(sampler, warmup, 0)
        position = warmup
    rates: dict[str, list[float]] = {"fl-geo": [], "plain": []}
    cpu_rates: dict[str, list[float]] = {"fl-geo": [], "plain": []}
    losses: dict[str, list[float]] = {"fl-geo": [], "plain": []}

    def block(name: str) -> None:
        _sync(ours.device)
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "fl-geo":
            loss = ours.train(sampler, steps, position).mean_loss
        else:
            loss = plain.train(sampler, steps, position)
        _sync(ours.device)
        rates[name].append(tokens_per_block / (time.perf_counter() - t0))
        cpu_rates[name].append(tokens_per_block / max(time.process_time() - c0, 1e-9))
        losses[name].append(loss)

    for r in range(repeats):
        order = ("fl-geo", "plain") if r % 2 == 0 else ("plain", "fl-geo")
        for name in order:
            block(name)
        position += steps
    med = {name: statistics.median(v) for name, v in rates.items()}
    pairs = [a / b for a, b in zip(rates["fl-geo"], rates["plain"], strict=True)]
    cpu_pairs = [a / b for a, b in zip(cpu_rates["fl-geo"], cpu_rates["plain"], strict=True)]
    # Judged on the median of the per-repeat ratios (the two blocks of a repeat run back to back,
    # so slow drifts cancel within a pair). On a CPU device the ratio is taken on this process's
    # CPU time: on a shared machine the wall time also counts the moments other processes held
    # the core, which is noise of the machine, not cost of the loop. Accelerators: wall time.
    basis = "cpu" if ours.device.type == "cpu" else "wall"
    ratio = statistics.median(cpu_pairs if basis == "cpu" else pairs)
    return {
        "device": str(ours.device), "threads": torch.get_num_threads(), "steps": steps, "repeats": repeats,
        "batch": icfg.batch_size, "seq_len": icfg.seq_len,
        "params": sum(p.numel() for p in ours.model.parameters()),
        "tokens_per_s": rates, "median": med, "ratio": ratio, "basis": basis,
        "tokens_per_cpu_s": cpu_rates, "cpu_pair_ratios": cpu_pairs,
        "ratio_wall": statistics.median(pairs),
        "median_cpu": {name: statistics.median(v) for name, v in cpu_rates.items()},
        "pair_ratios": pairs, "ratio_of_medians": med["fl-geo"] / med["plain"],
        "ratio_of_best": max(rates["fl-geo"]) / max(rates["plain"]),
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["fl-geo"], losses["plain"], strict=True)),
        "pass": ratio >= LOOP_TARGET,
    }


# ---------------------------------------------------------------------------------------------
# 2. Inner training's share of a simulation's wall time


def slots_of(cfg: FlGeoConfig) -> int:
    """How many clients train at once: one for the inline backend, else the actors a local Ray
    of ``sim_cpus`` CPUs holds (⌊sim_cpus / client_cpus⌋), at most the number of clients."""
    if cfg.run.backend == "inline":
        return 1
    if cfg.run.ray_address.strip():
        raise ValueError("the simulation share is measured on a local Ray (a cluster's slots are not known "
                         "here): drop run.ray_address")
    return max(1, min(cfg.run.num_clients, int(cfg.run.sim_cpus // cfg.run.client_cpus)))


def share_from_metrics(records: Sequence[dict[str, Any]], slots: int, skip_rounds: int = 1) -> dict[str, Any]:
    """Inner training's share of the wall time of rounds ``skip_rounds+1 … R`` of a synchronous run.

    ``records``: metrics.jsonl rows (``step`` 0 is the initial evaluation, ``step`` r ends round
    r). Round r's wall time is ``time/wall_s[r] - time/wall_s[r-1]``; its training is
    ``outer/accepted x train/inner_steps x train/step_time_s`` client-seconds (the clients' own
    timers). Share = training / (slots x wall).
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    by_step = {int(r["step"]): r for r in records if "time/wall_s" in r}
    rounds = sorted(s for s in by_step if s > skip_rounds and s - 1 in by_step
                    and by_step[s].get("train/step_time_s") is not None)
    if not rounds:
        raise ValueError(f"no round after the first {skip_rounds} with timings in the metrics")
    wall = [by_step[s]["time/wall_s"] - by_step[s - 1]["time/wall_s"] for s in rounds]
    train = [float(by_step[s]["outer/accepted"]) * float(by_step[s]["train/inner_steps"])
             * float(by_step[s]["train/step_time_s"]) for s in rounds]
    evals = sum(1 for s in rounds if "val/loss" in by_step[s])
    total_wall = sum(wall)
    return {"rounds": rounds, "wall_s": total_wall, "train_client_s": sum(train), "slots": slots,
            "evals": evals, "clients": [float(by_step[s]["outer/accepted"]) for s in rounds],
            "share": sum(train) / (slots * total_wall) if total_wall > 0 else 0.0}


def _median_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def component_costs(cfg: FlGeoConfig) -> dict[str, float]:
    """Seconds per occurrence of what a synchronous round does besides training, measured here on
    the run's model (one thread, as the run's server and clients): the server's evaluation, its
    encode of the broadcast, its aggregation of K replies, and per client: decode of the model,
    encode of the update, and set-up of the trainer with its optimizer state in and out."""
    from fl_geo.core.accumulate import WeightedAccumulator, weight_for
    from fl_geo.core.outer import Nesterov
    from fl_geo.core.state import ParamSpec, flatten
    from fl_geo.inner.training import InnerTrainer
    from fl_geo.runtime.builders import inner_config, make_model
    from fl_geo.runtime.evaluation import GlobalEvaluator
    from fl_geo.runtime.wire import decode, decode_into, encode

    torch.set_num_threads(cfg.run.server_threads)
    model = make_model(cfg.model, cfg.run.seed)
    spec = ParamSpec.from_state_dict(model.state_dict())
    flat = flatten(model.state_dict(), spec).float()
    up, down = cfg.wire.up, cfg.wire.down
    k = cfg.run.num_clients
    evaluator = GlobalEvaluator(cfg, cfg.run.num_clients)
    replies = [encode(flat * (1 + i / 100), spec, up) for i in range(k)]
    acc = WeightedAccumulator(spec.numel)
    opt = Nesterov(spec.numel, lr=0.7, momentum=0.9)
    params = flat.clone()

    def aggregate() -> None:
        acc.reset()
        acc.add_batch_checked([decode(r, spec, up) for r in replies], [weight_for("tokens", 1000)] * k)
        opt.step(params, acc.mean())

    icfg = inner_config(cfg.client, total_steps=1000)
    icfg.device = "cpu"
    trainer = InnerTrainer(model, icfg)
    x = torch.zeros(1, icfg.seq_len, dtype=torch.long)
    trainer.train(type("One", (), {"batch": staticmethod(lambda step: (x, x))})(), 1, 0)
    state = trainer.optimizer_state()

    def setup() -> None:  # what clients/api.py does per train message besides training and the codec
        t = InnerTrainer(model, icfg)
        t.load_optimizer_state(state)
        t.optimizer_state()
        flatten(model.state_dict(), spec)

    out = torch.empty_like(flat)
    broadcast = encode(flat, spec, down)
    return {
        "eval": _median_time(lambda: evaluator.evaluate(flat)),
        "encode_down": _median_time(lambda: encode(flat, spec, down)),
        "aggregate": _median_time(aggregate),
        "client_decode": _median_time(lambda: decode_into(broadcast, spec, down, out=out)),
        "client_encode": _median_time(lambda: encode(flat, spec, up)),
        "client_setup": _median_time(setup),
    }


def breakdown(share: dict[str, Any], costs: dict[str, float]) -> dict[str, float]:
    """Wall seconds of the measured rounds by where they went.

    Server work stalls every slot (a synchronous round waits for it); client work other than
    training runs in the slots, so K clients' costs occupy K / slots of wall time. The remainder
    (never negative here; a negative one means the isolated costs over-estimate) is Ray / Flower
    dispatch, process scheduling and anything not itemised.
    """
    rounds = len(share["rounds"])
    slots = share["slots"]
    clients = sum(share["clients"])
    parts = {
        "inner training": share["train_client_s"] / slots,
        "server evaluation": share["evals"] * costs["eval"],
        "server aggregation + broadcast encode": rounds * (costs["aggregate"] + costs["encode_down"]),
        "client encode/decode": clients * (costs["client_encode"] + costs["client_decode"]) / slots,
        "client set-up (optimizer, state in/out)": clients * costs["client_setup"] / slots,
    }
    parts["Ray/Flower dispatch and other"] = share["wall_s"] - sum(parts.values())
    return parts


def sim_share(cfg: FlGeoConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Run ``cfg`` as `fl-geo run` does and measure inner training's share (see the module doc)."""
    from fl_geo.simulation import run_simulation

    if cfg.run.rounds < 2:
        raise ValueError("the simulation share needs run.rounds >= 2 (round 1 is start-up)")
    slots = slots_of(cfg)  # before the run: a config it cannot measure fails at once
    with tempfile.TemporaryDirectory(prefix="flgeo-bench-inner-") as tmp:
        run_dir = Path(out_dir or tmp) / "run"
        started = time.perf_counter()
        run_simulation(cfg, run_dir)
        total = time.perf_counter() - started
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    share = share_from_metrics(records, slots)
    costs = component_costs(cfg)
    return {**share, "total_s": total, "costs": costs, "breakdown": breakdown(share, costs),
            "pass": share["share"] >= SHARE_TARGET}


# ---------------------------------------------------------------------------------------------


def format_inner_bench(loop: dict[str, Any] | None, sim: dict[str, Any] | None) -> str:
    lines = []
    if loop is not None:
        med = loop["median"]
        lines += [
            f"inner loop: {loop['params']:,} parameters, batch {loop['batch']} x {loop['seq_len']}, "
            f"{loop['steps']} steps x {loop['repeats']} interleaved blocks, {loop['device']}, "
            f"{loop['threads']} thread(s)",
            f"  fl-geo InnerTrainer.train : {med['fl-geo']:10.0f} tokens/s  (blocks: "
            + ", ".join(f"{v:.0f}" for v in loop["tokens_per_s"]["fl-geo"]) + ")",
            f"  plain torch loop          : {med['plain']:10.0f} tokens/s  (blocks: "
            + ", ".join(f"{v:.0f}" for v in loop["tokens_per_s"]["plain"]) + ")",
            f"  per CPU-second: fl-geo {loop['median_cpu']['fl-geo']:.0f}, plain {loop['median_cpu']['plain']:.0f} "
            "tokens (this process's CPU time; what other processes take from the core is left out)",
            f"  ratio, wall clock: {loop['ratio_wall']:.3f} = median of the per-repeat ratios ("
            + ", ".join(f"{r:.3f}" for r in loop["pair_ratios"])
            + f"); of the medians {loop['ratio_of_medians']:.3f}, of the best blocks {loop['ratio_of_best']:.3f}",
            f"  ratio, CPU time:   {statistics.median(loop['cpu_pair_ratios']):.3f} ("
            + ", ".join(f"{r:.3f}" for r in loop["cpu_pair_ratios"]) + ")",
            f"  judged on {loop['basis']} time: {loop['ratio']:.3f}, target >= {LOOP_TARGET}: "
            f"{'PASS' if loop['pass'] else 'FAIL'}; "
            f"largest block-loss difference between the loops {loop['max_loss_diff']:.2e}",
        ]
    if sim is not None:
        wall = sim["wall_s"]
        lines += [
            f"simulation: rounds {sim['rounds'][0]}..{sim['rounds'][-1]} after start-up, {wall:.1f} s wall, "
            f"{sim['slots']} client slot(s), whole run {sim['total_s']:.1f} s",
            f"  inner training share {sim['share']:.1%}; target >= {SHARE_TARGET:.0%}: "
            f"{'PASS' if sim['pass'] else 'FAIL'}",
        ]
        for name, seconds in sim["breakdown"].items():
            lines.append(f"  {name:42s} {seconds:8.2f} s  {seconds / wall:6.1%}")
        c = sim["costs"]
        lines.append("  (isolated costs, ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in c.items()) + ")")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench inner [CONFIG] [overrides...] [--steps N] [--repeats N] [--no-sim] ...``."""
    parser = argparse.ArgumentParser(prog="fl-geo bench inner", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"run config (default {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. client.batch_size=32")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=6, help="timed blocks per loop (interleaved)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per loop first")
    parser.add_argument("--device", default="", help="device of the loop comparison (default client.device)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the loop comparison")
    parser.add_argument("--sim-rounds", type=int, default=4, help="rounds of the simulation (>= 2)")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulation share")
    parser.add_argument("--no-loop", action="store_true", help="skip the loop comparison")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the pydoc corpus (a smoke test)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    args = parser.parse_args(argv)
    from fl_geo.errors import ConfigError

    if "=" in args.config and not Path(args.config).exists():  # overrides only: the default config
        args.overrides, args.config = [args.config, *args.overrides], DEFAULT_CONFIG
    try:
        cfg = load_config(args.config, [*(TINY if args.tiny else []), *args.overrides,
                                        f"run.rounds={args.sim_rounds}", "run.progress=false",
                                        "run.tensorboard=false"])
    except (ConfigError, FileNotFoundError) as exc:
        parser.exit(2, f"fl-geo bench inner: {exc}\n")
    try:
        if not args.no_sim:
            slots_of(cfg)
        loop = None if args.no_loop else loop_bench(cfg, steps=args.steps, repeats=args.repeats,
                                                     warmup=args.warmup, device=args.device, threads=args.threads)
        if loop is not None:
            print(format_inner_bench(loop, None), flush=True)
        sim = None if args.no_sim else sim_share(cfg)
    except ValueError as exc:
        parser.exit(2, f"fl-geo bench inner: {exc}\n")
    if sim is not None:
        print(format_inner_bench(None, sim))
    failed = any(r is not None and not r["pass"] for r in (loop, sim))
    return 1 if args.strict and failed else 0
