"""``fl-geo bench gpu``: the accelerator check (``make gpu-check`` runs it after ``pytest -m gpu``).

A Pythia-70M-shaped model (d_model 512, 6 layers, 8 heads, vocabulary 50,304): the Hugging Face
``pythia-70m`` preset (GPT-NeoX, 70.4 M parameters, random init, fl_geo/inner/hf.py) when
``transformers`` is installed, else (or with ``--builtin``) fl-geo's decoder in that shape (SwiGLU
width 1,365 to match GPT-NeoX's 4·d GELU MLP in parameters, tied embeddings: 44.6 M); any
``model.*`` override replaces it. It trains as four simulated
datacenters that share one GPU (``run.backend=inline``: the clients take turns on the device),
DiLoCo and then Di-PS at the same token budget on the virtual clock of the η = 100 scenario
(configs/bench/eta_*.yaml). Printed per method: the inner loop's tokens/s (the clients' own
step timers), end-to-end tokens/s (tokens over the run's wall time, evaluation and server
included), model FLOPs utilisation 6·N·tokens/s over the device's peak dense bf16 FLOP/s (table
below, ``--peak-tflops`` overrides; the 6·N rule ignores attention's sequence term), the outer
step's time on the server path (decode four bf16 replies, checked fold, Nesterov; CPU, as in a
run), final validation loss and virtual time.

The budget (``--minutes``, 10 by default) is split between the two runs after a calibration of the
step time: rounds = budget / (4 · H · step time · OVERHEAD), at least 2 (approximate until measured on a GPU). ``--device cpu --tiny`` runs the same
code path with a tiny model in seconds (tests/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fl_geo.config import FlGeoConfig, load_config

__all__ = ["PEAK_BF16_TFLOPS", "format_gpu_bench", "main", "mfu", "peak_tflops", "plan_rounds", "run_gpu_bench"]

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' data sheets. Matched in
# order against torch.cuda.get_device_name(): the first key contained in the name wins.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM
    "A100": 312.0,
}
METHODS = {"diloco": "configs/bench/eta_diloco.yaml", "dips": "configs/bench/eta_dips.yaml"}
# The Hugging Face preset (GPT-NeoX, untied head: 70.4 M parameters, fl_geo/inner/hf.py) when
# transformers is installed; otherwise, or with --builtin, fl-geo's decoder in the same shape.
PYTHIA_70M_HF = ["model.kind=hf", "model.preset=pythia-70m", "model.vocab_size=50304"]
PYTHIA_70M = ["model.vocab_size=50304", "model.d_model=512", "model.n_layers=6", "model.n_heads=8",
              "model.d_ff=1365"]
TINY_HF = ["model.kind=hf", "model.preset=pythia-tiny", "model.vocab_size=256"]
TINY = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=0"]
TINY_RUN = ["model.max_seq_len=32", "data.corpus=pydoc", "run.eval_batches=2"]


def model_overrides(tiny: bool, builtin: bool) -> list[str]:
    """The model of the bench: the HF Pythia preset (tiny: pythia-tiny) if transformers is
    installed and ``builtin`` is false, else the built-in decoder of that shape."""
    from fl_geo.inner.hf import transformers_available

    hf = not builtin and transformers_available()
    if tiny:
        return [*(TINY_HF if hf else TINY), *TINY_RUN]
    return PYTHIA_70M_HF if hf else PYTHIA_70M
# Server work, the clients' optimizer state in and out of the message (AdamW moments to CPU every
# round) and evaluation on top of the inner loops when planning rounds: a guess until measured on a
# GPU, so the ten minutes are approximate.
OVERHEAD = 1.5


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of ``device_name`` (``override`` wins); None if unknown."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {override}")
        return float(override)
    for key, peak in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return peak
    return None


def mfu(num_params: int, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: 6·N·tokens/s over the peak (TFLOP/s); None without a peak."""
    if peak is None:
        return None
    return 6.0 * num_params * tokens_per_s / (peak * 1e12)


def plan_rounds(budget_s: float, clients: int, inner_steps: int, step_s: float, minimum: int = 2) -> int:
    """Synchronous rounds that fit ``budget_s`` at ``step_s`` per inner step, every client in turn
    on one device, with `OVERHEAD` for the rest of the round; at least ``minimum``."""
    if step_s <= 0 or budget_s <= 0:
        raise ValueError(f"need budget_s > 0 and step_s > 0, got {budget_s}, {step_s}")
    return max(minimum, int(budget_s / (clients * inner_steps * step_s * OVERHEAD)))


