#!/usr/bin/env python
"""The README's "Which method for which situation" table from the runs of examples/method_table.sh.

    .venv/bin/python examples/method_table_report.py OUT [--readme README.md]

OUT is the study's directory: OUT/<row>/runs/<row>-<cell>-seed=<k> for the rows straggler, eta100,
eta200, noisy, halos and streaming. Writes OUT/method_table.md (the table), OUT/method_table.json
(every paired figure: seeds, per-seed values, mean, half-width) and OUT/method_table_details.md (the
same as a table), prints the table, and with
``--readme`` replaces what lies between the README's ``<!-- method-table:begin -->`` and
``<!-- method-table:end -->`` lines with it. A row this study has no runs for keeps the line the
README already gives it (so ``ROWS="halos streaming"`` updates those two rows and leaves the rest).

Every figure is paired by seed (`fl_geo.paired`): a ratio or a difference is computed per seed and
given as the mean ± the half-width of its 95 % Student-t interval over the seeds. A table row whose
runs are missing is left out and named in a note under the table; a figure some seed lacks (a
method that never reached the target on that seed) is written as "k/n seeds".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.compare import RunRecord, load_run
from fl_geo.intervals import t_interval
from fl_geo.paired import (
    PairedStat,
    format_percent,
    format_ratio,
    inverse,
    ratio,
    relative_difference,
    speedup,
    stat_dict,
    worst_final,
)
from fl_geo.seed_groups import SeedGroup, group_by_seed_suffix

BEGIN, END = "<!-- method-table:begin -->", "<!-- method-table:end -->"
STUDY_ROWS = ("straggler", "eta100", "eta200", "noisy", "halos", "streaming")
Groups = dict[str, dict[str, SeedGroup]]  # study row -> cell -> its seeds


def load_groups(out: Path) -> Groups:
    """The finished runs of every study row, grouped by cell (runs without a summary are skipped:
    a run still going, or one that failed)."""
    groups: Groups = {}
    for row in STUDY_ROWS:
        runs_dir = out / row / "runs"
        if not runs_dir.is_dir():
            continue
        runs = [load_run(p) for p in sorted(runs_dir.iterdir()) if (p / "summary.json").is_file()]
        groups[row] = {g.name.removeprefix(f"{row}-"): g for g in group_by_seed_suffix(runs)}
    return groups


# ---------------------------------------------------------------- formatting


def _n_seeds(stat: PairedStat) -> str:
    return f"{stat.present}/{stat.n} seeds"


times, percent = format_ratio, format_percent  # ``3.70× ± 0.41``, ``−3.5 % ± 1.2``


def final(group: SeedGroup) -> str:
    values = [r.final_loss for r in group.runs if r.final_loss is not None]
    if not values:
        return "n/a"
    i = t_interval(values)
    return f"{i.mean:.4f}" if i.half_width is None else f"{i.mean:.4f} ± {i.half_width:.4f}"


def budget(*groups: SeedGroup) -> str:
    """Tokens per parameter of the groups' runs: one value, or the range."""
    values = sorted({round(v, 1) for g in groups for r in g.runs if (v := r.tokens_per_param) is not None})
    if not values:
        return "? tokens per parameter"
    span = f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g}"
    return f"{span} tokens per parameter"


def seeds_of(*groups: SeedGroup) -> str:
    n = sorted({g.n for g in groups})
    if len(n) > 1:
        return f"{n[0]}-{n[-1]} seeds"
    return "1 seed" if n[0] == 1 else f"{n[0]} seeds"


# ---------------------------------------------------------------- the rows


@dataclass(frozen=True)
class TableRow:
    """One README row: the situation, what to start with, the study rows and cells it needs, and
    the text of its measured cell (built from the paired figures, recorded in ``figures``)."""

    situation: str
    start_with: str
    needs: tuple[tuple[str, tuple[str, ...]], ...]  # (study row, cells)
    anchor: str
    write: Callable[[Groups, dict[str, Any]], str]

    def missing(self, groups: Groups) -> list[str]:
        return [f"{row}/{c}" for row, cells in self.needs for c in cells if c not in groups.get(row, {})]


