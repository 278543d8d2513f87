"""Compare finished runs: one Markdown table and PNG plots of validation loss.

Reads each run directory's ``metrics.jsonl`` and ``summary.json`` (what every fl-geo run writes), so
it works on runs made by ``fl-geo run``, ``flwr run .`` or a deployment alike, and ``fl-geo compare
CONFIG ...`` simply runs the configs first. Time-to-target is read at the evaluation points, without
interpolation: the first logged step whose ``val/loss`` is at or below the target, reported in
inner steps per worker (the sum of ``train/inner_steps`` up to it), virtual time
(``time/virtual_s``, when the run used the virtual clock), wall time and tokens.
"Max spike" is the largest rise of the validation loss between consecutive evaluations.

Which model's loss: ``global`` (the default) is the server's model, ``val/loss``. ``workers``
reads ``val/worker_loss``, the mean over the workers' own models, where a run logged it
(Streaming DiLoCo and CoCoDC with ``streaming.eval_workers``), and ``val/loss`` elsewhere: the
synchronous loops' workers start every period from the global model, so it is what they hold.

Which unit (``metric``): ``loss`` (the default) is nats per token; ``bpb`` is bits per byte
(``val/bpb``), the figure that compares runs with different tokenizers (docs/data.md). Runs
written before ``val/bpb`` existed were all byte-level, so their bpb is read as loss / ln 2.

Seeds: runs of one config that differ only in ``run.seed`` form a group (`fl_geo.seed_groups`);
a group of several is tabulated as mean ± 95 % Student-t interval (`fl_geo.seed_report`) and
plotted as its mean with a min-max band. ``summary.json`` in the output directory keeps every
run's figures and each group's aggregate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.errors import ConfigError
from fl_geo.runtime.metrics import read_metrics

LOSS = "val/loss"
WORKER_LOSS = "val/worker_loss"
LOSS_KINDS = ("global", "workers")
BPB = "val/bpb"
METRICS = ("loss", "bpb")
STEPS = "train/inner_steps"
VIRTUAL = "time/virtual_s"
WALL = "time/wall_s"
TOKENS = "train/tokens"


@dataclass
class RunRecord:
    """One finished run as the comparison sees it."""

    name: str
    path: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    loss: str = "global"  # which model's loss (LOSS_KINDS; see the module docstring)
    metric: str = "loss"  # nats per token or bits per byte (METRICS)

    @property
    def loss_key(self) -> str:
        """The metric read as "the" validation loss of this run."""
        if self.metric == "bpb":
            return BPB
        if self.loss == "workers" and any(WORKER_LOSS in row for row in self.rows):
            return WORKER_LOSS
        return LOSS

    def _value(self, row: dict[str, Any], key: str) -> Any:
        """``row[key]``; for bits per byte of a run that predates ``val/bpb`` (byte-level), loss / ln 2."""
        value = row.get(key)
        if value is None and key == BPB and not self._has_bpb and row.get(LOSS) is not None:
            value = float(row[LOSS]) / math.log(2)
        return value

    @property
    def _has_bpb(self) -> bool:
        return any(BPB in row for row in self.rows)

    def _with_steps(self) -> list[dict[str, Any]]:
        """The rows with ``steps``: inner steps per worker so far (running sum of
        ``train/inner_steps``, which each logged step reports as its per-worker mean)."""
        total, out = 0.0, []
        for row in self.rows:
            value = row.get(STEPS)
            if value is not None and math.isfinite(float(value)):
                total += float(value)
            out.append({**row, "steps": total})
        return out

    def series(self, x_key: str) -> tuple[list[float], list[float]]:
        """(x, val loss) at every logged evaluation that has both values; ``x_key`` "steps" is
        inner steps per worker. The initial evaluation (before any training) has no worker loss,
        so with ``workers`` it falls back to ``val/loss``, which is every model's loss then."""
        key = self.loss_key
        xs, ys = [], []
        for row in self._with_steps() if x_key == "steps" else self.rows:
            x, y = row.get(x_key), self._value(row, key)
            if y is None and key == WORKER_LOSS and not row.get(STEPS) and not row.get("outer/step"):
                y = row.get(LOSS)
            if x is not None and y is not None:
                xs.append(float(x))
                ys.append(float(y))
        return xs, ys

    def first_reaching(self, target: float, x_key: str) -> float | None:
        for x, y in zip(*self.series(x_key), strict=True):
            if y <= target:
                return x
        return None

    @property
    def max_spike(self) -> float | None:
        """The largest rise of the validation loss from one evaluation to the next (0 if it never
        rose): EDiT's loss spikes, read without smoothing."""
        _, ys = self.series(WALL)
        if len(ys) < 2:
            return None
        return max(0.0, *(b - a for a, b in zip(ys, ys[1:], strict=False)))

    @property
    def final_loss(self) -> float | None:
        _, ys = self.series(WALL)
        return ys[-1] if ys else None

    @property
    def unfinished(self) -> bool:
        """No ``summary.json``: the run is still going, or was killed before it ended, so its
        figures are those of a partial run."""
        return not (self.path / "summary.json").is_file()

    @property
    def tokens_per_param(self) -> float | None:
        """The run's budget as the scaling-law papers state it: training tokens over model
        parameters (``summary.json``'s ``tokens`` / ``num_params``; about 20 is compute-optimal).
        None when the summary lacks either."""
        tokens, params = self.summary.get("tokens"), self.summary.get("num_params")
        if not isinstance(tokens, (int, float)) or not isinstance(params, (int, float)) or params <= 0:
            return None
        return float(tokens) / float(params)


