"""Seeds as an axis of a comparison: one config run N times, its runs read as one group.

``fl-geo compare --seeds N`` (and ``fl-geo sweep --seeds N``) runs every config with ``run.seed``
= base, base + 1, ..., base + N - 1, where base is the config's own ``run.seed`` (after the
overrides). ``run.seed`` draws the model's initial weights and every site's batch order; the data
split (``data.seed``) and the scenario stay fixed, so the spread across seeds is the run-to-run
noise of one method on one problem, which is what a difference between methods must exceed.

With N > 1 each run is named ``<run.name>-seed=<seed>``; finished runs read with ``--runs`` whose
names differ only in that suffix form one group again, so a seeded comparison can be re-tabulated
without re-running it. With N = 1 names and output are what they were before seeds existed.

The figures aggregated per group are the ones `fl_geo.compare` reports per run (`FIGURES`): final
validation loss (or bits per byte), final bits per byte where the runs logged it, virtual and wall
seconds to the target, and goodput. A figure some seed lacks (never reached the target, a
wall-clock run without goodput) gets no mean: averaging only the seeds that reached a target
would flatter the method.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_geo.compare import BPB, LOSS, VIRTUAL, WALL, RunRecord, load_run
from fl_geo.errors import ConfigError
from fl_geo.intervals import Interval, t_interval
from fl_geo.yaml_safe import load_yaml

if TYPE_CHECKING:
    from fl_geo.config import FlGeoConfig

__all__ = ["FIGURES", "Figure", "FigureStat", "SeedGroup", "figure_stat", "figures_for", "group_by_seed_suffix",
           "group_summary", "mean_band", "run_seed", "run_seeds", "seeded_configs"]

SEED_SUFFIX = re.compile(r"-seed=(-?\d+)$")


def seeded_configs(cfg: FlGeoConfig, seeds: int) -> list[FlGeoConfig]:
    """``cfg`` once per seed: ``run.seed`` = base + k for k < ``seeds``, named ``<name>-seed=<seed>``
    when ``seeds`` > 1. ``seeds`` = 1 returns ``[cfg]`` itself, name and seed unchanged."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if seeds == 1:
        return [cfg]
    out = []
    for k in range(seeds):
        c = copy.deepcopy(cfg)
        c.run.seed = cfg.run.seed + k
        c.run.name = f"{cfg.run.name}-seed={c.run.seed}"
        out.append(c)
    return out


@dataclass
class SeedGroup:
    """The runs of one config that differ only in ``run.seed`` (one run when not seeded)."""

    name: str
    runs: list[RunRecord]

    @property
    def n(self) -> int:
        return len(self.runs)


def run_seeds(cfgs: list[FlGeoConfig], runs_dir: str | Path, name: str, loss: str = "global",
              metric: str = "loss", resume: bool = False, ran: bool = False) -> tuple[SeedGroup, list[dict[str, Any]]]:
    """Run the `seeded_configs` of one config one after another into ``runs_dir/<run.name>``;
    the group (named ``name``, the config's own run name) and every run's summary, in seed order.
    ``resume``: reuse runs that finished there with the same config and continue interrupted ones
    (`fl_geo.run_reuse.plan_run`). ``ran``: every run has just finished there
    (`fl_geo.run_pool.run_in_parallel`): read them, run nothing."""
    from fl_geo.run_reuse import RunPlan, plan_run
    from fl_geo.simulation import run_simulation

    group, summaries = SeedGroup(name, []), []
    for k, cfg in enumerate(cfgs, start=1):
        run_dir = Path(runs_dir) / cfg.run.name
        if ran:
            summary = {**json.loads((run_dir / "summary.json").read_text(encoding="utf-8")), "run_dir": str(run_dir)}
            summaries.append(summary)
            group.runs.append(load_run(summary["run_dir"], loss, metric))
            continue
        plan = plan_run(cfg, run_dir) if resume else RunPlan("start", cfg)
        note = {"start": "", "reuse": " (finished earlier: reused)", "continue": " (interrupted: continued)"}[plan.action]
        if len(cfgs) > 1 or note:
            print(f"seed {k}/{len(cfgs)} of {name}: run.seed={cfg.run.seed}{note}", file=sys.stderr, flush=True)
        summary = plan.summary if plan.summary is not None else run_simulation(plan.cfg, run_dir)
        summaries.append(summary)
        group.runs.append(load_run(summary["run_dir"], loss, metric))
    return group, summaries


def group_by_seed_suffix(runs: list[RunRecord]) -> list[SeedGroup]:
    """Runs whose names differ only in a trailing ``-seed=<int>`` form one group (named without the
    suffix), in order of first appearance; every other run is a group of its own."""
    groups: list[SeedGroup] = []
    by_base: dict[str, SeedGroup] = {}
    for r in runs:
        match = SEED_SUFFIX.search(r.name)
        if match is None:
            groups.append(SeedGroup(r.name, [r]))
            continue
        base = r.name[: match.start()]
        if base not in by_base:
            by_base[base] = SeedGroup(base, [])
            groups.append(by_base[base])
        by_base[base].runs.append(r)
    return groups


def run_seed(run: RunRecord) -> int | None:
    """The ``run.seed`` a finished run was made with, from its ``config.yaml`` (None without one)."""
    path = run.path / "config.yaml"
    if not path.is_file():
        return None
    data = load_yaml(path.read_text(encoding="utf-8"), str(path))
    seed = data.get("run", {}).get("seed") if isinstance(data, dict) else None
    return int(seed) if isinstance(seed, int) else None


