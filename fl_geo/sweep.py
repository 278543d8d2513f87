"""``fl-geo sweep``: run the grid of a config's swept keys, then one comparison table and plots.

A sweep override names several values separated by commas, ``strategy.outer_lr=0.3,0.5,0.7``; every
combination of the swept keys is one run (the Cartesian product, in the order given), and the
plain ``key=value`` overrides apply to all of them. Commas inside brackets or quotes belong to one
value (``data.files=[a.txt,b.txt]`` is not swept). Each run is named ``<run.name>-<key>=<value>...``
and written to ``OUT/runs/<name>``; the table and plots of `fl_geo.compare` go to ``OUT``. The grid
is resolved and validated before the first run starts, so a typo in the last value costs nothing.
``--seeds N`` runs every point N times (``<name>-seed=<seed>``) and tabulates each point's mean and
95 % Student-t interval (`fl_geo.seed_groups`).
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.config import FlGeoConfig, load_config
from fl_geo.errors import ConfigError

__all__ = ["SweepPoint", "expand_grid", "split_values", "sweep_points"]

MAX_RUNS = 256  # a grid larger than this is almost certainly a typo (e.g. a comma list of seeds x lrs x ...)


def split_values(value: str) -> list[str]:
    """``value`` split at the commas that are not inside brackets, braces or quotes."""
    parts, depth, quote, current = [], 0, "", []
    for ch in value:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Every combination of the swept overrides, each with the fixed ones first.

    ``["a=1,2", "b=x", "c=3,4"]`` gives ``[["b=x", "a=1", "c=3"], ["b=x", "a=1", "c=4"], ...]``.
    A swept key with an empty value (``a=1,``) or given twice is a `ConfigError`.
    """
    fixed: list[str] = []
    swept: list[tuple[str, list[str]]] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not of the form key=value or key=a,b,c")
        values = split_values(value)
        if len(values) == 1:
            fixed.append(item)
            continue
        key = key.strip()
        if any(not v.strip() for v in values):
            raise ConfigError(f"sweep '{item}': an empty value between commas")
        if key in {k for k, _ in swept}:
            raise ConfigError(f"sweep: '{key}' is swept twice; give all its values in one key=a,b,c")
        swept.append((key, [v.strip() for v in values]))
    if not swept:
        raise ConfigError("fl-geo sweep needs at least one swept key, e.g. strategy.outer_lr=0.3,0.5,0.7")
    grid = [
        fixed + [f"{key}={value}" for (key, _), value in zip(swept, combo, strict=True)]
        for combo in itertools.product(*(values for _, values in swept))
    ]
    if len(grid) > MAX_RUNS:
        raise ConfigError(f"sweep: {len(grid)} runs is more than {MAX_RUNS}; split the grid")
    return grid


def _label(item: str) -> str:
    """``strategy.outer_lr=0.5`` -> ``outer_lr=0.5``, safe as a directory name."""
    key, _, value = item.partition("=")
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f"{key.rsplit('.', 1)[-1]}={value}")


@dataclass
class SweepPoint:
    """One run of the grid: its resolved config and the overrides that made it."""

    cfg: FlGeoConfig
    swept: list[str]


def sweep_points(config: str | None, overrides: list[str]) -> list[SweepPoint]:
    """The resolved, validated config of every run of the grid, named after its swept values."""
    fixed_count = sum(1 for o in overrides if len(split_values(o.partition("=")[2])) == 1)
    points = []
    for items in expand_grid(overrides):
        swept = items[fixed_count:]
        cfg = load_config(config, items)
        cfg.run.name = "-".join([cfg.run.name, *(_label(s) for s in swept)])
        points.append(SweepPoint(cfg, swept))
    names = [p.cfg.run.name for p in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"sweep: two runs would share a name ({names}); the swept values must differ")
    return points


def run_sweep(config: str | None, overrides: list[str], out: str | Path, target: float | None = None,
              loss: str = "global", seeds: int = 1, resume: bool = False, jobs: int = 1) -> dict[str, Any]:
    """Run every point of the grid one after another (``seeds`` runs each, `fl_geo.seed_groups`),
    then compare them all (table + plots; with seeds > 1, one row per point: mean ± 95 % t interval).

    Returns `fl_geo.compare.compare`'s result plus ``summaries``, one per run, in grid order
    (each point's seeds together). ``run.seed`` cannot be both swept and given ``seeds`` > 1:
    the two would run the same seeds twice under different names. ``resume``: `fl_geo.run_reuse`
    (finished runs reused, interrupted ones continued; every folder checked before the first run).
    ``jobs``: that many runs at a time, each its own process (`fl_geo.run_pool`).
    """
    from fl_geo.compare import compare
    from fl_geo.run_pool import run_in_parallel
    from fl_geo.run_reuse import check_resumable
    from fl_geo.seed_groups import run_seeds, seeded_configs

    if seeds != 1 and any(o.partition("=")[0].strip() == "run.seed" and len(split_values(o.partition("=")[2])) > 1
                          for o in overrides):
        raise ConfigError("sweep: run.seed is swept and --seeds is given; use one of them")
    points = sweep_points(config, overrides)
    plans = [(point, seeded_configs(point.cfg, seeds)) for point in points]
    out = Path(out)
    planned = [c for _, cfgs in plans for c in cfgs]
    if resume:
        check_resumable(planned, out / "runs")
    parallel = jobs > 1 and len(planned) > 1
    if parallel:
        run_in_parallel(planned, out / "runs", jobs, resume)
    summaries, runs, groups = [], [], []
    for i, (point, cfgs) in enumerate(plans, start=1):
        if not parallel:
            print(f"sweep {i}/{len(points)}: {point.cfg.run.name} ({' '.join(point.swept)})", file=sys.stderr, flush=True)
        group, point_summaries = run_seeds(cfgs, out / "runs", point.cfg.run.name, loss, resume=resume, ran=parallel)
        summaries += point_summaries
        runs += group.runs
        groups.append(group)
    result = compare(runs, out, target, groups)
    return {**result, "summaries": summaries}
