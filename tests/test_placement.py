"""Di-PS PS-placement cost model (fl_geo/timing/placement.py) and ``fl-geo place``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl_geo.cli import main
from fl_geo.scenario_files import load_scenario, scenario_from_dict
from fl_geo.timing.placement import (
    best_placement,
    place_from_scenario,
    placement_ranks,
    placement_scores,
)
from fl_geo.timing.scenario import ScenarioError
from tests.conftest import tiny_scenario_dict

# ---- the formula --------------------------------------------------------------------------------


def test_scores_match_a_hand_computed_example():
    # 3 candidates x 2 training clusters; p = (2, 1) steps/s.
    b = [[10.0, 1.0], [1.0, 10.0], [4.0, 4.0]]
    s = placement_scores(b, [2.0, 1.0])
    # 10*2 + 1*1 = 21; 1*2 + 10*1 = 12; 4*2 + 4*1 = 12
    assert s.dtype == torch.float64 and s.tolist() == [21.0, 12.0, 12.0]
    assert best_placement(b, [2.0, 1.0]) == 0
    # The slow cluster speeding up past the fast one moves the PS to it.
    assert best_placement(b, [1.0, 3.0]) == 1  # 13, 31, 16
    assert placement_ranks(s).tolist() == [1, 2, 2]


def test_accepts_tensors():
    s = placement_scores(torch.tensor([[1.0, 2.0]]), torch.tensor([3.0, 4.0]))
    assert s.tolist() == [11.0]


def test_ties_go_to_the_lowest_index():
    assert best_placement([[1.0, 2.0], [2.0, 1.0], [3.0, 3.0]], [1.0, 1.0]) == 2
    assert best_placement([[3.0, 3.0], [2.0, 4.0], [4.0, 2.0]], [1.0, 1.0]) == 0
    assert best_placement([[1.0]], [1.0]) == 0


def test_near_ties_from_summation_order_still_go_to_the_lowest_index():
    # Four symmetric regions (100 inside, 1 between), equal throughput 0.1: every candidate
    # scores 10.3 mathematically, but the matvec sums each row in its own order and the last
    # candidate comes out one ulp above the others (with this CPU's summation order; other
    # BLAS builds may round differently, so only the tolerant result is asserted).
    b = [[100.0 if i == j else 1.0 for j in range(4)] for i in range(4)]
    s = placement_scores(b, [0.1] * 4)
    assert placement_ranks(s).tolist() == [1, 1, 1, 1]
    assert best_placement(b, [0.1] * 4) == 0
    # A real difference well above the tolerance still counts.
    assert placement_ranks(torch.tensor([1.0, 1.0 + 1e-6, 0.5])).tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    ("b", "p", "match"),
    [
        ([[1.0, 2.0]], [1.0], "bandwidth is 1x2 .* throughput has 1 entries"),
        ([1.0, 2.0], [1.0, 1.0], "bandwidth must have 2 dimension"),
        ([[1.0, 2.0]], [[1.0, 1.0]], "throughput must have 1 dimension"),
        ([[1.0, math.nan]], [1.0, 1.0], r"bandwidth\[0, 1\] = nan"),
        ([[1.0, math.inf]], [1.0, 1.0], "finite and > 0"),
        ([[1.0, 0.0]], [1.0, 1.0], r"bandwidth\[0, 1\] = 0.0"),
        ([[1.0, 1.0]], [1.0, -2.0], r"throughput\[1\] = -2.0"),
        ([[1.0, 1.0]], [math.nan, 1.0], r"throughput\[0\] = nan"),
        (torch.empty(0, 2), [1.0, 1.0], "empty"),
        ([["a"]], [1.0], "numeric"),
    ],
)
def test_validation(b, p, match):
    with pytest.raises(ValueError, match=match):
        placement_scores(b, p)


# ---- from a scenario ----------------------------------------------------------------------------


def _three_region_yaml(tmp_path):
    """W (server), X, Y: node 0 in W at speed 1, nodes 1-2 in X at speed 2, node 3 in Y at 0.5.

    1 s per step at speed 1, so p = (1, 2, 2, 0.5) steps/s. Links (Gbit/s, symmetric):
    W-W 100, X-X 50, Y-Y 20, W-X 5, W-Y 2, X-Y 1.
    """
    text = """\