def _record(figures: dict[str, Any], key: str, stat: PairedStat) -> PairedStat:
    figures[key] = stat_dict(stat)
    return stat


def _ddp_clause(figures: dict[str, Any], key: str, ref: SeedGroup, ref_label: str, best: SeedGroup,
                best_label: str, ddp: SeedGroup) -> str:
    over = _record(figures, f"{key}/{best_label}_vs_ddp_final", relative_difference(ddp, best))
    took = _record(figures, f"{key}/ddp_time_to_{ref_label}_final", inverse(speedup(ref, ddp)))
    when = (f"takes {times(took)} {ref_label}'s virtual time to {ref_label}'s final loss" if took.interval
            else f"reaches {ref_label}'s final loss on {_n_seeds(took)}")
    return f"`ddp` ends at {final(ddp)} ({best_label} {percent(over)} against it) and {when}"


def _straggler(g: Groups, figures: dict[str, Any]) -> str:
    s = g["straggler"]
    fast = _record(figures, "straggler/a_edit_speedup", speedup(s["edit"], s["a_edit"]))
    diff = _record(figures, "straggler/a_edit_vs_edit_final", relative_difference(s["edit"], s["a_edit"]))
    return (f"reaches EDiT's final loss **{times(fast)} sooner** in virtual time under a 3× straggler; "
            f"final loss {percent(diff)} against EDiT ({final(s['a_edit'])} vs {final(s['edit'])}); "
            + _ddp_clause(figures, "straggler", s["edit"], "EDiT", s["a_edit"], "A-EDiT", s["ddp"])
            + f" ({seeds_of(*s.values())}, {budget(s['edit'])})")


def _eta(g: Groups, figures: dict[str, Any]) -> str:
    parts = []
    for row, eta in (("eta100", "η = 100"), ("eta200", "η = 200")):
        c = g[row]
        tuned = _record(figures, f"{row}/dips_speedup", speedup(c["diloco"], c["dips"]))
        paper = _record(figures, f"{row}/dips_paper_speedup", speedup(c["diloco"], c["dips-paper"]))
        diff = _record(figures, f"{row}/dips_vs_diloco_final", relative_difference(c["diloco"], c["dips"]))
        paper_text = (f"{times(paper)} sooner" if paper.interval
                      else f"DiLoCo's final loss {times(paper)}, final {final(c['dips-paper'])}")
        parts.append(f"{eta}: **{times(tuned)} sooner** to DiLoCo's final loss, final {percent(diff)}; "
                     f"with the paper's settings {paper_text}")
    c = g["eta100"]
    return ("; ".join(parts) + " (Di-PS as configured: fl-geo's lr scaling by share, momentum 0.7; the "
            "paper's: momentum 0.8, no scaling); η = 100: "
            + _ddp_clause(figures, "eta100", c["diloco"], "DiLoCo", c["dips"], "Di-PS", c["ddp"])
            + f" ({seeds_of(*c.values())}, {budget(c['diloco'])})")


def _halos(g: Groups, figures: dict[str, Any]) -> str:
    c = g["halos"]
    rest = (c["async_local_sgd"], c["diloco"])
    als = _record(figures, "halos/speedup_over_als",
                  speedup(c["async_local_sgd"], c["halos"], worst_final, others=rest))
    dl = _record(figures, "halos/speedup_over_diloco", speedup(c["diloco"], c["halos"], worst_final, others=rest))
    # the paper's K = 32 ends worst, so the target is its own final loss: say how much longer it takes
    paper = _record(figures, "halos/paper_k32_time_over_als",
                    inverse(speedup(c["async_local_sgd"], c["halos-paper"], worst_final, others=rest)))
    vs_diloco = _record(figures, "halos/halos_vs_diloco_final", relative_difference(c["diloco"], c["halos"]))
    return (f"reaches the worst final loss of the three **{times(als)} sooner** than Async-Local-SGD and "
            f"**{times(dl)} sooner** than DiLoCo on the HALoS paper's topology (K = 4; the paper's K = 32 "
            f"ends worst, at {final(c['halos-paper'])}, and takes {times(paper)} Async-Local-SGD's virtual "
            f"time to that loss); final {final(c['halos'])}, {percent(vs_diloco)} against DiLoCo's "
            f"{final(c['diloco'])} (ALS {final(c['async_local_sgd'])}); "
            + _ddp_clause(figures, "halos", c["halos"], "HALoS", c["halos"], "HALoS", c["ddp"])
            + f" ({seeds_of(*c.values())}, {budget(c['halos'])})")


