"""Seeds as an axis of `fl-geo compare` / `sweep`: the t quantile, the interval against hand
computations, the overlap wording, the group summary, and one real tiny ``compare --seeds 2``."""

from __future__ import annotations

import json
import math

import pytest

from fl_geo.cli import main as cli_main
from fl_geo.compare import compare, load_run, markdown_table
from fl_geo.config import load_config
from fl_geo.errors import ConfigError
from fl_geo.intervals import student_t_cdf, t_interval, t_quantile
from fl_geo.seed_groups import group_by_seed_suffix, group_summary, mean_band, seeded_configs
from fl_geo.seed_report import seeds_table, verdicts
from tests.conftest import TINY
from tests.test_compare import _fake_run

T_975_2 = 4.302653  # t_{0.975, 2}: the 95 % interval of three values


@pytest.mark.parametrize(("p", "df", "expected"), [
    (0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 3, 3.182446), (0.975, 10, 2.228139),
    (0.975, 30, 2.042272), (0.975, 31, 2.039513), (0.975, 100, 1.983972), (0.995, 5, 4.032143),
    (0.95, 4, 2.131847), (0.975, 10**7, 1.959964),
])
def test_t_quantile_matches_published_values(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=2e-6)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=2e-6)  # symmetric


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.999])
def test_t_quantile_matches_the_closed_forms_of_df_1_and_2(p):
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)  # Cauchy
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)
    assert student_t_cdf(t_quantile(p, 7), 7) == pytest.approx(p, abs=1e-12)