name: three
server_region: W
regions: [W, X, Y]
links:
  bandwidth_gbps:  # upper triangle, regions order W, X, Y
    - [100.0, 5.0, 2.0]
    - [50.0, 1.0]
    - [20.0]
model: {step_time_s: 1.0}
nodes:
  - {region: W, name: w}
  - {region: X, speed: 2.0}
  - {region: X, speed: 2.0}
  - {region: Y, speed: 0.5}
"""
    path = tmp_path / "three.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# W: 100*1 + 5*2 + 5*2 + 2*0.5 = 121; X: 5*1 + 50*2 + 50*2 + 1*0.5 = 205.5;
# Y: 2*1 + 1*2 + 1*2 + 20*0.5 = 16
THREE_SCORES = [121.0, 205.5, 16.0]


def test_place_from_scenario_file(tmp_path):
    pl = place_from_scenario(load_scenario(_three_region_yaml(tmp_path)))
    assert pl.candidates == ["W", "X", "Y"]
    assert pl.scores == pytest.approx(THREE_SCORES)
    assert pl.ranks == [2, 1, 3]
    assert (pl.best, pl.best_index, pl.server_region, pl.matches) == ("X", 1, "W", False)
    assert pl.throughput == pytest.approx([1.0, 2.0, 2.0, 0.5])
    assert pl.nodes == ["w", "node-1", "node-2", "node-3"]
    assert pl.node_regions == ["W", "X", "X", "Y"]
    assert pl.bandwidth[0] == [100.0, 5.0, 5.0, 2.0]


def test_candidates_subset_and_order(tmp_path):
    s = load_scenario(_three_region_yaml(tmp_path))
    pl = place_from_scenario(s, ["Y", "W"])
    assert pl.scores == pytest.approx([16.0, 121.0])
    assert (pl.best, pl.matches) == ("W", True)


def test_eta_slowdown_and_asymmetric_links_enter_the_model():
    # tiny: A -> B 8, B -> A 4 Gbit/s; A-A 80, B-B 40; node speeds 1 (A), 2 and 0.5 (B).
    # The PS-to-cluster direction is used: row A = (80, 8, 8), row B = (4, 40, 40).
    s = scenario_from_dict(tiny_scenario_dict())
    pl = place_from_scenario(s)
    assert pl.scores == pytest.approx([80 * 1 + 8 * 2 + 8 * 0.5, 4 * 1 + 40 * 2 + 40 * 0.5])
    assert pl.best == "B"
    # eta = 100 % over 3 nodes: multipliers 1, 1.5, 2 -> speeds 1, 4/3, 0.25.
    slow = scenario_from_dict(tiny_scenario_dict(heterogeneity={"eta_percent": 100.0}))
    assert place_from_scenario(slow).throughput == pytest.approx([1.0, 4 / 3, 0.25])


def test_scenario_errors(tmp_path):
    s = load_scenario(_three_region_yaml(tmp_path))
    with pytest.raises(ScenarioError, match="unknown candidate region 'Q'; regions: W, X, Y"):
        place_from_scenario(s, ["W", "Q"])
    with pytest.raises(ScenarioError, match="repeated: W"):
        place_from_scenario(s, ["W", "W"])
    with pytest.raises(ScenarioError, match="no candidate"):
        place_from_scenario(s, [])
    inf = scenario_from_dict(tiny_scenario_dict(links={"bandwidth_gbps": [[math.inf, 8.0], [4.0, 40.0]]}))
    with pytest.raises(ScenarioError, match="A -> A has infinite bandwidth"):
        place_from_scenario(inf)


def test_shipped_dips_scenario_picks_the_fastest_cluster():
    pl = place_from_scenario(load_scenario("dips_eta100"))
    # p = 1/0.6, 1/0.8, 1/1.0, 1/1.2; every inter-region link 10, intra-cluster 1600, ps-ps 100.
    p = [1 / 0.6, 1 / 0.8, 1.0, 1 / 1.2]
    assert pl.scores[0] == pytest.approx(10 * sum(p))
    assert pl.scores[1] == pytest.approx(1600 * p[0] + 10 * sum(p[1:]))
    assert (pl.best, pl.server_region, pl.ranks) == ("c0", "ps", [5, 1, 2, 3, 4])


# ---- the CLI ------------------------------------------------------------------------------------


def test_cli_table(tmp_path, capsys):
    assert main(["place", str(_three_region_yaml(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "scenario three: 4 training clusters" in out
    assert "w (W) 1, node-1 (X) 2, node-2 (X) 2, node-3 (Y) 0.5" in out
    assert "| W | 121 | 2 | current server_region |" in out
    assert "| X | 205.5 | 1 | chosen |" in out
    assert "| Y | 16 | 3 |  |" in out
    assert "chosen: X; scenario server_region: W (differs)" in out


def test_cli_candidates_and_match(tmp_path, capsys):
    assert main(["place", str(_three_region_yaml(tmp_path)), "--candidates", "W, Y"]) == 0
    out = capsys.readouterr().out
    assert "| W | 121 | 1 | chosen, current server_region |" in out
    assert "| X |" not in out
    assert "chosen: W; scenario server_region: W (matches)" in out
    assert main(["place", str(_three_region_yaml(tmp_path)), "--candidates", "Y"]) == 0
    assert "(differs, not among the candidates)" in capsys.readouterr().out


def test_cli_json(tmp_path, capsys):
    assert main(["place", str(_three_region_yaml(tmp_path)), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["candidates"] == ["W", "X", "Y"]
    assert data["scores"] == pytest.approx(THREE_SCORES)
    assert data["ranks"] == [2, 1, 3]
    assert (data["best"], data["server_region"], data["matches"]) == ("X", "W", False)
    assert data["bandwidth"][1] == [5.0, 50.0, 50.0, 1.0]


def test_cli_by_scenario_name(capsys):
    assert main(["place", "halos_4x4"]) == 0
    out = capsys.readouterr().out
    assert "scenario halos_4x4: 16 training clusters" in out
    assert "chosen: R-2; scenario server_region: R-1 (differs)" in out


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["place", str(_three_region_yaml(tmp_path)), "--candidates", "W,nowhere"]) == 2
    assert "unknown candidate region 'nowhere'" in capsys.readouterr().err
    assert main(["place", "no_such_scenario"]) == 2
    assert "not found" in capsys.readouterr().err


def test_with_a_modelled_model_each_candidate_shows_the_slowest_round_trip(tmp_path, capsys):
    """The cost model the loops use times the model's trip both ways: 1 M fp32 parameters are
    32 Mbit, so W -> Y at 2 Gbit/s takes 16 ms each way, X <-> Y at 1 Gbit/s 32 ms."""
    path = _three_region_yaml(tmp_path)
    path.write_text(path.read_text().replace("model: {step_time_s: 1.0}", "model: {step_time_s: 1.0, num_params: 1000000}"))
    pl = place_from_scenario(load_scenario(path))
    assert pl.round_trip_s == pytest.approx([2 * 32e6 / 2e9, 2 * 32e6 / 1e9, 2 * 32e6 / 1e9])
    assert pl.scores == pytest.approx(THREE_SCORES)  # the demand score does not depend on it
    assert main(["place", str(path)]) == 0
    assert "| W | 121 | 2 | current server_region | 0.032 |" in capsys.readouterr().out
    path.write_text(path.read_text().replace(", num_params: 1000000", ""))
    assert place_from_scenario(load_scenario(path)).round_trip_s is None