def _noisy(g: Groups, figures: dict[str, Any]) -> str:
    c = g["noisy"]
    diff = _record(figures, "noisy/edit_vs_diloco_final", relative_difference(c["diloco"], c["edit"]))
    mean_spike = {k: sum((r.max_spike or 0.0) for r in c[k].runs) / c[k].n for k in ("diloco", "edit")}
    figures["noisy/mean_max_spike"] = mean_spike  # the largest rise of val loss between evaluations
    return (f"largest loss spike {mean_spike['edit']:.3f} against DiLoCo's {mean_spike['diloco']:.3f} (mean over "
            f"seeds) with one site of four fed 25 % garbage; final loss {percent(diff)} against DiLoCo "
            f"({final(c['edit'])} vs {final(c['diloco'])}); `ddp` {final(c['ddp'])} "
            f"({seeds_of(*c.values())}, {budget(c['diloco'])})")


def peak_bytes_per_sync(run: RunRecord) -> float | None:
    """The largest message one site sent in one sync: Streaming DiLoCo logs it
    (``comm/peak_bytes_per_sync``, its largest fragment); every message of a synchronous loop is
    the whole model, so there it is the uplink bytes over the accepted updates."""
    logged = [float(v) for row in run.rows if (v := row.get("comm/peak_bytes_per_sync")) is not None]
    if logged:
        return max(logged)
    sent, updates = run.summary.get("bytes_up"), run.summary.get("accepted_updates")
    return float(sent) / float(updates) if sent and updates else None


def _streaming(g: Groups, figures: dict[str, Any]) -> str:
    c = g["streaming"]
    fast = _record(figures, "streaming/speedup", speedup(c["diloco"], c["streaming"]))
    diff = _record(figures, "streaming/vs_diloco_final", relative_difference(c["diloco"], c["streaming"]))
    peak = _record(figures, "streaming/peak_bytes_per_sync_over_diloco",
                   ratio(c["diloco"], c["streaming"], peak_bytes_per_sync))
    return (f"sends {times(peak)} DiLoCo's peak bytes per sync (a quarter of the model at a time) and reaches "
            f"DiLoCo's final loss {times(fast)} sooner on a slow WAN; final {percent(diff)} against DiLoCo "
            f"({final(c['streaming'])} vs {final(c['diloco'])}); "
            + _ddp_clause(figures, "streaming", c["diloco"], "DiLoCo", c["streaming"], "Streaming", c["ddp"])
            + f" ({seeds_of(*c.values())}, {budget(c['diloco'])})")


DOCS = "docs/benchmarks.md"
ROWS = (
    TableRow("one site is consistently slower", "`a_edit` (time-budgeted inner loops); on this fast LAN plain `ddp` did better still",
             (("straggler", ("edit", "a_edit", "ddp")),), "a-edit-against-a-consistent-straggler-virtual-time",
             _straggler),
    TableRow("sites of uneven speed on a WAN, no one should wait", "`dips` (asynchronous buffered parameter server)",
             (("eta100", ("diloco", "dips", "dips-paper", "ddp")), ("eta200", ("diloco", "dips", "dips-paper"))),
             "asynchronous-vs-synchronous-on-the-di-ps-η-scenarios-virtual-time", _eta),
    TableRow("regions, each with several sites, slow links between regions", "`halos` (local + global parameter servers)",
             (("halos", ("halos", "halos-paper", "async_local_sgd", "diloco", "ddp")),),
             "halos-table-1-on-the-paper-topology-virtual-time-relative-time-to-loss", _halos),
    TableRow("noisy or low-quality data at some sites (loss spikes)", "`edit` (per-module pseudo-gradient penalty)",
             (("noisy", ("diloco", "edit", "ddp")),), "edit-on-noisy-data-loss-spikes-and-the-ablation-virtual-time",
             _noisy),
    TableRow("the link's peak bandwidth is the limit", "`streaming_diloco` (fragments, overlapped)",
             (("streaming", ("diloco", "streaming", "ddp")),),
             "streaming-diloco-and-cocodc-over-36-periods-with-the-workers-own-models-scored", _streaming),
)


