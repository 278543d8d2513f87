"""The Markdown of a seeded comparison: one row per seed group, and which differences are real.

Each cell is the mean over the group's seeds and the half-width of its 95 % Student-t interval
(`fl_geo.intervals`), ``1.7175 ± 0.0123``; a group of one run shows its value alone (n=1: no
interval), and a figure that only some seeds have shows ``— (k/n seeds)``.

A difference is named only when the two 95 % intervals are disjoint. That rule is conservative
(two disjoint 95 % intervals mean a difference at well under the 5 % level, and overlapping ones
do not prove there is none), which is the point: a table people quote should not crown a method
on noise. Each figure's best group (by mean) is set against every other group; a pair whose
intervals overlap is printed as "A and B: intervals overlap, no winner".
"""

from __future__ import annotations

from fl_geo.compare import UNFINISHED_NOTE, WORKER_LOSS
from fl_geo.seed_groups import Figure, FigureStat, SeedGroup, figure_stat, figures_for

__all__ = ["seeds_table", "verdicts"]

INTERVAL_NOTE = ("mean ± half-width of the 95 % Student-t interval over seeds (t_{0.975, n-1} · s / √n); "
                 "n=1: one run, its value, no interval")


def _cell(stat: FigureStat, spec: str) -> str:
    if stat.interval is None:
        return f"— ({stat.present}/{len(stat.values)} seeds)" if len(stat.values) > 1 else "—"
    iv = stat.interval
    if iv.half_width is None:
        return format(iv.mean, spec)
    return f"{format(iv.mean, spec)} ± {format(iv.half_width, spec)}"


def _budget_cell(group: SeedGroup) -> str:
    """The group's tokens per parameter: one value when its seeds share the budget (the usual
    case), their range when they do not, — when no summary has it."""
    values = [v for v in (r.tokens_per_param for r in group.runs) if v is not None]
    if not values:
        return "—"
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"


def seeds_table(groups: list[SeedGroup], target: float) -> str:
    """One row per group: strategy, whose loss, n, the budget in tokens per parameter, and every
    figure of `figures_for` as mean ± half-width."""
    runs = [r for g in groups for r in g.runs]
    figures = figures_for(runs)
    metric = runs[0].metric if runs else "loss"
    head = ("| run | strategy | loss of | seeds | tokens / param | "
            + " | ".join(f.label(target, metric) for f in figures) + " |")
    lines = [f"Seeds: {INTERVAL_NOTE}. Target {target:.3f}.", "", head, "|" + "---|" * (5 + len(figures))]
    notes = []
    for g in groups:
        first = g.runs[0]
        failed = [r for r in g.runs if r.summary.get("failure")]
        unfinished = [r for r in g.runs if r.unfinished and not r.summary.get("failure")]
        name = (g.name + (f" FAILED ({len(failed)}/{g.n})" if failed else "")
                + (f" UNFINISHED ({len(unfinished)}/{g.n})" if unfinished else ""))
        notes += [f"- {r.name} FAILED: {r.summary['failure']}" for r in failed]
        notes += [f"- {r.name} UNFINISHED: {UNFINISHED_NOTE}" for r in unfinished]
        strategy = first.summary.get("strategy", "?")
        if first.summary.get("outer_optimizer"):
            strategy += f" ({first.summary['outer_optimizer']})"
        of = "workers" if first.loss_key == WORKER_LOSS else "global"
        cells = [_cell(figure_stat(g, f, target), f.spec) for f in figures]
        lines.append(f"| {name} | {strategy} | {of} | n={g.n} | {_budget_cell(g)} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def _compare_pair(figure: Figure, label: str, best: tuple[SeedGroup, FigureStat],
                  other: tuple[SeedGroup, FigureStat]) -> str:
    (bg, bs), (og, os_) = best, other
    assert bs.interval is not None and os_.interval is not None
    figures = f"({_cell(bs, figure.spec)} vs {_cell(os_, figure.spec)})"
    if bs.interval.half_width is None or os_.interval.half_width is None:
        single = bg.name if bs.interval.half_width is None else og.name
        return f"{label}: {bg.name} and {og.name}: n=1 for {single}, no interval, no winner {figures}"
    if bs.interval.overlaps(os_.interval):
        return f"{label}: {bg.name} and {og.name}: intervals overlap, no winner {figures}"
    return f"{label}: {bg.name} {figure.word} than {og.name}, intervals disjoint {figures}"


def verdicts(groups: list[SeedGroup], target: float) -> list[str]:
    """For every figure, its best group against each other group: a winner only where the two
    95 % intervals are disjoint. Empty unless there are two groups and one of them has n > 1."""
    if len(groups) < 2 or all(g.n == 1 for g in groups):
        return []
    runs = [r for g in groups for r in g.runs]
    metric = runs[0].metric
    lines = []
    for figure in figures_for(runs):
        label = figure.label(target, metric)
        stats = [(g, figure_stat(g, figure, target)) for g in groups]
        complete = [(g, s) for g, s in stats if s.interval is not None]
        lines += [f"{label}: {g.name} not compared (only {s.present}/{g.n} seeds have it)"
                  for g, s in stats if s.interval is None and g.n > 1]
        if len(complete) < 2:
            continue
        best = min(complete, key=lambda gs: -figure.better * gs[1].interval.mean)  # type: ignore[union-attr]
        lines += [_compare_pair(figure, label, best, other) for other in complete if other[0] is not best[0]]
    return lines
