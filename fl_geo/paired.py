"""Paired comparisons of two seed groups: per-seed ratios and differences with a 95 % interval.

`fl-geo compare --seeds N` gives each config's figures as a mean and an interval, and names a
winner only where two configs' intervals are disjoint. That answers "is A's final loss below B's".
It does not answer "how many times sooner does A reach the loss B ends with", which is how the
DiLoCo-family papers state their results, and which the README's method table quotes.

A seed fixes the initial weights and every site's batch order, so run A with seed s and run B with
seed s start from the same model and see the same data: a *paired* comparison. This module computes
one value per seed that both groups ran, then the Student-t interval of those values
(`fl_geo.intervals`). Pairing removes the noise the two runs share, so a paired interval is usually
much narrower than the two groups' separate intervals.

- `speedup`: ``x_ref(target_s) / x_method(target_s)``, where ``x(L)`` is the first evaluation at
  or below ``L`` on the x axis (virtual seconds by default, as `fl-geo compare` reads
  time-to-target) and ``target_s`` is, per seed, the reference's own final loss (the papers' "time
  to the baseline's final quality") or any other rule (`worst_final`). A seed whose method run
  never reached the target has no value; the interval then needs every seed (`PairedStat`).
- `relative_difference`: ``figure_method / figure_ref - 1`` per seed (final loss by default).

Everything here reads finished runs (`fl_geo.compare.RunRecord`); it runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fl_geo.compare import VIRTUAL, RunRecord
from fl_geo.errors import ConfigError
from fl_geo.intervals import Interval, t_interval
from fl_geo.seed_groups import SEED_SUFFIX, SeedGroup, run_seed

__all__ = ["PairedStat", "against_reference", "by_seed", "format_percent", "format_ratio", "inverse", "reference_final",
           "relative_difference", "speedup", "stat_dict", "worst_final"]

# target rule: the runs of one seed, reference first, then every other group's run of that seed
TargetRule = Callable[[RunRecord, Sequence[RunRecord]], float | None]


@dataclass(frozen=True)
class PairedStat:
    """One paired figure: the seeds both groups ran, each seed's value (None where it has none)
    and the interval over them, which exists only when every paired seed has a value (averaging
    the seeds that reached a target would flatter the method)."""

    seeds: tuple[int, ...]
    values: tuple[float | None, ...]
    interval: Interval | None

    @property
    def present(self) -> int:
        return sum(v is not None for v in self.values)

    @property
    def n(self) -> int:
        return len(self.seeds)


def _seed_of(run: RunRecord) -> int | None:
    """The run's seed: its config's ``run.seed``, else the ``-seed=<k>`` suffix of its name."""
    seed = run_seed(run)
    if seed is not None:
        return seed
    match = SEED_SUFFIX.search(run.name)
    return int(match.group(1)) if match else None


def by_seed(group: SeedGroup) -> dict[int, RunRecord]:
    """The group's runs keyed by seed; a run without a seed, or a second run of one seed, is an
    error: pairing needs to know which run goes with which."""
    out: dict[int, RunRecord] = {}
    for run in group.runs:
        seed = _seed_of(run)
        if seed is None:
            raise ValueError(f"{run.path}: no run.seed in config.yaml and no -seed=<k> in its name")
        if seed in out:
            raise ValueError(f"group {group.name!r} has two runs of seed {seed}: {out[seed].path} and {run.path}")
        out[seed] = run
    return out


def _stat(seeds: list[int], values: list[float | None]) -> PairedStat:
    finite = [v for v in values if v is not None]
    interval = t_interval(finite) if finite and len(finite) == len(values) else None
    return PairedStat(tuple(seeds), tuple(values), interval)


def _paired(reference: SeedGroup, method: SeedGroup) -> tuple[list[int], dict[int, RunRecord], dict[int, RunRecord]]:
    ref, other = by_seed(reference), by_seed(method)
    seeds = sorted(set(ref) & set(other))
    if not seeds:
        raise ValueError(f"groups {reference.name!r} and {method.name!r} share no seed "
                         f"({sorted(ref)} against {sorted(other)})")
    return seeds, ref, other


def reference_final(reference: RunRecord, others: Sequence[RunRecord]) -> float | None:
    """Target rule: the reference run's own final loss."""
    return reference.final_loss


def worst_final(reference: RunRecord, others: Sequence[RunRecord]) -> float | None:
    """Target rule: the worst final loss among the seed's runs (every run that ends reaches it),
    as `fl-geo compare`'s default target, per seed."""
    finals = [r.final_loss for r in (reference, *others)]
    finite = [f for f in finals if f is not None and math.isfinite(f)]
    return max(finite) if finite else None