@dataclass(frozen=True)
class Figure:
    """One per-run figure that a seed group aggregates.

    ``better`` is -1 where lower is better (losses, times) and +1 where higher is (goodput);
    ``word`` says it in a sentence ("lower", "sooner", "higher")."""

    key: str  # its name in the group summary JSON
    header: str  # table column; "{target}" is replaced by the target
    spec: str  # format of the mean and the half-width
    better: int
    word: str
    value: Callable[[RunRecord, float], float | None]

    def label(self, target: float, metric: str = "loss") -> str:
        """The column header: ``final val loss``, ``virtual s to 1.718``, ..."""
        return self.header.format(unit=metric, target=f"{target:.3f}")


def _bpb(run: RunRecord, target: float) -> float | None:
    return dataclasses.replace(run, metric="bpb").final_loss


FIGURES = {
    "final": Figure("final", "final val {unit}", ".4f", -1, "lower", lambda r, t: r.final_loss),
    "final_bpb": Figure("final_bpb", "final val bpb", ".4f", -1, "lower", _bpb),
    "virtual_s_to_target": Figure("virtual_s_to_target", "virtual s to {target}", ".1f", -1, "sooner",
                                  lambda r, t: r.first_reaching(t, VIRTUAL)),
    "wall_s_to_target": Figure("wall_s_to_target", "wall s to {target}", ".1f", -1, "sooner",
                               lambda r, t: r.first_reaching(t, WALL)),
    "goodput": Figure("goodput", "goodput", ".3f", +1, "higher", lambda r, t: r.summary.get("goodput")),
}


def figures_for(runs: list[RunRecord]) -> list[Figure]:
    """The figures these runs have: final loss and wall time always; bits per byte where a
    loss-metric comparison's runs logged ``val/bpb``; virtual time where a run used the virtual
    clock; goodput where a summary has it."""
    out = [FIGURES["final"]]
    if runs and runs[0].metric == "loss" and any(BPB in row for r in runs for row in r.rows):
        out.append(FIGURES["final_bpb"])
    if any(VIRTUAL in row for r in runs for row in r.rows):
        out.append(FIGURES["virtual_s_to_target"])
    out.append(FIGURES["wall_s_to_target"])
    if any(r.summary.get("goodput") is not None for r in runs):
        out.append(FIGURES["goodput"])
    return out


@dataclass(frozen=True)
class FigureStat:
    """One figure of one group: every seed's value (None where it has none) and, when every
    seed has a finite one, their mean and interval."""

    values: tuple[float | None, ...]
    interval: Interval | None

    @property
    def present(self) -> int:
        return sum(v is not None for v in self.values)


def figure_stat(group: SeedGroup, figure: Figure, target: float) -> FigureStat:
    """``figure`` of every run of ``group`` and their interval (None unless all are finite)."""
    values = []
    for r in group.runs:
        v = figure.value(r, target)
        values.append(float(v) if v is not None and math.isfinite(float(v)) else None)
    complete = [v for v in values if v is not None]
    interval = t_interval(complete) if complete and len(complete) == len(values) else None
    return FigureStat(tuple(values), interval)


def mean_band(series: list[tuple[list[float], list[float]]]) -> tuple[np.ndarray, ...] | None:
    """(x, mean, min, max) of several seeds' curves on the x range they all cover.

    Seeds log at different x (wall time always differs), so each curve is interpolated linearly
    onto the union of their x values inside the common range. None when they share no range."""
    curves = [(np.asarray(xs, float), np.asarray(ys, float)) for xs, ys in series if xs]
    if len(curves) != len(series) or not curves:
        return None
    lo, hi = max(xs[0] for xs, _ in curves), min(xs[-1] for xs, _ in curves)
    if lo > hi:
        return None
    grid = np.unique(np.concatenate([xs[(xs >= lo) & (xs <= hi)] for xs, _ in curves]))
    ys = np.stack([np.interp(grid, xs, y) for xs, y in curves])
    return grid, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def group_summary(groups: list[SeedGroup], target: float, verdicts: list[str]) -> dict[str, Any]:
    """The group summary JSON: every seed's figures, the aggregate per group, and the verdicts."""
    runs = [r for g in groups for r in g.runs]
    figures = figures_for(runs)
    out_groups = []
    for g in groups:
        stats = {f.key: figure_stat(g, f, target) for f in figures}
        out_groups.append({
            "name": g.name,
            "n": g.n,
            "seeds": [run_seed(r) for r in g.runs],
            "runs": [{"name": r.name, "run_dir": str(r.path), "seed": run_seed(r), "failure": r.summary.get("failure"),
                      "tokens_per_param": r.tokens_per_param, "figures": {k: s.values[i] for k, s in stats.items()}} for i, r in enumerate(g.runs)],
            "aggregate": {k: (s.interval.to_dict() if s.interval else None) for k, s in stats.items()},
        })
    metric = runs[0].metric if runs else "loss"
    return {
        "target": target,
        "metric": metric,
        "loss_of": runs[0].loss if runs else "global",
        "loss_key": runs[0].loss_key if runs else LOSS,
        "interval": "95 % Student-t: mean ± t_{0.975, n-1} · s / √n (s: sample standard deviation); "
                    "none for n = 1",
        "groups": out_groups,
        "verdicts": verdicts,
    }
