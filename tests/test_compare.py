"""The comparison tool on real (tiny) runs and on hand-made metrics."""

from __future__ import annotations

import json

import pytest

from fl_geo.cli import main as cli_main
from fl_geo.compare import compare, default_target, load_run, loss_range, markdown_table
from fl_geo.errors import ConfigError


def _fake_run(tmp_path, name, losses, virtual=True, worker_losses=None, steps=25):
    d = tmp_path / name
    d.mkdir()
    rows = []
    for i, loss in enumerate(losses):
        row = {"step": i, "time/wall_s": 10.0 * i, "train/tokens": 1000 * i, "val/loss": loss}
        if i:
            row["train/inner_steps"] = steps
            row["outer/step"] = i
        else:
            row["outer/step"] = 0
        if virtual:
            row["time/virtual_s"] = 100.0 * i
        if worker_losses is not None and i:
            row["val/worker_loss"] = worker_losses[i - 1]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"name": name, "strategy": "diloco", "tokens": 1000 * (len(losses) - 1),
                                                "bytes_up": 2e6, "bytes_down": 2e6, "rejected": 1}))
    return d


def test_time_to_target_is_read_at_evaluation_points(tmp_path):
    a = load_run(_fake_run(tmp_path, "a", [5.0, 3.0, 2.0, 1.5]))
    b = load_run(_fake_run(tmp_path, "b", [5.0, 4.0, 2.5, 1.9], virtual=False))
    assert default_target([a, b]) == 1.9  # the worst final loss: every run reaches it
    assert a.first_reaching(2.0, "time/virtual_s") == 200.0
    assert a.first_reaching(2.0, "time/wall_s") == 20.0
    assert a.first_reaching(2.0, "train/tokens") == 2000
    assert b.first_reaching(1.0, "time/wall_s") is None
    diverged = load_run(_fake_run(tmp_path, "c", [5.0, 9.0, 40.0]))
    assert default_target([a, b, diverged]) == 1.9  # a diverged run sets no target
    assert a.first_reaching(2.0, "steps") == 50  # two logged steps of 25 inner steps per worker
    table = markdown_table([a, b], 2.0)
    assert "| a | diloco | global | 1.5000 | 50 | 200.0 | 20.0 | 2,000 |" in table
    assert "| b | diloco | global | 1.9000 | 75 | — | 30.0 | 3,000 |" in table  # no virtual clock in run b
    assert table.splitlines()[2].endswith("| 1 | 0.000 | — |")  # never rose: no spike; no goodput in summary


def test_tokens_per_parameter_column(tmp_path):
    a = load_run(_fake_run(tmp_path, "a", [5.0, 3.0, 2.0, 1.5]))  # 3,000 tokens
    b = load_run(_fake_run(tmp_path, "b", [5.0, 4.0]))
    a.summary["num_params"] = 150
    b.summary["num_params"] = 0  # not a parameter count: no figure rather than a division by zero
    assert a.tokens_per_param == 20.0 and b.tokens_per_param is None
    lines = markdown_table([a, b], 4.0).splitlines()
    assert "| total tokens | tokens / param | MB up |" in lines[0]
    assert "| 3,000 | 20.00 | 2.0 |" in lines[2] and "| 1,000 | — | 2.0 |" in lines[3]


def test_a_run_without_a_summary_is_marked_unfinished_in_both_tables(tmp_path):
    """A run still going (or killed) has metrics.jsonl but no summary.json: its figures are partial,
    so the tables say so instead of ranking it as if it had ended."""
    from fl_geo.seed_groups import group_by_seed_suffix
    from fl_geo.seed_report import seeds_table

    done = load_run(_fake_run(tmp_path, "a-seed=0", [5.0, 3.0, 2.0]))
    going_dir = _fake_run(tmp_path, "a-seed=1", [5.0, 3.5])
    (going_dir / "summary.json").unlink()
    going = load_run(going_dir)
    assert going.unfinished and not done.unfinished
    table = markdown_table([done, going], 3.5)
    assert "| a-seed=1 UNFINISHED |" in table and "- a-seed=1 UNFINISHED: no summary.json" in table
    assert "| a-seed=0 |" in table
    seeds = seeds_table(group_by_seed_suffix([done, going]), 3.5)
    assert "| a UNFINISHED (1/2) |" in seeds and "- a-seed=1 UNFINISHED" in seeds