def build(groups: Groups, kept: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    """The table (Markdown) and the figures behind it.

    ``kept`` maps a situation to a table line written by an earlier study (``readme_rows``): a row
    whose runs are missing here keeps that line unchanged, so a study of some rows (``ROWS=...``)
    updates those rows and leaves the others as they were. A row with neither is named in a note.
    """
    figures: dict[str, Any] = {}
    lines = ["| your situation | start with | what we measured (paired by seed: mean ± 95 % t half-width) |",
             "|---|---|---|"]
    skipped = []
    for row in ROWS:
        missing = row.missing(groups)
        if missing and kept and row.situation in kept:
            lines.append(kept[row.situation])
            continue
        if missing:
            skipped.append(f"{row.start_with} ({', '.join(missing)} not run)")
            continue
        text = row.write(groups, figures)
        lines.append(f"| {row.situation} | {row.start_with} | {text} ([{DOCS}]({DOCS}#{row.anchor})) |")
    if skipped:
        lines += ["", "Not in this table, because its runs are missing: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n", figures


def details(figures: dict[str, Any]) -> str:
    """Every paired figure behind the table, one line each: its per-seed values and the interval."""
    lines = ["| figure | seeds | per seed | mean ± 95 % half-width |", "|---|---|---|---|"]
    for key, f in figures.items():
        if "values" not in f:
            lines.append(f"| {key} | | {', '.join(f'{k} {v:.3f}' for k, v in f.items())} | |")
            continue
        per_seed = ", ".join("—" if v is None else f"{v:.4f}" for v in f["values"])
        i = f["interval"]
        mean = "—" if i is None else f"{i['mean']:.4f}" + ("" if i["half_width"] is None else f" ± {i['half_width']:.4f}")
        lines.append(f"| {key} | {', '.join(map(str, f['seeds']))} | {per_seed} | {mean} |")
    return "\n".join(lines) + "\n"


def readme_rows(text: str) -> dict[str, str]:
    """The measured rows already between the README's method-table markers, by situation (the
    first cell); empty when the README has no block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return {}
    situations = {row.situation for row in ROWS}
    rows = {}
    for line in text[start + len(BEGIN): end].splitlines():
        cells = line.split("|")
        if line.startswith("| ") and len(cells) > 2 and cells[1].strip() in situations:
            rows[cells[1].strip()] = line
    return rows


def replace_block(text: str, table: str) -> str:
    """``text`` with the lines between the method-table markers replaced by ``table``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"the README has no {BEGIN} ... {END} block")
    return text[: start + len(BEGIN)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the study directory of examples/method_table.sh")
    ap.add_argument("--readme", type=Path, help="write the table into this README's method-table block")
    args = ap.parse_args(argv)
    groups = load_groups(args.out)
    if not groups:
        print(f"{args.out}: no runs of the method-table study (expected {args.out}/<row>/runs)", file=sys.stderr)
        return 2
    kept = readme_rows(args.readme.read_text(encoding="utf-8")) if args.readme else {}
    table, figures = build(groups, kept)
    reused = [row.situation for row in ROWS if row.missing(groups) and row.situation in kept]
    if reused:
        print("kept from the README (no runs for them in this study): " + "; ".join(reused), file=sys.stderr)
    (args.out / "method_table.md").write_text(table, encoding="utf-8")
    (args.out / "method_table.json").write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    (args.out / "method_table_details.md").write_text(details(figures), encoding="utf-8")
    print(table, end="")
    if args.readme:
        args.readme.write_text(replace_block(args.readme.read_text(encoding="utf-8"), table), encoding="utf-8")
        print(f"wrote the table into {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
