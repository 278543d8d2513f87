"""``fl-geo bench compress``: bytes, encode/decode time and error of every compression codec.

Each codec of `fl_geo.core.compress` (a default list, with and without error feedback where it
applies) encodes and decodes the same sequence of synthetic pseudo-gradients, and fp32, the
baseline of every ratio, runs in the same loop. The sequence (seeded) stands in for the outer
updates of one site:

    Δ_t = s ⊙ (d_t + 0.5 ε_t),   d_t = 0.9 d_{t−1} + √(1 − 0.9²) ξ_t,

a slowly drifting random direction d_t (consecutive Δ_t correlate ~0.7) plus fresh noise, with
one log-normal scale s (σ = 1) per 256 elements for the spread of magnitudes across a model's
tensors; ξ_t, ε_t are iid N(0, 1). It has no smoothness along the vector, so the DCT codec's
coefficients are as white as the entries: the bench measures its cost, not its gain on real
gradients.

Per codec: payload bytes per step (checked against `payload_nbytes`), the median encode and decode
time (CPU; CUDA as well when available), the relative error ||Δ_t − Δ̂_t|| / ||Δ_t|| of each step,
and the error of the running sum ||Σ Δ_t − Σ Δ̂_t|| / ||Σ Δ_t||: what error feedback is for (with
EF the sums differ by the last residual only; without it a biased codec's errors add up).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from fl_geo.core.compress import Compressor, CompressSettings, payload_nbytes

__all__ = ["default_variants", "format_compress_bench", "main", "pseudo_gradients", "run_compress_bench",
           "run_variant"]

DEFAULT_PARAMS = 2_000_000
DEFAULT_STEPS = 10
RHO, NOISE, SCALE_BLOCK = 0.9, 0.5, 256


def default_variants(ratio: float = 0.01) -> list[CompressSettings]:
    """fp32 (the baseline), bf16, the int codes and sign, top-k and DCT top-k with fp32 and int2 values;
    every lossy one without and with error feedback."""
    lossy = [CompressSettings(codec=c) for c in ("bf16", "int8", "int4", "int2", "sign")]
    lossy += [CompressSettings(codec=c, ratio=ratio, values=v) for c in ("topk", "dct_topk") for v in ("fp32", "int2")]
    out = [CompressSettings(codec="fp32", error_feedback=False)]
    for s in lossy:
        out += [replace(s, error_feedback=False), replace(s, error_feedback=True)]
    return out


def pseudo_gradients(numel: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """The seeded sequence of the module docstring: ``steps`` fp32 vectors of ``numel``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.randn(math.ceil(numel / SCALE_BLOCK), generator=g).exp()
    scale = scale.repeat_interleave(SCALE_BLOCK)[:numel]
    d = torch.randn(numel, generator=g)
    out = []
    for _ in range(steps):
        d = RHO * d + math.sqrt(1 - RHO**2) * torch.randn(numel, generator=g)
        out.append(scale * (d + NOISE * torch.randn(numel, generator=g)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a))


def run_variant(settings: CompressSettings, deltas: Sequence[torch.Tensor], device: str = "cpu") -> dict[str, Any]:
    """Compress and decompress ``deltas`` in order on ``device`` (carrying the residual under EF);
    bytes, per-step times (s) and errors."""
    dev = torch.device(device)
    comp = Compressor(settings)
    numel = deltas[0].numel()
    residual = None
    sum_true = torch.zeros(numel, device=dev)  # fp32: fp32's own sums then agree bit for bit
    sum_sent = torch.zeros_like(sum_true)
    enc, dec, rel, cum, sizes = [], [], [], [], set()
    for delta in deltas:
        d = delta.to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        payload, residual = comp.compress(d, residual)
        _sync(dev)
        t1 = time.perf_counter()
        hat = comp.decompress(payload, numel=numel, device=dev)
        _sync(dev)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        sizes.add(payload.nbytes)
        sum_true += d
        sum_sent += hat
        rel.append(_rel(d, hat))
        cum.append(_rel(sum_true, sum_sent))
    if sizes != {payload_nbytes(settings, numel)}:
        raise AssertionError(f"{settings.describe()}: payload bytes {sorted(sizes)} differ from the formula")
    return {"bytes": sizes.pop(), "encode_s": enc, "decode_s": dec, "rel_err": rel, "sum_err": cum}


