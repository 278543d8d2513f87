"""The text report of `fl_geo.bench.dispatch.run_dispatch_bench`: both message-cost figures
from one run, the overhead against its target, and where the full path's time goes.
"""

from __future__ import annotations

from typing import Any

from fl_geo.bench.dispatch import NOT_SERVER_WORK, TARGET_MS, Phase

__all__ = ["format_dispatch_bench"]


def format_dispatch_bench(result: dict[str, Any]) -> str:
    """The table: both figures from one run, the overhead with PASS/FAIL, and where it goes."""
    c = result["config"]
    full = result["full"]
    phase: Phase = full["phase"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    checks = result["checks"]

    def figure(name: str, value: str, note: str = "") -> str:
        return f"  {name:<58}{value:>11} ms/update{note}"

    def row(name: str, p: Phase, note: str = "") -> str:
        q50, q90 = p.quantile_ms(0.5), p.quantile_ms(0.9)
        spread = f"{q50:>9.2f}{q90:>9.2f}" if p.samples_s else f"{'-':>9}{'-':>9}"
        return f"  {name:<58}{p.per_update_ms:>11.2f}{spread}{note}"

    lines = [
        f"dispatch overhead bench: {c['strategy']} on the {c['backend']} backend, {c['clients']} no-op node(s), "
        f"{result['num_params']:,} params (wire down {c['wire_down']}, up {c['wire_up']}), {c['updates']} updates, "
        f"{c['server_threads']} server torch thread(s)",
        f"  {'phase (ms)':<58}{'per update':>11}{'median*':>9}{'p90*':>9}",
        row("Flower message cost, before (bare grid, push -> reply)", result["flower_before"]),
        row("Flower message cost, after", result["flower_after"]),
        row(f"dispatcher only (submit/next_event, {c['poll_interval_s'] * 1000:.0f} ms poll)", result["dispatcher"]),
        row(f"full path (run_server + {c['strategy']}, steps 1 -> {c['updates'] - 1})", phase,
            f"   ({phase.n} updates)"),
        "  (* phases 1-2: one round trip, push -> reply pulled; full path: one step interval; "
        "per update = wall time / updates)",
        figure("Flower's own message cost (mean of before and after)", f"{result['flower_ms']:.2f}"),
        figure("full path", f"{phase.per_update_ms:.2f}"),
        figure(f"[{verdict(checks['overhead']['pass'])}] dispatcher + strategy overhead = full - Flower",
               f"{result['overhead_ms']:+.2f}", f" (target < {TARGET_MS:.0f} ms)"),
        figure(f"[{verdict(checks['server_work']['pass'])}] server work on the critical path (timers)",
               f"{result['server_work_ms']:.2f}", f" (target < {TARGET_MS:.0f} ms)"),
    ]
    if c["backend"] == "ray":
        lines.append("  note: Flower's simulation delivers messages on a 0.1 s tick, so server work within the "
                     "tick's slack does not add end to end; the timer figure is the one that cannot hide.")
    lines.append(f"  where the full path's time goes (exclusive, ms/update over {phase.n} updates; "
                 f"calls per update):")
    excl: dict[str, float] = full["exclusive_s"]
    calls: dict[str, int] = full["calls"]
    for label, secs in sorted(excl.items(), key=lambda kv: -kv[1]):
        tag = "" if label in NOT_SERVER_WORK else "*"
        per_call = f"{calls[label] / phase.n:>6.1f}" if label in calls else "      "
        lines.append(f"   {tag:1} {label:<64}{1000.0 * secs / phase.n:>9.3f} {per_call}")
    lines.append("    (* = server work: counted in the timer figure; window "
                 f"{full['timed_window_s']:.3f} s by the timers)")
    return "\n".join(lines)
