"""Paired-by-seed ratios and differences (fl_geo/paired.py) and the README method table built from
them (examples/method_table_report.py), against hand computations on hand-made runs."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from fl_geo.compare import RunRecord
from fl_geo.paired import by_seed, inverse, ratio, relative_difference, speedup, worst_final
from fl_geo.seed_groups import SeedGroup

ROOT = Path(__file__).resolve().parents[1]
T975_2 = 4.302652729911275  # t_{0.975} with 2 degrees of freedom


def run(name: str, curve: list[tuple[float, float]], tokens: int = 1000, params: int = 100) -> RunRecord:
    """A finished run: (virtual s, val loss) at each evaluation; wall time = virtual time."""
    rows = [{"time/virtual_s": t, "time/wall_s": t, "val/loss": loss} for t, loss in curve]
    return RunRecord(name, Path("/nonexistent") / name, {"tokens": tokens, "num_params": params}, rows)


def group(name: str, curves: dict[int, list[tuple[float, float]]]) -> SeedGroup:
    return SeedGroup(name, [run(f"{name}-seed={s}", c) for s, c in curves.items()])


REF = group("ref", {0: [(0, 5.0), (10, 3.0), (20, 2.0)],    # final 2.0, reached at 20
                    1: [(0, 5.0), (10, 2.5), (30, 2.4)],    # final 2.4, reached at 30
                    2: [(0, 5.0), (40, 2.2)]})              # final 2.2, reached at 40
FAST = group("fast", {0: [(0, 5.0), (5, 1.9)],               # 2.0 first at 5: 20 / 5 = 4
                      1: [(0, 5.0), (10, 2.4), (15, 2.3)],   # 2.4 first at 10: 30 / 10 = 3
                      2: [(0, 5.0), (20, 2.1)]})             # 2.2 first at 20: 40 / 20 = 2


def test_speedup_is_the_per_seed_time_ratio_to_the_references_own_final_loss():
    stat = speedup(REF, FAST)
    assert stat.seeds == (0, 1, 2)
    assert stat.values == pytest.approx((4.0, 3.0, 2.0))
    assert stat.interval.mean == pytest.approx(3.0)
    assert stat.interval.half_width == pytest.approx(T975_2 * 1.0 / math.sqrt(3))  # s = 1


def test_a_seed_that_never_reaches_the_target_has_no_value_and_no_interval():
    slow = group("slow", {0: [(0, 5.0), (5, 1.9)], 1: [(0, 5.0), (10, 2.6)], 2: [(0, 5.0), (20, 2.1)]})
    stat = speedup(REF, slow)
    assert stat.values[1] is None and stat.present == 2 and stat.n == 3
    assert stat.interval is None


def test_only_seeds_both_groups_ran_are_paired():
    two = SeedGroup("two", [r for r in FAST.runs if not r.name.endswith("=1")])
    stat = speedup(REF, two)
    assert stat.seeds == (0, 2)
    assert stat.values == pytest.approx((4.0, 2.0))
    assert stat.interval.half_width == pytest.approx(12.706204736174705)  # t(0.975, 1) * sqrt(2) / sqrt(2)


def test_pairing_refuses_groups_without_a_common_seed_or_with_a_seed_twice():
    other = group("other", {7: [(0, 5.0), (1, 1.0)]})
    with pytest.raises(ValueError, match="share no seed"):
        speedup(REF, other)
    twice = SeedGroup("twice", [*FAST.runs, run("again-seed=0", [(0, 5.0)])])
    with pytest.raises(ValueError, match="two runs of seed 0"):
        by_seed(twice)
    with pytest.raises(ValueError, match="no run.seed"):
        by_seed(SeedGroup("x", [run("unseeded", [(0, 1.0)])]))


def test_relative_difference_of_final_losses_by_hand():
    stat = relative_difference(REF, FAST)  # finals: ref 2.0, 2.4, 2.2; fast 1.9, 2.3, 2.1
    expected = (1.9 / 2.0 - 1, 2.3 / 2.4 - 1, 2.1 / 2.2 - 1)
    assert stat.values == pytest.approx(expected)
    mean = sum(expected) / 3
    s = math.sqrt(sum((v - mean) ** 2 for v in expected) / 2)
    assert stat.interval.mean == pytest.approx(mean)
    assert stat.interval.half_width == pytest.approx(T975_2 * s / math.sqrt(3))


def test_worst_final_targets_the_highest_final_loss_of_the_seeds_runs():
    third = group("third", {0: [(0, 5.0), (50, 2.5)], 1: [(0, 5.0), (50, 2.5)], 2: [(0, 5.0), (50, 2.5)]})
    # seed 0's target 2.5: REF first at 10 (3.0 > 2.5, so at 20: 2.0), FAST at 5 -> 20 / 5
    stat = speedup(REF, FAST, worst_final, others=[third])
    assert stat.values[0] == pytest.approx(20 / 5)
    # seed 1's target 2.5: REF at 10 (2.5), FAST at 10 (2.4) -> 1
    assert stat.values[1] == pytest.approx(1.0)
    assert worst_final(REF.runs[0], [FAST.runs[0], third.runs[0]]) == 2.5


def test_inverse_inverts_each_seed_and_takes_the_interval_of_the_inverses():
    stat = inverse(speedup(REF, FAST))
    assert stat.values == pytest.approx((0.25, 1 / 3, 0.5))
    assert stat.interval.mean == pytest.approx((0.25 + 1 / 3 + 0.5) / 3)


def test_ratio_of_a_figure_per_seed_by_hand():
    stat = ratio(REF, FAST, lambda r: r.final_loss)  # finals: ref 2.0, 2.4, 2.2; fast 1.9, 2.3, 2.1
    expected = (1.9 / 2.0, 2.3 / 2.4, 2.1 / 2.2)
    assert stat.values == pytest.approx(expected)
    mean = sum(expected) / 3
    s = math.sqrt(sum((v - mean) ** 2 for v in expected) / 2)
    assert stat.interval.mean == pytest.approx(mean)
    assert stat.interval.half_width == pytest.approx(T975_2 * s / math.sqrt(3))
    # a seed whose figure is missing has no value, and the interval is over the others
    gaps = ratio(REF, FAST, lambda r: None if r.name.endswith("seed=1") else r.final_loss)
    assert gaps.values[1] is None and gaps.present == 2


def _report():
    """examples/method_table_report.py as a module (registered first: its dataclasses look it up)."""
    if "method_table_report" not in sys.modules:
        spec = importlib.util.spec_from_file_location("method_table_report", ROOT / "examples/method_table_report.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["method_table_report"]


def test_the_readme_row_is_built_from_the_paired_figures_and_missing_rows_are_named():
    report = _report()
    edit = SeedGroup("edit", REF.runs)
    a_edit = SeedGroup("a_edit", FAST.runs)
    ddp = SeedGroup("ddp", group("ddp", {0: [(0, 5.0), (40, 1.5)], 1: [(0, 5.0), (60, 1.6)],
                                         2: [(0, 5.0), (80, 1.7)]}).runs)
    table, figures = report.build({"straggler": {"edit": edit, "a_edit": a_edit, "ddp": ddp}})
    row = next(line for line in table.splitlines() if line.startswith("| one site is consistently slower"))
    assert "**3.00× ± 2.48 sooner**" in row
    assert "3 seeds, 10 tokens per parameter" in row
    assert figures["straggler/a_edit_speedup"]["values"] == pytest.approx([4.0, 3.0, 2.0])
    # ddp reaches EDiT's final loss at 40 / 20, 60 / 30, 80 / 40: twice EDiT's time on every seed
    assert figures["straggler/ddp_time_to_EDiT_final"]["interval"]["mean"] == pytest.approx(2.0)
    assert "2.00× ± 0.00 EDiT's virtual time" in row
    assert "`halos`" in table.split("runs are missing:")[1]  # the rows without runs are named
    assert "| straggler/a_edit_speedup | 0, 1, 2 | 4.0000, 3.0000, 2.0000 | 3.0000 ± 2.4841 |" in report.details(figures)


def test_the_streaming_row_gives_the_peak_bytes_per_sync_against_diloco_and_the_ddp_clause():
    report = _report()

    def with_bytes(g: SeedGroup, summary: dict, peaks: list[float] | None) -> SeedGroup:
        runs = []
        for r in g.runs:
            rows = [dict(row) for row in r.rows]
            for row, peak in zip(rows, peaks or [], strict=False):
                row["comm/peak_bytes_per_sync"] = peak
            runs.append(RunRecord(r.name, r.path, {**r.summary, **summary}, rows))
        return SeedGroup(g.name, runs)

    # DiLoCo: 18 syncs of 4 sites, 1,600 bytes per message (the whole model); Streaming's largest
    # fragment 400 bytes (its running maximum, as logged): a quarter on every seed
    diloco = with_bytes(SeedGroup("diloco", REF.runs), {"bytes_up": 18 * 4 * 1600, "accepted_updates": 72}, None)
    stream = with_bytes(SeedGroup("streaming", FAST.runs), {}, [300.0, 400.0, 400.0])
    ddp = SeedGroup("ddp", group("ddp", {0: [(0, 5.0), (40, 1.5)], 1: [(0, 5.0), (60, 1.6)],
                                         2: [(0, 5.0), (80, 1.7)]}).runs)
    assert report.peak_bytes_per_sync(diloco.runs[0]) == 1600.0
    assert report.peak_bytes_per_sync(stream.runs[0]) == 400.0
    table, figures = report.build({"streaming": {"diloco": diloco, "streaming": stream, "ddp": ddp}})
    row = next(line for line in table.splitlines() if line.startswith("| the link's peak bandwidth"))
    assert figures["streaming/peak_bytes_per_sync_over_diloco"]["values"] == pytest.approx([0.25, 0.25, 0.25])
    assert "sends 0.25× ± 0.00 DiLoCo's peak bytes per sync" in row
    assert "reaches DiLoCo's final loss 3.00× ± 2.48 sooner" in row
    assert "`ddp` ends at" in row and "2.00× ± 0.00 DiLoCo's virtual time" in row


def test_the_readme_holds_one_method_table_block_the_report_can_replace():
    report = _report()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    replaced = report.replace_block(text, "| a | b | c |\n")
    assert replaced.count("| a | b | c |") == 1
    assert replaced.split(report.BEGIN)[0] == text.split(report.BEGIN)[0]
    assert replaced.split(report.END)[1] == text.split(report.END)[1]


def test_a_study_of_some_rows_keeps_the_readmes_other_rows_and_replaces_its_own():
    report = _report()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split(report.BEGIN)[1].split(report.END)[0]
    old = ("| noisy or low-quality data at some sites (loss spikes) | `edit` | an earlier study's line |\n"
           "| one site is consistently slower | `a_edit` | an older straggler line |\n")
    text = readme.replace(block, "\n| your situation | start with | measured |\n|---|---|---|\n" + old)
    kept = report.readme_rows(text)
    noisy, straggler = old.splitlines()
    assert kept == {"noisy or low-quality data at some sites (loss spikes)": noisy,
                    "one site is consistently slower": straggler}  # each situation's whole line, verbatim
    ddp = SeedGroup("ddp", group("ddp", {0: [(0, 5.0), (40, 1.5)], 1: [(0, 5.0), (60, 1.6)]}).runs)
    groups = {"straggler": {"edit": SeedGroup("edit", REF.runs), "a_edit": SeedGroup("a_edit", FAST.runs), "ddp": ddp}}
    table, _ = report.build(groups, kept)
    lines = table.splitlines()
    assert noisy in lines  # no runs for it here: the README's line stays
    assert straggler not in lines  # its runs are here: rebuilt from them
    straggler = [line for line in lines if line.startswith("| one site is consistently slower")]
    assert len(straggler) == 1 and "**3.00× ± 2.48 sooner**" in straggler[0]
    note = table.split("runs are missing:")[1]
    assert "`halos`" in note and "`edit`" not in note  # only rows with neither runs nor a README line
    assert report.readme_rows("no block here") == {}


def _write_run(root: Path, name: str, curve: list[tuple[float, float]]) -> Path:
    """A finished run directory as fl-geo writes one (metrics.jsonl + summary.json)."""
    d = root / name
    d.mkdir(parents=True)
    rows = [{"time/virtual_s": t, "time/wall_s": t, "val/loss": loss, "outer/step": i}
            for i, (t, loss) in enumerate(curve)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"name": name, "strategy": "diloco", "tokens": 1000,
                                                "num_params": 100}))
    return d


def test_compare_reference_pairs_every_other_config_by_seed(tmp_path, capsys):
    from fl_geo.cli import main as cli_main

    dirs = [_write_run(tmp_path / "runs", r.name, list(zip(*r.series("time/virtual_s"), strict=True)))
            for r in (*REF.runs, *FAST.runs)]
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--runs", *map(str, dirs), "--reference", "ref", "--out", str(out)]) == 0
    text = (out / "compare.md").read_text()
    assert "Paired with ref by seed" in text
    assert "- fast: speed-up to ref's final loss in virtual time 3.00× ± 2.48; final loss −4.6 % ± 1.0 against ref (seeds 0, 1, 2)" in text  # by hand: (−5, −4.17, −4.55 %)
    paired = json.loads((out / "summary.json").read_text())["paired"]
    assert paired["reference"] == "ref"
    assert paired["groups"]["fast"]["speedup_to_reference_final"]["values"] == pytest.approx([4.0, 3.0, 2.0])
    assert cli_main(["compare", "--runs", *map(str, dirs), "--reference", "nope", "--out", str(out)]) == 2
    assert "--reference 'nope' is none of the compared configs: ref, fast" in capsys.readouterr().err