def load_run(path: str | Path, loss: str = "global", metric: str = "loss") -> RunRecord:
    """A run directory (or its metrics.jsonl); clear error if it is not a finished fl-geo run."""
    if loss not in LOSS_KINDS:
        raise ValueError(f"loss must be one of {LOSS_KINDS}, got {loss!r}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    p = Path(path)
    if p.is_file():
        p = p.parent
    if not (p / "metrics.jsonl").is_file():
        raise ConfigError(f"{p} has no metrics.jsonl: not an fl-geo run directory")
    summary_path = p / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        rows = read_metrics(p)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read the run's results ({exc})") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{summary_path}: not a run summary (a JSON object)")
    return RunRecord(summary.get("name", p.name), p, summary, rows, loss, metric)


def default_target(runs: list[RunRecord]) -> float:
    """The worst final validation loss among the runs that learned (ended below where they
    started): the lowest loss all of them reached. A diverged run would make any target trivial,
    so it does not set one; it is still listed, and simply never reaches the target."""
    finals = [r.final_loss for r in runs if r.final_loss is not None]
    if not finals:
        names = ", ".join(str(r.path) for r in runs)
        raise ConfigError(f"nothing to compare: no run logged a validation loss (val/loss) in {names}")
    learned = [r.final_loss for r in runs if r.final_loss is not None and r.series(WALL)[1][0] > r.final_loss]
    return max(learned or finals)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


UNFINISHED_NOTE = "no summary.json (still running, or killed before it ended): its figures are partial"


def markdown_table(runs: list[RunRecord], target: float) -> str:
    final = "final val bpb" if runs and runs[0].metric == "bpb" else "final val loss"
    head = (
        f"| run | strategy | loss of | {final} | steps to {target:.3f} | virtual s to {target:.3f} | "
        f"wall s to {target:.3f} | tokens to {target:.3f} | total tokens | tokens / param | MB up | MB down | rejected | max spike | goodput |"
    )
    lines = [head, "|" + "---|" * 15]
    notes = []
    for r in runs:
        s = r.summary
        name = r.name
        if s.get("failure"):  # summary.json of a run that must not count as a success
            name += " FAILED"
            notes.append(f"- {r.name} FAILED: {s['failure']}")
        elif r.unfinished:
            name += " UNFINISHED"
            notes.append(f"- {r.name} UNFINISHED: {UNFINISHED_NOTE}")
        strategy = s.get("strategy", "?")
        if s.get("outer_optimizer"):
            strategy += f" ({s['outer_optimizer']})"
        of = "workers" if r.loss_key == WORKER_LOSS else "global"
        lines.append(
            f"| {name} | {strategy} | {of} | {_fmt(r.final_loss, '.4f')} | "
            f"{_fmt(r.first_reaching(target, 'steps'), ',.0f')} | {_fmt(r.first_reaching(target, VIRTUAL), '.1f')} | {_fmt(r.first_reaching(target, WALL), '.1f')} | "
            f"{_fmt(r.first_reaching(target, TOKENS), ',.0f')} | {_fmt(s.get('tokens'), ',')} | {_fmt(r.tokens_per_param, '.2f')} | "
            f"{_fmt(s.get('bytes_up', 0) / 1e6, '.1f')} | {_fmt(s.get('bytes_down', 0) / 1e6, '.1f')} | "
            f"{_fmt(s.get('rejected'), 'd')} | {_fmt(r.max_spike, '.3f')} | {_fmt(s.get('goodput'), '.3f')} |"
        )
    return "\n".join(lines + ([""] + notes if notes else []))


def loss_range(series: list[list[float]]) -> tuple[float, float] | None:
    """The y range of a loss plot: every value after each run's first evaluation, with a margin.

    The first evaluation is the untrained model (ln 256 ≈ 5.55 for the byte-level model), far above
    everything after it; including it squeezes the part of the curves that differs between methods
    into a few pixels. None when there is nothing after the first points (the default range then).
    """
    rest = [y for ys in series for y in ys[1:] if math.isfinite(y)]
    if not rest:
        return None
    low, high = min(rest), max(rest)
    margin = 0.05 * (high - low) if high > low else 0.05 * max(abs(high), 1.0)
    return low - margin, high + margin


def _draw_band(ax: Any, name: str, runs: list[RunRecord], x_key: str) -> list[list[float]] | None:
    """One seed group on ``ax``: the mean curve and a min-max band over its seeds (the band shows
    the seeds' actual spread; a pointwise t interval of 2-3 curves would mostly show noise).
    Returns the band's lower and upper curves, or None when the seeds share no x range."""
    from fl_geo.seed_groups import mean_band

    band = mean_band([r.series(x_key) for r in runs])
    if band is None:
        return None
    xs, mean, low, high = band
    (line,) = ax.plot(xs, mean, linewidth=1.4, label=f"{name} (mean of {len(runs)} seeds; band: min-max)")
    ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    return [[float(y) for y in low], [float(y) for y in high]]


def plot(runs: list[RunRecord], x_key: str, xlabel: str, path: Path, target: float | None = None,
         groups: list[Any] | None = None) -> Path | None:
    """Validation loss against ``x_key`` for every run that logged it; None if none did.

    ``groups`` (`fl_geo.seed_groups.SeedGroup`, covering ``runs``): a group of several seeds is
    drawn as its mean with a min-max band; a group of one run as the run itself."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    series = [(r.name, *r.series(x_key)) for r in runs]
    series = [s for s in series if s[1]]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    drawn = [ys for _, _, ys in series]  # the y values that set the plot's range (loss_range)
    count = f"{len(series)} run(s)"
    if groups is not None and any(g.n > 1 for g in groups):
        drawn = []
        for g in groups:
            band = _draw_band(ax, g.name, g.runs, x_key) if g.n > 1 else None
            if band is not None:
                drawn += band
                continue
            for r in g.runs:  # one run, or seeds without a common x range: each on its own
                xs, ys = r.series(x_key)
                if xs:
                    ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.4, label=r.name)
                    drawn.append(ys)
        count = f"{len(groups)} config(s), {len(series)} run(s)"
    else:
        for name, xs, ys in series:
            ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.4, label=name)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
    ax.set_xlabel(xlabel)
    if runs[0].metric == "bpb":
        ax.set_ylabel("validation bits per byte")
    else:
        # fl-geo's default tokenizer is byte-level: one token is one byte of UTF-8 text
        ax.set_ylabel("validation loss (nats/token = nats/byte)")
    what = "bits per byte" if runs[0].metric == "bpb" else "loss"
    ax.set_title(f"Validation {what} against {xlabel.split(' (')[0]}, {count}", fontsize=10)
    limits = loss_range(drawn)
    if limits is not None:
        ax.set_ylim(*limits)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


GOODPUT_BUCKETS = ("useful", "comm", "waiting", "lost", "rejected", "stale", "in_flight")


def plot_goodput(runs: list[RunRecord], path: Path) -> Path | None:
    """One stacked bar per run: where its provisioned node-time went (summary ``goodput_s``, as
    shares of it); None when no run has one (wall-clock runs)."""
    rows = [(r.name, r.summary["goodput_s"]) for r in runs
            if isinstance(r.summary.get("goodput_s"), dict) and (r.summary["goodput_s"].get("provisioned") or 0) > 0]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.6), dpi=120)
    left = [0.0] * len(rows)
    for bucket in GOODPUT_BUCKETS:
        shares = [float(g.get(bucket) or 0.0) / float(g["provisioned"]) for _, g in rows]
        ax.barh([name for name, _ in rows], shares, left=left, label=bucket)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    ax.set_xlabel("share of provisioned node-time (useful = goodput)")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) < 3 else -0.12))
    ax.set_title("Goodput breakdown", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def compare(runs: list[RunRecord], out_dir: str | Path, target: float | None = None,
            groups: list[Any] | None = None, reference: str | None = None) -> dict[str, Any]:
    """Write ``compare.md``, the plots and the group ``summary.json`` into ``out_dir``; return what
    was written.

    ``groups`` (`fl_geo.seed_groups.SeedGroup`, covering ``runs`` in order) say which runs are
    seeds of one config; None makes every run a group of its own. With one run per group the
    table is the per-run table alone; once a group has several seeds the table gains one row per
    group (mean ± 95 % t interval, `fl_geo.seed_report`), the verdicts on which differences are
    real, and the per-seed table below them, and the loss plots draw each group's mean and
    min-max band. ``summary.json`` keeps every seed's figures and each group's aggregate.
    ``reference`` (a group's name) adds every other group paired with it by seed
    (`fl_geo.paired.against_reference`): the speed-up to its final loss and the relative final
    loss, each as a mean ± 95 % t interval over the seeds, in the table and in ``summary.json``.
    """
    from fl_geo.paired import against_reference
    from fl_geo.seed_groups import SeedGroup, group_summary
    from fl_geo.seed_report import seeds_table, verdicts

    if not runs:
        raise ValueError("nothing to compare")
    if len({r.metric for r in runs}) > 1:
        raise ValueError("runs compared together must use one metric (loss or bpb)")
    groups = [SeedGroup(r.name, [r]) for r in runs] if groups is None else groups
    if sorted(id(r) for g in groups for r in g.runs) != sorted(id(r) for r in runs):
        raise ValueError("the seed groups must hold every run once")
    paired_lines, paired = [], {}
    if reference is not None:
        x_key = VIRTUAL if any(VIRTUAL in row for r in runs for row in r.rows) else WALL
        paired_lines, paired = against_reference(groups, reference, x_key)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = default_target(runs) if target is None else target
    table = markdown_table(runs, target)
    lines = verdicts(groups, target)
    if any(g.n > 1 for g in groups):
        parts = [seeds_table(groups, target)]
        if lines:
            parts.append("Differences (a winner only where the 95 % intervals are disjoint):\n\n"
                         + "\n".join(f"- {line}" for line in lines))
        table = "\n\n".join([*parts, "Per seed:\n\n" + table])
    if paired_lines:
        table = (f"Paired with {reference} by seed (mean ± 95 % t half-width over the seeds both ran):\n\n"
                 + "\n".join(f"- {line}" for line in paired_lines) + "\n\n" + table)
    (out / "compare.md").write_text(table + "\n", encoding="utf-8")
    summary_path = out / "summary.json"
    group_json = group_summary(groups, target, lines)
    if reference is not None:
        group_json["paired"] = {"reference": reference, "groups": paired}
    summary_path.write_text(json.dumps(group_json, indent=2) + "\n", encoding="utf-8")
    stem = "val_bpb" if runs[0].metric == "bpb" else "val_loss"
    plots = {
        "virtual": plot(runs, VIRTUAL, "virtual time (s, modelled WAN + accelerators)", out / f"{stem}_vs_virtual_time.png",
                        target, groups),
        "wall": plot(runs, WALL, "wall time (s)", out / f"{stem}_vs_wall_time.png", target, groups),
        "tokens": plot(runs, TOKENS, "tokens consumed", out / f"{stem}_vs_tokens.png", target, groups),
        "steps": plot(runs, "steps", "inner steps per worker", out / f"{stem}_vs_steps.png", target, groups),
        "goodput": plot_goodput(runs, out / "goodput.png"),
    }
    return {"table": table, "target": target, "summary": str(summary_path), "verdicts": lines,
            "plots": {k: str(v) for k, v in plots.items() if v is not None}}
