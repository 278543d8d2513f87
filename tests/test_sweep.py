"""``fl-geo sweep``: the grid of swept keys, validated up front; two values give two runs and one table."""

from __future__ import annotations

import json

import pytest

from fl_geo.cli import main
from fl_geo.errors import ConfigError
from fl_geo.sweep import expand_grid, split_values, sweep_points
from tests.conftest import TINY


def test_split_values_keeps_brackets_and_quotes_whole() -> None:
    assert split_values("0.3,0.5") == ["0.3", "0.5"]
    assert split_values("[a.txt,b.txt]") == ["[a.txt,b.txt]"]
    assert split_values("[a,b],[c]") == ["[a,b]", "[c]"]
    assert split_values("'x,y',z") == ["'x,y'", "z"]


def test_grid_is_the_product_in_the_order_given() -> None:
    grid = expand_grid(["a=1,2", "b=x", "c=3,4"])
    assert grid == [["b=x", "a=1", "c=3"], ["b=x", "a=1", "c=4"], ["b=x", "a=2", "c=3"], ["b=x", "a=2", "c=4"]]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["a=1"], "needs at least one swept key"),
        (["a=1,"], "an empty value between commas"),
        (["a=1,2", "a=3,4"], "'a' is swept twice"),
        (["nokey"], "is not of the form key=value"),
    ],
)
def test_bad_grids_are_config_errors(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        expand_grid(overrides)


def test_every_point_is_validated_before_any_run(tmp_path) -> None:
    with pytest.raises(ConfigError, match="strategy.outer_lr"):
        sweep_points(None, [*TINY, "strategy.outer_lr=0.5,-1"])
    points = sweep_points(None, [*TINY, "run.name=s", "strategy.outer_lr=0.5,0.9", "strategy.inner_steps=2,3"])
    assert [p.cfg.run.name for p in points] == ["s-outer_lr=0.5-inner_steps=2", "s-outer_lr=0.5-inner_steps=3",
                                                "s-outer_lr=0.9-inner_steps=2", "s-outer_lr=0.9-inner_steps=3"]
    assert [(p.cfg.strategy.outer_lr, p.cfg.strategy.inner_steps) for p in points] == [
        (0.5, 2), (0.5, 3), (0.9, 2), (0.9, 3)]


def test_sweep_of_two_values_gives_two_runs_and_one_table(tmp_path, capsys) -> None:
    out = tmp_path / "sweep"
    assert main(["sweep", *TINY, "run.name=lr", "strategy.outer_lr=0.3,0.9", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| lr-")]
    assert [row.split(" | ")[0] for row in rows] == ["| lr-outer_lr=0.3", "| lr-outer_lr=0.9"]
    assert (out / "compare.md").read_text().strip() == captured.out.strip()
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["lr-outer_lr=0.3", "lr-outer_lr=0.9"]
    finals = [json.loads((out / "runs" / n / "summary.json").read_text())["final_val_loss"]
              for n in ("lr-outer_lr=0.3", "lr-outer_lr=0.9")]
    assert finals[0] != finals[1]  # the swept value reached the runs
    assert "sweep 2/2: lr-outer_lr=0.9 (strategy.outer_lr=0.9)" in captured.err
    assert (out / "val_loss_vs_tokens.png").is_file()