def _row(settings: CompressSettings, numel: int, cpu: dict[str, Any], cuda: dict[str, Any] | None) -> dict[str, Any]:
    row = {"label": settings.describe(), "codec": settings.codec, "error_feedback": settings.error_feedback,
           "bytes": cpu["bytes"], "ratio": 4 * numel / cpu["bytes"],
           "encode_ms": 1e3 * statistics.median(cpu["encode_s"]), "decode_ms": 1e3 * statistics.median(cpu["decode_s"]),
           "rel_err": cpu["rel_err"], "sum_err": cpu["sum_err"]}
    if settings.sparse:
        row |= {"chunk": settings.chunk_size, "k": settings.k_per_chunk, "values": settings.values}
    if cuda is not None:
        row["cuda"] = {"encode_ms": 1e3 * statistics.median(cuda["encode_s"]),
                       "decode_ms": 1e3 * statistics.median(cuda["decode_s"])}
    return row


def run_compress_bench(numel: int = DEFAULT_PARAMS, steps: int = DEFAULT_STEPS, seed: int = 0,
                       ratio: float = 0.01, cuda: bool | None = None) -> dict[str, Any]:
    """Every default variant on one sequence; CUDA timings too when ``cuda`` (default: when
    available). Returns the config and one row per variant."""
    if numel < 1 or steps < 1:
        raise ValueError(f"need --params >= 1 and --steps >= 1, got {numel}, {steps}")
    use_cuda = torch.cuda.is_available() if cuda is None else cuda
    deltas = pseudo_gradients(numel, steps, seed)
    rows = []
    for settings in default_variants(ratio):
        cpu = run_variant(settings, deltas, "cpu")
        gpu = run_variant(settings, deltas, "cuda") if use_cuda else None
        rows.append(_row(settings, numel, cpu, gpu))
    config = {"params": numel, "steps": steps, "seed": seed, "ratio": ratio, "threads": torch.get_num_threads(),
              "cuda": torch.cuda.get_device_name() if use_cuda else None,
              "sequence": f"d_t = {RHO} d_(t-1) + sqrt(1-{RHO}^2) xi_t; delta_t = s * (d_t + {NOISE} eps_t); "
                          f"s log-normal per {SCALE_BLOCK} elements"}
    return {"config": config, "variants": rows}


def format_compress_bench(result: dict[str, Any]) -> str:
    """The table: one line per codec, ending with its ratio to fp32's bytes."""
    c = result["config"]
    cuda = c["cuda"] is not None
    lines = [
        f"compress: {c['params']:,} parameters, {c['steps']} synthetic pseudo-gradients (seed {c['seed']}: "
        f"{c['sequence']}), cpu {c['threads']} thread(s)" + (f", cuda {c['cuda']}" if cuda else ""),
        "  rel.err = ||D_t - D^_t|| / ||D_t|| (mean over steps, last step); sum err = ||sum D - sum D^|| / "
        "||sum D|| after the last step; times are medians over the steps",
        f"  {'codec':26s} {'bytes/step':>11s} {'enc ms':>8s} {'dec ms':>8s}"
        + (f" {'cuda enc':>8s} {'cuda dec':>8s}" if cuda else "")
        + f" {'rel.err':>7s} {'last':>7s} {'sum err':>7s}",
    ]
    for r in result["variants"]:
        gpu = f" {r['cuda']['encode_ms']:8.2f} {r['cuda']['decode_ms']:8.2f}" if cuda else ""
        lines.append(
            f"  {r['label']:26s} {r['bytes']:11,d} {r['encode_ms']:8.1f} {r['decode_ms']:8.1f}{gpu}"
            f" {statistics.fmean(r['rel_err']):7.4f} {r['rel_err'][-1]:7.4f} {r['sum_err'][-1]:7.4f}"
            f"  {r['ratio']:.1f}x fewer bytes than fp32")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench compress [--params N] [--steps N] [--seed N] [--ratio F] [--threads N] [--cpu-only] [--json]``."""
    parser = argparse.ArgumentParser(prog="fl-geo bench compress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS, help="elements of each pseudo-gradient")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="outer steps (pseudo-gradients)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic sequence")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction of each chunk the top-k codecs keep")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--cpu-only", action="store_true", help="skip the CUDA timings")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run_compress_bench(args.params, args.steps, args.seed, args.ratio,
                                    cuda=False if args.cpu_only else None)
    except ValueError as exc:
        parser.exit(2, f"fl-geo bench compress: {exc}\n")
    print(json.dumps(result, indent=2) if args.json else format_compress_bench(result))
    return 0
