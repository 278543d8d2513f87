#!/usr/bin/env python
"""Table and plot of the scale ladder (docs/benchmarks.md, "Scale ladder").

    .venv/bin/python examples/scale_ladder_report.py runs/ladder_S runs/ladder_M runs/ladder_L \
        [--plot docs/img/scale_ladder.png]

Each argument is one size's `fl-geo compare --out` directory (its runs under ``runs/``:
ladder-diloco, ladder-fedavg, ladder-dips) and, when present, the ``cocodc_compensation.txt`` that
examples/cocodc_compensation_magnitude.py printed for that size. Prints two Markdown tables:

1. per size and method: parameters, final val loss and bits per byte at the equal token budget,
   the virtual time and tokens to DiLoCo's final val loss (first evaluation at or below it, as
   `fl-geo compare` reads time-to-target), virtual time of the last outer step (the budget
   spent), and wall time;
2. per size: how often and how hard Di-PS's clip φ binds (``outer/clip_scale``: the factor the
   averaged update was multiplied by, 1 = not binding; ``outer/clip_norm``: its norm before the
   clip), over the first and the last quarter of the run, and CoCoDC's compensation term relative
   to the local progress it corrects.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from fl_geo.runtime.metrics import read_metrics

METHODS = (("ladder-diloco", "DiLoCo"), ("ladder-fedavg", "FedAvg"), ("ladder-dips", "Di-PS"))


def load(size_dir: Path) -> dict[str, dict[str, Any]]:
    """The finished runs of one size: summary and metric rows per run name (missing runs left out)."""
    out = {}
    for name, _ in METHODS:
        run = size_dir / "runs" / name
        if (run / "summary.json").is_file():
            out[name] = {"summary": json.loads((run / "summary.json").read_text()), "rows": read_metrics(run)}
    return out


def first_at_or_below(rows: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    for r in rows:
        v = r.get("val/loss")
        if v is not None and math.isfinite(v) and v <= target + 1e-12:
            return r
    return None


def clip_stats(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Share of steps where φ bound, mean factor, and the pre-clip norm's median, for the whole
    run and its first and last quarter of outer steps."""
    steps = [r for r in rows if r.get("outer/clip_scale") is not None]
    if not steps:
        return {}
    q = max(1, len(steps) // 4)

    def part(rs: list[dict[str, Any]]) -> tuple[float, float, float]:
        scales = [r["outer/clip_scale"] for r in rs]
        return (sum(s < 1 for s in scales) / len(scales), statistics.fmean(scales),
                statistics.median(r["outer/clip_norm"] for r in rs))

    return dict(zip(("all", "early", "late"), (part(steps), part(steps[:q]), part(steps[-q:])), strict=True))


def compensation(size_dir: Path) -> tuple[float, float] | None:
    """(fp32 merge ratio, float64 formula ratio) from cocodc_compensation.txt, or None."""
    f = size_dir / "cocodc_compensation.txt"
    if not f.is_file():
        return None
    ratios = re.findall(r"ratio ([0-9.e+-]+)", f.read_text())
    return (float(ratios[0]), float(ratios[1])) if len(ratios) >= 2 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    data = {d: load(d) for d in args.sizes}

    print("| size | parameters | method | final val loss | final val bpb | virtual s to DiLoCo's final | "
          "tokens to it | virtual s at the last outer step | wall s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for d, runs in data.items():
        target = runs["ladder-diloco"]["summary"]["final_val_loss"] if "ladder-diloco" in runs else None
        for name, label in METHODS:
            if name not in runs:
                print(f"| {d.name} | | {label} | not run | | | | | |")
                continue
            s, rows = runs[name]["summary"], runs[name]["rows"]
            hit = first_at_or_below(rows, target) if target is not None else None
            to_t = f"{hit['time/virtual_s']:.1f}" if hit else "not reached"
            tok_t = f"{int(hit['train/tokens']):,}" if hit else "—"
            end = max(r["time/virtual_s"] for r in rows if r.get("time/virtual_s") is not None)
            print(f"| {d.name} | {s['num_params']:,} | {label} | {s['final_val_loss']:.4f} | {s['final_val_bpb']:.4f} | "
                  f"{to_t} | {tok_t} | {end:.1f} | {s['wall_s']:.0f} |")

    print()
    print("| size | Di-PS steps | φ binds (all / first ¼ / last ¼) | mean clip factor (all / first ¼ / last ¼) | "
          "median ‖Δ̄‖ before the clip (first ¼ / last ¼) | DiLoCo's ‖Δ̄‖ (first / last round) | "
          "CoCoDC correction / local progress (fp32 merge; float64) |")
    print("|---|---:|---|---|---|---|---|")
    for d, runs in data.items():
        c = clip_stats(runs["ladder-dips"]["rows"]) if "ladder-dips" in runs else {}
        comp = compensation(d)
        comp_s = f"{comp[0]:.1e}; {comp[1]:.1e}" if comp else "not run"
        pg = [r["outer/pseudo_grad_norm"] for r in runs.get("ladder-diloco", {}).get("rows", [])
              if r.get("outer/pseudo_grad_norm") is not None]
        pg_s = f"{pg[0]:.2f} / {pg[-1]:.2f}" if pg else "—"
        if not c:
            print(f"| {d.name} | | | | | {pg_s} | {comp_s} |")
            continue
        n = runs["ladder-dips"]["summary"]["outer_steps"]
        print(f"| {d.name} | {n} | {c['all'][0]:.0%} / {c['early'][0]:.0%} / {c['late'][0]:.0%} | "
              f"{c['all'][1]:.2f} / {c['early'][1]:.2f} / {c['late'][1]:.2f} | "
              f"{c['early'][2]:.2f} / {c['late'][2]:.2f} | {pg_s} | {comp_s} |")

    if args.plot:
        plot(data, args.plot)
        print(f"\nplot: {args.plot}")


def plot(data: dict[Path, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ladder-diloco": "C0", "ladder-fedavg": "C1", "ladder-dips": "C2"}
    n = len(data)
    fig, axes = plt.subplots(2, max(n, 3), figsize=(4.2 * max(n, 3), 7.2), squeeze=False)
    for i, (d, runs) in enumerate(data.items()):
        ax = axes[0][i]
        for name, label in METHODS:
            if name not in runs:
                continue
            pts = [(r["time/virtual_s"], r["val/bpb"]) for r in runs[name]["rows"] if r.get("val/bpb") is not None]
            ax.plot(*zip(*pts, strict=True), color=colors[name], label=label, marker=".", ms=3)
        params = next(iter(runs.values()))["summary"]["num_params"] if runs else 0
        ax.set_title(f"{d.name}: {params / 1e6:.2f} M parameters")
        ax.set_xlabel("virtual time (s)")
        ax.set_ylabel("val bits per byte")
        ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
        ax.legend()
    ax = axes[1][0]
    for name, label in METHODS:
        pts = [(r[name]["summary"]["num_params"], r[name]["summary"]["final_val_bpb"]) for r in data.values() if name in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=colors[name], label=label, marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final val bits per byte (equal tokens)")
    ax.legend()
    for j, (key, ylabel) in enumerate((("outer/clip_scale", "Di-PS clip factor (1 = φ not binding)"),
                                       ("outer/clip_norm", "Di-PS ‖Δ̄‖ before the clip")), start=1):
        ax = axes[1][j]
        for i, (d, runs) in enumerate(data.items()):
            if "ladder-dips" not in runs:
                continue
            pts = [(r["train/tokens"], r[key]) for r in runs["ladder-dips"]["rows"] if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=f"C{i + 3}", label=d.name.replace("ladder_", ""), marker=".", ms=3)
        if key == "outer/clip_norm":
            ax.axhline(1.0, color="grey", ls="--", lw=1, label="φ = 1")
            ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.legend()
    for k in range(n, axes.shape[1]):
        axes[0][k].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