def _configs(method: str, overrides: Sequence[str]) -> FlGeoConfig:
    return load_config(METHODS[method], list(overrides))


def calibrate(cfg: FlGeoConfig, steps: int = 5, warmup: int = 2) -> float:
    """Seconds per inner step of ``cfg``'s model, batch and device (`InnerTrainer`, real data)."""
    from fl_geo.bench.inner import _setup
    from fl_geo.inner.training import InnerTrainer

    sampler, build, icfg = _setup(cfg, cfg.client.device)
    if torch.device(cfg.client.device).type == "cpu":
        torch.set_num_threads(cfg.run.threads_per_client)  # as the clients will (2 threads under load: 10-100x slower)
    trainer = InnerTrainer(build(), icfg)
    trainer.train(sampler, warmup, 0)
    result = trainer.train(sampler, steps, warmup)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result.step_time_s


def outer_step_s(num_params_flat: int, clients: int, precision: str, repeats: int = 3) -> float:
    """Median seconds of one synchronous outer step of ``clients`` replies on the server path."""
    from fl_geo.core.accumulate import WeightedAccumulator, weight_for
    from fl_geo.core.outer import Nesterov
    from fl_geo.core.state import ParamSpec
    from fl_geo.runtime.wire import decode, encode

    spec = ParamSpec.from_state_dict({"w": torch.empty(num_params_flat)})
    flat = torch.randn(num_params_flat) * 0.01
    replies = [encode(flat * (1 + i / 10), spec, precision) for i in range(clients)]
    acc = WeightedAccumulator(spec.numel)
    opt = Nesterov(spec.numel, lr=0.7, momentum=0.9)
    params = torch.zeros(num_params_flat)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        acc.reset()
        acc.add_batch_checked([decode(r, spec, precision) for r in replies], [weight_for("tokens", 1000)] * clients)
        opt.step(params, acc.mean())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _train_rate(records: list[dict[str, Any]], tokens_per_step: int) -> float:
    """Inner-loop tokens/s: tokens per step over the clients' mean step time, first step left out
    (it carries the first allocations and kernel selection)."""
    times = [float(r["train/step_time_s"]) for r in records if r.get("train/step_time_s")]
    times = times[1:] or times
    if not times:
        raise ValueError("the run reported no step times")
    return tokens_per_step / statistics.median(times)


def run_method(method: str, overrides: Sequence[str], out_dir: Path) -> dict[str, Any]:
    """One `fl-geo run` of ``method``; its summary and metrics."""
    from fl_geo.simulation import run_simulation

    cfg = _configs(method, overrides)
    run_dir = out_dir / method
    summary = run_simulation(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"cfg": cfg, "summary": summary, "records": records}