def test_t_quantile_rejects_probabilities_outside_0_1():
    with pytest.raises(ValueError, match="p must be in"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_cdf(1.0, 0)


def test_interval_of_three_values_by_hand():
    iv = t_interval([1.0, 2.0, 3.0])  # s = 1
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half_width == pytest.approx(T_975_2 / math.sqrt(3), rel=1e-6)
    assert (iv.low, iv.high) == pytest.approx((2.0 - 2.484138, 2.0 + 2.484138), abs=1e-6)
    one = t_interval([1.5])
    assert one.half_width is None and (one.low, one.high) == (1.5, 1.5)
    with pytest.raises(ValueError, match="two intervals"):
        one.overlaps(iv)
    assert iv.overlaps(t_interval([4.0, 4.1, 4.2]))  # [-0.48, 4.48] reaches [3.85, 4.35]
    assert not t_interval([2.9, 3.0, 3.1]).overlaps(t_interval([4.0, 4.1, 4.2]))


def _seeded_fakes(tmp_path, groups):
    """Fake finished runs ``<name>-seed=<k>`` whose final val loss is each given value."""
    tmp_path.mkdir(exist_ok=True)
    runs = []
    for name, finals in groups:
        for k, final in enumerate(finals):
            label = f"{name}-seed={k}" if len(finals) > 1 else name
            runs.append(load_run(_fake_run(tmp_path, label, [5.0, final])))
    return runs


def test_seeded_table_shows_mean_and_half_width_and_n1_alone(tmp_path):
    runs = _seeded_fakes(tmp_path, [("A", [1.0, 2.0, 3.0]), ("B", [2.9, 3.0, 3.1]), ("D", [3.5])])
    groups = group_by_seed_suffix(runs)
    assert [(g.name, g.n) for g in groups] == [("A", 3), ("B", 3), ("D", 1)]
    result = compare(runs, tmp_path / "out", None, groups)
    table = result["table"]
    assert "95 % Student-t interval" in table.splitlines()[0]
    assert "| A | diloco | global | n=3 | — | 2.0000 ± 2.4841 | 100.0 ± 0.0 | 10.0 ± 0.0 |" in table
    assert "| B | diloco | global | n=3 | — | 3.0000 ± 0.2484 |" in table  # s = 0.1
    assert "| D | diloco | global | n=1 | — | 3.5000 | 100.0 | 10.0 |" in table  # one run: no interval
    assert "Per seed:" in table and "| A-seed=2 | diloco | global | 3.0000 |" in table
    assert (tmp_path / "out" / "compare.md").read_text() == table + "\n"
    assert [g["n"] for g in json.loads((tmp_path / "out" / "summary.json").read_text())["groups"]] == [3, 3, 1]
    for kind in ("virtual", "wall", "tokens", "steps"):  # mean + band plots
        assert (tmp_path / "out" / result["plots"][kind].split("/")[-1]).read_bytes()[:4] == b"\x89PNG"


def test_the_budget_in_tokens_per_parameter_per_group(tmp_path):
    runs = _seeded_fakes(tmp_path, [("A", [1.0, 2.0, 3.0]), ("B", [2.9, 3.0]), ("D", [3.5])])
    for r in runs:  # each fake trained on 1,000 tokens
        r.summary["num_params"] = {"A": 50, "B": 400, "D": 3}[r.name.split("-")[0]]
    runs[3].summary["num_params"] = 500  # B's seeds differ: the range is shown
    del runs[5].summary["num_params"]  # D's summary lacks it
    table = seeds_table(group_by_seed_suffix(runs), 3.5)
    assert "| A | diloco | global | n=3 | 20.00 | " in table
    assert "| B | diloco | global | n=2 | 2.00–2.50 | " in table
    assert "| D | diloco | global | n=1 | — | " in table
    summary = group_summary(group_by_seed_suffix(runs), 3.5, [])
    assert [r["tokens_per_param"] for r in summary["groups"][1]["runs"]] == [2.0, 2.5]
    assert summary["groups"][2]["runs"][0]["tokens_per_param"] is None


def test_overlapping_intervals_name_no_winner_and_disjoint_ones_do(tmp_path):
    runs = _seeded_fakes(tmp_path, [("A", [1.0, 2.0, 3.0]), ("B", [2.9, 3.0, 3.1]), ("D", [3.5])])
    lines = verdicts(group_by_seed_suffix(runs), 3.5)  # (compare() passes its target; here the worst final)
    assert "final val loss: A and B: intervals overlap, no winner (2.0000 ± 2.4841 vs 3.0000 ± 0.2484)" in lines
    assert "final val loss: A and D: n=1 for D, no interval, no winner (2.0000 ± 2.4841 vs 3.5000)" in lines
    assert not any("than" in line for line in lines)  # every figure overlaps here: no winner at all
    close = _seeded_fakes(tmp_path / "2", [("C", [4.0, 4.1, 4.2]), ("B", [2.9, 3.0, 3.1])])
    lines = verdicts(group_by_seed_suffix(close), 4.2)
    assert "final val loss: B lower than C, intervals disjoint (3.0000 ± 0.2484 vs 4.1000 ± 0.2484)" in lines
    assert "wall s to 4.200: C and B: intervals overlap, no winner (10.0 ± 0.0 vs 10.0 ± 0.0)" in lines  # a tie: the first group leads


def test_a_seed_that_misses_the_target_leaves_the_group_without_a_mean(tmp_path):
    runs = _seeded_fakes(tmp_path, [("A", [1.0, 2.0, 3.0]), ("B", [2.9, 3.0, 3.1])])
    groups = group_by_seed_suffix(runs)
    assert "| A | diloco | global | n=3 | — | 2.0000 ± 2.4841 | — (2/3 seeds) | — (2/3 seeds) |" in seeds_table(groups, 2.5)
    lines = verdicts(groups, 2.5)
    assert "wall s to 2.500: A not compared (only 2/3 seeds have it)" in lines
    summary = group_summary(groups, 2.5, lines)
    assert summary["groups"][0]["aggregate"]["wall_s_to_target"] is None
    assert [r["figures"]["wall_s_to_target"] for r in summary["groups"][0]["runs"]] == [10.0, 10.0, None]


def test_summary_keeps_every_seed_and_the_aggregate(tmp_path):
    runs = _seeded_fakes(tmp_path, [("A", [1.0, 2.0, 3.0])])
    (runs[1].path / "config.yaml").write_text("run:\n  seed: 8\n")
    summary = json.loads(json.dumps(group_summary(group_by_seed_suffix(runs), 3.0, [])))  # JSON-ready
    (group,) = summary["groups"]
    assert group["n"] == 3 and group["seeds"] == [None, 8, None]
    assert [r["figures"]["final"] for r in group["runs"]] == [1.0, 2.0, 3.0]
    agg = group["aggregate"]["final"]
    assert agg["mean"] == 2.0 and agg["half_width"] == pytest.approx(T_975_2 / math.sqrt(3), rel=1e-6)
    assert (agg["min"], agg["max"], agg["n"]) == (1.0, 3.0, 3)
    assert "Student-t" in summary["interval"] and summary["target"] == 3.0


def test_one_seed_per_config_keeps_the_per_run_table(tmp_path):
    runs = [load_run(_fake_run(tmp_path, n, [5.0, f])) for n, f in (("a", 2.0), ("b-seed=3", 2.5))]
    result = compare(runs, tmp_path / "out", None, group_by_seed_suffix(runs))
    assert result["table"] == markdown_table(runs, 2.5) and result["verdicts"] == []
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["groups"][1]["n"] == 1


def test_mean_band_interpolates_onto_the_common_range():
    xs, mean, low, high = mean_band([([0.0, 10.0, 20.0], [5.0, 3.0, 1.0]), ([0.0, 5.0, 15.0], [5.0, 4.0, 2.0])])
    assert list(xs) == [0.0, 5.0, 10.0, 15.0]  # 20 lies outside the second curve
    assert list(low) == [5.0, 4.0, 3.0, 2.0] and list(high) == [5.0, 4.0, 3.0, 2.0]
    xs, mean, low, high = mean_band([([0.0, 10.0], [4.0, 2.0]), ([0.0, 10.0], [6.0, 4.0])])
    assert list(mean) == [5.0, 3.0] and list(low) == [4.0, 2.0] and list(high) == [6.0, 4.0]
    assert mean_band([([0.0, 1.0], [1.0, 1.0]), ([2.0, 3.0], [1.0, 1.0])]) is None  # no common range


def test_seeded_configs_count_up_from_the_configs_own_seed():
    cfg = load_config(None, [*TINY, "run.name=x", "run.seed=5"])
    assert seeded_configs(cfg, 1) == [cfg]
    three = seeded_configs(cfg, 3)
    assert [(c.run.seed, c.run.name) for c in three] == [(5, "x-seed=5"), (6, "x-seed=6"), (7, "x-seed=7")]
    assert (cfg.run.seed, cfg.run.name) == (5, "x")  # copies: the config itself is unchanged
    with pytest.raises(ConfigError, match="--seeds must be >= 1"):
        seeded_configs(cfg, 0)


def test_seeds_without_configs_and_seeds_with_a_swept_seed_are_user_errors(tmp_path, capsys):
    old = _fake_run(tmp_path, "old", [5.0, 3.0])
    assert cli_main(["compare", "--runs", str(old), "--seeds", "2", "--out", str(tmp_path / "c")]) == 2
    assert "--seeds runs each config N times" in capsys.readouterr().err
    assert cli_main(["sweep", *TINY, "run.seed=0,1", "--seeds", "2", "--out", str(tmp_path / "s")]) == 2
    assert "run.seed is swept and --seeds is given" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before any run


def test_cli_compare_with_two_seeds_runs_both_and_keeps_both(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli_main(["compare", "configs/quickstart_diloco.yaml", *TINY, "--seeds", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    base = load_config("configs/quickstart_diloco.yaml", TINY).run.seed
    names = [f"quickstart-diloco-seed={base}", f"quickstart-diloco-seed={base + 1}"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == names
    seeds = [load_config(str(out / "runs" / n / "config.yaml")).run.seed for n in names]
    assert seeds == [base, base + 1]
    summary = json.loads((out / "summary.json").read_text())
    (group,) = summary["groups"]
    assert group["name"] == "quickstart-diloco" and group["n"] == 2 and group["seeds"] == seeds
    finals = [r["figures"]["final"] for r in group["runs"]]
    assert [r["name"] for r in group["runs"]] == names and None not in finals
    assert finals[0] != finals[1]  # another seed: another initial model and other batches
    assert group["aggregate"]["final"]["mean"] == pytest.approx(sum(finals) / 2)
    assert group["aggregate"]["final"]["half_width"] == pytest.approx(
        t_quantile(0.975, 1) * abs(finals[0] - finals[1]) / 2, rel=1e-9)  # n = 2: s / √2 = |a - b| / 2
    assert "| quickstart-diloco | diloco (nesterov) | global | n=2 | " in captured.out
    assert "seed 2/2 of quickstart-diloco" in captured.err


def test_sweep_with_two_seeds_gives_one_row_per_point(tmp_path, capsys):
    out = tmp_path / "sw"
    assert cli_main(["sweep", *TINY, "run.rounds=1", "run.name=lr", "strategy.outer_lr=0.3,0.9",
                     "--seeds", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "lr-outer_lr=0.3-seed=0", "lr-outer_lr=0.3-seed=1", "lr-outer_lr=0.9-seed=0", "lr-outer_lr=0.9-seed=1"]
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert [(g["name"], g["n"], g["seeds"]) for g in groups] == [("lr-outer_lr=0.3", 2, [0, 1]),
                                                                 ("lr-outer_lr=0.9", 2, [0, 1])]
    rows = [line for line in captured.out.splitlines() if line.startswith("| lr-outer_lr=") and "| n=2 |" in line]
    assert len(rows) == 2 and all(" ± " in row for row in rows)