def speedup(reference: SeedGroup, method: SeedGroup, target: TargetRule = reference_final,
            x_key: str = VIRTUAL, others: Sequence[SeedGroup] = ()) -> PairedStat:
    """Per paired seed, how many times sooner ``method`` reaches the seed's target than
    ``reference`` does on ``x_key``: ``x_ref / x_method`` (> 1: the method is faster). ``others``
    are further groups whose runs of the same seed the target rule may look at (`worst_final`)."""
    seeds, ref, other = _paired(reference, method)
    extra = [by_seed(g) for g in others]
    values: list[float | None] = []
    for s in seeds:
        goal = target(ref[s], [other[s], *(e[s] for e in extra if s in e)])
        if goal is None or not math.isfinite(goal):
            values.append(None)
            continue
        x_ref, x_method = ref[s].first_reaching(goal, x_key), other[s].first_reaching(goal, x_key)
        values.append(x_ref / x_method if x_ref is not None and x_method is not None and x_method > 0 else None)
    return _stat(seeds, values)


def relative_difference(reference: SeedGroup, method: SeedGroup,
                        figure: Callable[[RunRecord], float | None] = lambda r: r.final_loss) -> PairedStat:
    """Per paired seed, ``figure(method) / figure(reference) - 1`` (final loss by default:
    -0.035 is 3.5 % lower than the reference)."""
    seeds, ref, other = _paired(reference, method)
    values: list[float | None] = []
    for s in seeds:
        a, b = figure(ref[s]), figure(other[s])
        ok = a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a != 0
        values.append(b / a - 1.0 if ok else None)
    return _stat(seeds, values)


def ratio(reference: SeedGroup, method: SeedGroup, figure: Callable[[RunRecord], float | None]) -> PairedStat:
    """Per paired seed, ``figure(method) / figure(reference)`` (e.g. peak bytes per sync: 0.28
    is 0.28× the reference's); a seed where either figure is missing or not finite has no value."""
    difference = relative_difference(reference, method, figure)
    return _stat(list(difference.seeds), [None if v is None else v + 1.0 for v in difference.values])


def inverse(stat: PairedStat) -> PairedStat:
    """Each seed's value inverted (a speedup read as a time ratio: 0.5 -> 2.0), with the interval
    of the inverted values (not the inverted interval, which would not be symmetric)."""
    values = [1.0 / v if v is not None and v != 0 else None for v in stat.values]
    return _stat(list(stat.seeds), values)


def format_ratio(stat: PairedStat) -> str:
    """``3.70× ± 0.41``; one seed: ``3.70× (1 seed)``; a seed without a value: ``reached on 2/3 seeds``."""
    if stat.interval is None:
        return f"reached on {stat.present}/{stat.n} seeds"
    i = stat.interval
    return f"{i.mean:.2f}× (1 seed)" if i.half_width is None else f"{i.mean:.2f}× ± {i.half_width:.2f}"


def format_percent(stat: PairedStat) -> str:
    """A relative difference as a signed percentage: ``−3.5 % ± 1.2`` (lower reads as a minus)."""
    if stat.interval is None:
        return f"n/a ({stat.present}/{stat.n} seeds)"
    i = stat.interval
    mean = f"{100 * i.mean:+.1f} %".replace("-", "−")
    return f"{mean} (1 seed)" if i.half_width is None else f"{mean} ± {100 * i.half_width:.1f}"


def stat_dict(stat: PairedStat) -> dict[str, object]:
    """JSON-ready: the paired seeds, each seed's value and the interval (mean, half-width, bounds)."""
    return {"seeds": list(stat.seeds), "values": list(stat.values),
            "interval": stat.interval.to_dict() if stat.interval else None}


def against_reference(groups: Sequence[SeedGroup], reference: str, x_key: str = VIRTUAL
                      ) -> tuple[list[str], dict[str, dict[str, object]]]:
    """`fl-geo compare --reference NAME`: every other group paired by seed with the group named
    ``reference``: its speed-up to the reference's own final loss on ``x_key`` (above 1: sooner)
    and its final loss relative to the reference's. Returns one line per group and the figures
    (`stat_dict`) by group name. A group that shares no seed with the reference gets a line saying
    so; an unknown ``reference`` is a `ConfigError` naming the groups there are."""
    by_name = {g.name: g for g in groups}
    if reference not in by_name:
        raise ConfigError(f"--reference {reference!r} is none of the compared configs: {', '.join(by_name)}")
    ref = by_name[reference]
    axis = "virtual time" if x_key == VIRTUAL else "wall time"
    lines: list[str] = []
    figures: dict[str, dict[str, object]] = {}
    for g in groups:
        if g is ref:
            continue
        try:
            fast, diff = speedup(ref, g, x_key=x_key), relative_difference(ref, g)
        except ValueError as exc:
            lines.append(f"{g.name}: not paired ({exc})")
            continue
        figures[g.name] = {"speedup_to_reference_final": stat_dict(fast), "final_relative": stat_dict(diff)}
        lines.append(f"{g.name}: speed-up to {reference}'s final loss in {axis} {format_ratio(fast)}; "
                     f"final loss {format_percent(diff)} against {reference} (seeds {', '.join(map(str, fast.seeds))})")
    return lines, figures