def run_gpu_bench(*, minutes: float = 10.0, device: str = "cuda", tiny: bool = False, inner_steps: int = 50,
                  batch_size: int = 32, seq_len: int = 512, peak: float | None = None, builtin: bool = False,
                  overrides: Sequence[str] = (), out_dir: str | Path | None = None) -> dict[str, Any]:
    """DiLoCo then Di-PS on the same token budget; the figures `format_gpu_bench` prints."""
    if tiny:
        inner_steps, batch_size, seq_len = min(inner_steps, 3), min(batch_size, 4), min(seq_len, 32)
    shape = model_overrides(tiny, builtin)
    if not tiny:
        shape = [*shape, f"model.max_seq_len={seq_len}"]
    base = [*shape, f"client.device={device}", "client.precision=auto", f"client.batch_size={batch_size}",
            f"client.seq_len={seq_len}", f"strategy.inner_steps={inner_steps}", "client.warmup_steps=10",
            "run.progress=false", "run.tensorboard=false", "run.eval_every=0", "run.eval_batches=4", "run.sim_cpus=1",
            *overrides]
    probe = _configs("diloco", base)
    started = time.perf_counter()
    step_s = calibrate(probe)
    clients = probe.run.num_clients
    budget = max(1.0, minutes * 60.0 - (time.perf_counter() - started)) / len(METHODS)
    rounds = plan_rounds(budget, clients, inner_steps, step_s)
    if tiny:
        rounds = 2
    tokens_per_step = batch_size * seq_len
    max_tokens = clients * inner_steps * rounds * tokens_per_step
    budget_overrides = [f"run.max_tokens={max_tokens}"]
    name = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else device
    peak_tf = peak_tflops(name, peak)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flgeo-bench-gpu-") as tmp:
        root = Path(out_dir or tmp)
        for method in METHODS:
            rounds_cfg = [f"run.rounds={rounds}"] if method == "diloco" else []
            run = run_method(method, [*base, *rounds_cfg, *budget_overrides], root)
            summary, records = run["summary"], run["records"]
            n = int(summary["num_params"])
            train_rate = _train_rate(records, tokens_per_step)
            e2e_rate = float(summary["tokens"]) / float(summary["wall_s"])
            results[method] = {
                "num_params": n, "tokens": int(summary["tokens"]), "wall_s": float(summary["wall_s"]),
                "virtual_s": summary.get("virtual_s"), "outer_steps": summary["outer_steps"],
                "final_val_loss": summary["final_val_loss"], "train_tokens_per_s": train_rate,
                "e2e_tokens_per_s": e2e_rate, "mfu_train": mfu(n, train_rate, peak_tf),
                "mfu_e2e": mfu(n, e2e_rate, peak_tf), "wire_up": run["cfg"].wire.up,
            }
    num_params = results["diloco"]["num_params"]
    return {
        "device": name, "peak_tflops": peak_tf, "model": f"{probe.model.kind} {probe.model.preset}".strip(), "step_s": step_s, "rounds": rounds, "inner_steps": inner_steps,
        "batch": batch_size, "seq_len": seq_len, "clients": clients, "max_tokens": max_tokens,
        "methods": results, "outer_step_s": outer_step_s(num_params, clients, results["diloco"]["wire_up"]),
        "elapsed_s": time.perf_counter() - started,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def format_gpu_bench(r: dict[str, Any]) -> str:
    peak = "unknown" if r["peak_tflops"] is None else f"{r['peak_tflops']:.0f} TFLOP/s bf16"
    lines = [
        f"device {r['device']} (peak {peak}); model {r['model']}; {r['clients']} datacenters on it, batch {r['batch']} x "
        f"{r['seq_len']}, H = {r['inner_steps']}, {r['max_tokens']:,} tokens per method "
        f"(calibrated {r['step_s'] * 1e3:.1f} ms/step -> {r['rounds']} DiLoCo rounds)",
    ]
    for method, m in r["methods"].items():
        vs = m["virtual_s"]
        lines.append(
            f"  {method:7s} N={m['num_params']:,}: inner loop {m['train_tokens_per_s']:,.0f} tokens/s "
            f"(MFU {_pct(m['mfu_train'])}), end to end {m['e2e_tokens_per_s']:,.0f} tokens/s "
            f"(MFU {_pct(m['mfu_e2e'])}), {m['outer_steps']} outer steps, val loss "
            f"{m['final_val_loss'] if m['final_val_loss'] is None else round(m['final_val_loss'], 4)}, "
            f"virtual {'n/a' if vs is None else f'{vs:,.0f}'} s, wall {m['wall_s']:.1f} s")
    if r["peak_tflops"] is None:
        lines.append("  MFU n/a: no peak known for this device; give --peak-tflops")
    lines.append(f"  outer step (server path, {r['clients']} {r['methods']['diloco']['wire_up']} replies, CPU): "
                 f"{r['outer_step_s'] * 1e3:.1f} ms; whole bench {r['elapsed_s']:.0f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench gpu [overrides...] [--minutes M] [--device D] [--tiny] [--peak-tflops P]``."""
    parser = argparse.ArgumentParser(prog="fl-geo bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="dotted config overrides (e.g. model.* to change the model)")
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget of both runs together")
    parser.add_argument("--device", default="cuda", help="device of the clients (cuda, cuda:N, cpu)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, 2 rounds: checks the code path")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak dense bf16 TFLOP/s (default: table by device name)")
    parser.add_argument("--builtin", action="store_true",
                        help="fl-geo's decoder in Pythia-70M's shape instead of the Hugging Face preset")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    from fl_geo.errors import ConfigError

    kind = torch.device(args.device).type
    if kind == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "fl-geo bench gpu: no CUDA device here (use --device cpu --tiny to check the code path)\n")
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        parser.exit(2, f"fl-geo bench gpu: --minutes must be > 0, got {args.minutes}\n")
    try:
        peak_tflops("", args.peak_tflops)
        result = run_gpu_bench(minutes=args.minutes, device=args.device, tiny=args.tiny,
                               inner_steps=args.inner_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                               peak=args.peak_tflops, builtin=args.builtin, overrides=args.overrides,
                               out_dir=args.out)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"fl-geo bench gpu: {exc}\n")
    print(format_gpu_bench(result))
    return 0
