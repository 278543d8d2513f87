"""The text report of `fl_geo.bench.outer.run_outer_bench`: the set-up, each path's phases
against Flower's aggregation, peak memory per update count, and every target with its verdict.
"""

from __future__ import annotations

from typing import Any

from fl_geo.bench import outer

GIB, MIB = outer.GIB, outer.MIB

__all__ = ["format_outer_bench"]


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _format_setup(cfg: dict[str, Any], bw: dict[str, Any]) -> list[str]:
    """Lines on what was run (size, precision, threads, machine load) and the copy bandwidth."""
    lines = [
        f"outer step bench: {cfg['num_params']:,} params in {cfg['num_tensors']} tensors "
        f"(Llama-style), {cfg['num_updates']} token-weighted updates, wire {cfg['precision']}, "
        f"{cfg['threads']} torch threads on {cfg['cpus']} CPUs, best of {cfg['repeats']}"
        + ("" if cfg["isolated"] else " (in-process)"),
    ]
    busy = cfg.get("busy_before")
    if busy is not None:
        lines.append(f"CPU busy in the second before the run: {busy:.0%}"
                     + (" -- shared machine under load, timings are pessimistic"
                        if busy > 0.2 else ""))
    lines += [
        "",
        f"memory bandwidth: torch dst.copy_(src), fp32, {bw['copy_bytes'] / 1e9:.2f} GB, best of 5 "
        f"per allocation; {len(bw['copy_gbps_each'])} fresh allocations before/after our "
        f"timings: {', '.join(f'{g:.1f}' for g in bw['copy_gbps_each'])} GB/s copied; "
        "the highest is the reference",
        f"  bytes copied/s          {bw['copy_gbps']:8.2f} GB/s   (size of src / time)",
        f"  bytes read+written/s    {bw['rw_gbps']:8.2f} GB/s   (2 x bytes copied)",
    ]
    return lines


def _format_paths(ours: dict[str, Any], one: dict[str, Any], flower: dict[str, Any] | None,
                  k: int) -> list[str]:
    """The timing table (our two paths and Flower's), its legend and the per-phase split."""
    row = "{:<48}{:>8.3f}s{:>12.3f}s{:>10.2f}{:>14.2f}"
    lines = [
        "",
        f"{'path (one outer step)':<48}{'step':>9}{'aggregation':>13}{'wire GB/s':>10}"
        f"{'fp32-eq GB/s':>14}",
    ]
    for path, res in (("batched", ours), ("one_at_a_time", one)):
        lines.append(row.format(outer._path_label(path, k), res["best_s"], res["aggregation_s"],
                                res["wire_gbps"], res["fp32_gbps"]))
    if flower is not None:
        lines.append(row.format("flower: FedAvg.aggregate_train, fp32 replies", flower["best_s"],
                                flower["best_s"], flower["wire_bytes"] / flower["best_s"] / 1e9,
                                flower["fp32_gbps"]))
    lines += [
        "  ours, step: decode (zero-copy) -> add_batch_checked (NaN/Inf check + norm + "
        "token-weighted fold) -> mean -> Nesterov step;",
        "  aggregation = the same without the Nesterov step; Flower's step is aggregation only "
        "(no check, no norm, no outer step)",
        "  GB/s over the step: wire = payload bytes incl. .npy headers, fp32-eq = 4 B x params x "
        "updates",
    ]
    for path, res in (("batched", ours), ("one_at_a_time", one)):
        lines.append(f"  {path} by phase (best repeat): " + ", ".join(
            f"{name} {v * 1e3:.0f} ms" for name, v in res["phases"].items()))
    lines.append("  sum of the replies, grouped all at once vs one at a time: "
                 + ("bit-identical" if ours["bit_identical"] else "DIFFERENT (bug)"))
    return lines


def _format_memory(memory: dict[int, dict[str, int | None]], ours: dict[str, Any],
                   flower: dict[str, Any] | None, k: int) -> list[str]:
    """The peak-extra-memory table, then the cross-check against Flower's mean when it ran."""
    lines = [
        "",
        "peak extra memory (VmHWM - VmRSS; the replies themselves are excluded):",
        f"  {'':<22}{'first 2 steps (cold)':>22}{'later steps':>14}",
    ]
    for count, v in sorted(memory.items()):
        lines.append(f"  {f'ours, {count} updates':<22}{_fmt_bytes(v['cold']):>22}"
                     f"{_fmt_bytes(v['warm']):>14}")
    if flower is not None:
        label = f"flower, {k} updates"
        lines.append(f"  {label:<22}{_fmt_bytes(flower['cold_extra_bytes']):>22}"
                     f"{_fmt_bytes(flower['warm_extra_bytes']):>14}")
    lines.append(f"  ours, cold, includes the server state (accumulator's two buffers + "
                 f"momentum = {_fmt_bytes(ours['state_bytes'])})")
    if flower is not None:
        lines.append(f"check: max |our token-weighted mean - Flower's| on the same fp32 replies = "
                     f"{flower['max_abs_diff_vs_ours']:.3g}")
    return lines


def _verdict(ok: bool) -> str:
    """PASS or FAIL."""
    return "PASS" if ok else "FAIL"


def _format_targets(checks: dict[str, Any]) -> list[str]:
    """One verdict line per target (throughput, speed-up when Flower ran, memory) with figures."""
    lines: list[str] = []
    t = checks["throughput"]
    lines.append(f"  [{_verdict(t['pass'])}] throughput: fp32-eq GB/s / bytes-copied GB/s = "
                 f"{t['ratio']:.3f} (target >= {t['target']}; vs the lowest copy sample "
                 f"{t['ratio_vs_lowest']:.3f}; one at a time {t['one_at_a_time_ratio']:.3f})")
    if "speedup" in checks:
        s = checks["speedup"]
        lines += [
            f"  [{_verdict(s['pass'])}] speed-up vs Flower FedAvg, strict (our whole step incl. "
            f"Nesterov vs Flower's aggregation): {s['ratio']:.2f}x (target >= "
            f"{s['target']:.0f}x)",
            f"         aggregation vs aggregation (decode + check + weighted mean): "
            f"{s['aggregation_ratio']:.2f}x",
            f"         replies one at a time: strict {s['one_at_a_time_ratio']:.2f}x, "
            f"aggregation vs aggregation {s['one_at_a_time_aggregation_ratio']:.2f}x",
        ]
    m = checks["memory"]
    slopes = ", ".join(f"{kind} {v:+.3f}" for kind, v in m["slopes"].items()) or "n/a"
    lines.append(f"  [{_verdict(m['pass'])}] peak extra memory independent of update count: "
                 f"growth per extra update = {slopes} x one update's wire size "
                 f"(target <= {m['target']})")
    return lines


def format_outer_bench(result: dict[str, Any]) -> str:
    """Human-readable table of a `run_outer_bench` result, with PASS/FAIL per target."""
    cfg, bw, ours = result["config"], result["bandwidth"], result["ours"]
    checks, flower, k = result["checks"], result.get("flower"), cfg["num_updates"]
    lines = _format_setup(cfg, bw)
    lines += _format_paths(ours, result["ours_one_at_a_time"], flower, k)
    lines += _format_memory(result["memory"], ours, flower, k)
    lines += ["", f"targets (judged on the server path with the {k} replies in one group):"]
    lines += _format_targets(checks)
    return "\n".join(lines)