def test_goodput_column_and_breakdown_plot(tmp_path):
    a = load_run(_fake_run(tmp_path, "a", [5.0, 3.0]))
    b = load_run(_fake_run(tmp_path, "b", [5.0, 3.5]))
    a.summary.update(goodput=0.4, goodput_s={"provisioned": 10.0, "useful": 4.0, "comm": 1.0, "waiting": 3.0,
                                               "lost": 2.0, "rejected": 0.0, "stale": 0.0, "in_flight": 0.0})
    lines = markdown_table([a, b], 4.0).splitlines()
    assert lines[0].endswith("| max spike | goodput |")
    assert lines[2].endswith("| 0.400 |") and lines[3].endswith("| — |")  # b: a wall-clock run has none
    result = compare([a, b], tmp_path / "out")
    assert (tmp_path / "out" / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plots"]["goodput"].endswith("goodput.png")
    assert "goodput" not in compare([b], tmp_path / "out2")["plots"]


def test_max_spike_is_the_largest_rise_between_evaluations(tmp_path):
    spiky = load_run(_fake_run(tmp_path, "s", [5.0, 3.0, 4.5, 2.0, 2.25, 1.8]))
    assert spiky.max_spike == pytest.approx(1.5)
    assert load_run(_fake_run(tmp_path, "one", [5.0])).max_spike is None
    assert "| 1.500 |" in markdown_table([spiky], 2.0)


def test_compare_writes_table_and_plots(tmp_path):
    runs = [load_run(_fake_run(tmp_path, n, ls)) for n, ls in (("a", [5, 3, 2]), ("b", [5, 4, 2.5]))]
    result = compare(runs, tmp_path / "out")
    assert (tmp_path / "out" / "compare.md").read_text().startswith("| run |")
    for kind in ("virtual", "wall", "tokens", "steps"):
        png = tmp_path / "out" / result["plots"][kind].split("/")[-1]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workers_loss_where_logged_global_elsewhere(tmp_path):
    """--loss workers reads val/worker_loss where a streaming run logged it, val/loss in runs
    that did not (the synchronous loops), and val/loss at the initial evaluation."""
    stream = _fake_run(tmp_path, "stream", [5.0, 4.0, 3.0, 2.5], worker_losses=[3.0, 2.2, 1.8])
    sync = _fake_run(tmp_path, "sync", [5.0, 3.0, 2.4, 2.0])
    g, w = load_run(stream), load_run(stream, "workers")
    assert g.final_loss == 2.5 and w.final_loss == 1.8
    assert w.series("steps") == ([0.0, 25.0, 50.0, 75.0], [5.0, 3.0, 2.2, 1.8])
    assert w.first_reaching(2.2, "steps") == 50 and g.first_reaching(2.2, "steps") is None
    s = load_run(sync, "workers")
    assert s.loss_key == "val/loss" and s.final_loss == 2.0
    assert default_target([w, s]) == 2.0
    table = markdown_table([w, s], 2.0)
    assert "| stream | diloco | workers | 1.8000 | 75 |" in table
    assert "| sync | diloco | global | 2.0000 | 75 |" in table
    with pytest.raises(ValueError, match="loss must be one of"):
        load_run(stream, "average")


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="not an fl-geo run"):
        load_run(tmp_path)


def test_cli_compare_runs_configs_and_reads_runs(tmp_path, capsys):
    from tests.conftest import TINY

    old = _fake_run(tmp_path, "old", [5.6, 4.0, 3.9])
    code = cli_main(["compare", "configs/quickstart_diloco.yaml", *TINY, "--runs", str(old), "--out", str(tmp_path / "cmp")])
    assert code == 0
    out = capsys.readouterr().out
    assert "quickstart-diloco" in out and "| old |" in out
    assert (tmp_path / "cmp" / "val_loss_vs_tokens.png").is_file()


def test_loss_range_leaves_out_the_untrained_first_point():
    low, high = loss_range([[5.55, 2.0, 1.8], [5.55, 1.9, 1.7]])
    assert (low, high) == pytest.approx((1.7 - 0.015, 2.0 + 0.015))
    assert loss_range([[5.55], [5.55]]) is None  # only the initial evaluation: matplotlib's default
    low, high = loss_range([[5.0, 2.0, 2.0]])
    assert low < 2.0 < high  # a flat curve still gets a visible range


def test_tensorboard_losses_also_against_virtual_time_and_tokens():
    from fl_geo.runtime.metrics import metrics_record, tensorboard_points

    record = metrics_record(3, 1.0, {"val/loss": 2.5, "train/loss": 2.7, "time/virtual_s": 3600.4,
                                     "train/tokens": 9000, "outer/accepted": 4, "comm/bytes_up": float("nan")})
    points = {(tag, x): val for tag, val, x in tensorboard_points(3, record)}
    assert points[("val/loss", 3)] == 2.5 and points[("outer/accepted", 3)] == 4
    assert points[("by_virtual_s/val/loss", 3600)] == 2.5 and points[("by_tokens/train/loss", 9000)] == 2.7
    assert not any(tag.startswith("comm/bytes_up") for tag, _ in points)  # NaN: JSONL null, not plotted
    wall = metrics_record(1, 1.0, {"val/loss": 2.0, "train/tokens": 10})
    assert not any(tag.startswith("by_virtual_s") for tag, _, _ in tensorboard_points(1, wall))


def test_a_torn_last_metrics_line_is_skipped_with_a_warning(tmp_path, caplog):
    """A run killed while appending leaves a prefix of its last record: readers keep every whole
    record before it and warn; a bad line in the middle is damage, a one-line error."""
    import logging

    from fl_geo.runtime.metrics import read_metrics

    d = _fake_run(tmp_path, "torn", [3.0, 2.5, 2.0])
    whole = read_metrics(d)
    with (d / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "time/wall_s": 30.0, "val/lo')  # no newline: the write was cut
    with caplog.at_level(logging.WARNING, logger="fl_geo"):
        assert read_metrics(d) == whole
        run = load_run(d)
    assert "skipping line 4, a torn last record" in caplog.text
    assert [r["step"] for r in run.rows] == [0, 1, 2] and run.final_loss == 2.0
    lines = (d / "metrics.jsonl").read_text().split("\n")
    (d / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:-5], *lines[2:]]))
    with pytest.raises(ConfigError, match="line 2 is not a metrics record"):
        load_run(d)
