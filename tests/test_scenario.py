"""Scenario loading, validation and the timing model (docs/algorithms.md §1, §6, §8), checked by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fl_geo.config import ConfigError
from fl_geo.scenario_files import (
    list_scenarios,
    load_scenario,
    scenario_from_dict,
    scenario_from_yaml_string,
    scenario_to_yaml,
)
from fl_geo.timing.scenario import (
    BYTES_PER_PARAM,
    Scenario,
    ScenarioError,
    payload_bytes,
    scenario_for_nodes,
)
from tests.conftest import tiny_scenario_dict

SCENARIO_FILES = sorted((Path(__file__).resolve().parents[1] / "configs" / "scenarios").glob("*.yaml"))


def tiny() -> Scenario:
    return scenario_from_dict(tiny_scenario_dict())


def four_regions(nodes_per_region: int = 1) -> Scenario:
    """W, X, Y, Z: W-X, X-Y, Y-Z 10; Z-W 1; W-Y, X-Z 5 Gbit/s; 100 inside (upper-triangle form)."""
    regions = ["W", "X", "Y", "Z"]
    return scenario_from_dict({
        "name": "four",
        "server_region": "W",
        "regions": regions,
        "links": {"bandwidth_gbps": [[100.0, 10.0, 5.0, 1.0], [100.0, 10.0, 5.0], [100.0, 10.0], [100.0]]},
        "model": {"step_time_s": 1.0},
        "nodes": [{"region": r} for r in regions for _ in range(nodes_per_region)],
    })


# ---- the shipped scenarios --------------------------------------------------------------------


def test_shipped_scenarios_are_found_by_name():
    assert {"dips_eta0", "dips_eta100", "dips_eta200", "halos_4x4", "lan_uniform"} <= set(list_scenarios())
    assert load_scenario("halos_4x4.yaml").name == "halos_4x4"


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=[p.stem for p in SCENARIO_FILES])
def test_every_shipped_scenario_loads_and_round_trips(path):
    s = load_scenario(path)
    assert s.name == path.stem
    back = scenario_from_yaml_string(scenario_to_yaml(s))
    assert back.to_dict() == s.to_dict()
    assert all(s.step_time(i) > 0 for i in range(s.num_nodes))


def test_halos_matches_the_paper_table_7():
    s = load_scenario("halos_4x4")
    assert s.num_nodes == 16 and s.server_region == "R-1"
    assert s.bandwidth_gbps("R-2", "R-4") == 0.117 and s.bandwidth_gbps("R-4", "R-2") == 0.117
    assert s.bandwidth_gbps("R-3", "R-3") == 100.0
    assert [s.node(i).speed for i in range(4)] == [10.0, 9.1, 3.8, 2.6]
    assert s.step_time(0) == pytest.approx(0.2384)  # the fastest worker takes the profiled time
    assert s.step_time(15) == pytest.approx(0.2384 * 10 / 1.2)
    assert s.payload_bytes("fp32") == 4 * 70_426_624
    # DynUpd with H = 8 as HALoS's --rescale_num_local_steps: max(1, ceil(8 * speed / 10)).
    assert [s.dynupd_steps(8, i) for i in range(16)] == [8, 8, 4, 3, 8, 7, 6, 5, 8, 5, 2, 2, 8, 7, 5, 1]
    ring = s.best_ring(list(range(16)))
    assert ring.bandwidth_gbps == 0.127 and ring.exact


def test_dips_eta_scenarios_spread_step_times():
    assert [load_scenario("dips_eta0").multiplier(i) for i in range(4)] == [1.0] * 4
    s = load_scenario("dips_eta100")
    assert [s.multiplier(i) for i in range(4)] == pytest.approx([1.0, 4 / 3, 5 / 3, 2.0])
    assert [s.step_time(i) for i in range(4)] == pytest.approx([0.6, 0.8, 1.0, 1.2])
    assert [load_scenario("dips_eta200").multiplier(i) for i in range(4)] == pytest.approx([1, 5 / 3, 7 / 3, 3])


def test_overrides_apply_on_top_of_the_file():
    s = load_scenario("dips_eta0", ["heterogeneity.eta_percent=100", "model.step_time_s=1.0"])
    assert [s.step_time(i) for i in range(4)] == pytest.approx([1.0, 4 / 3, 5 / 3, 2.0])


def test_a_repeated_load_is_a_copy_of_the_first_and_a_changed_file_is_read_again(tmp_path):
    """load_scenario keeps validated scenarios by file, text and overrides: a second load is an
    equal scenario of its own (its spec and caches are not the first one's), an override or a
    change of the file's text is a new load, and an error is never kept."""
    import yaml

    path = tmp_path / "s.yaml"
    data = tiny_scenario_dict()
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    first = load_scenario(path)
    again = load_scenario(path)
    assert again is not first and again.to_dict() == first.to_dict()
    assert again._spec is not first._spec and again._ring_cache is not first._ring_cache
    assert load_scenario(path, ["model.step_time_s=9.0"]).step_time(0) != first.step_time(0)
    data["model"]["step_time_s"] = 2 * data["model"]["step_time_s"]
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert load_scenario(path).step_time(0) == pytest.approx(2 * first.step_time(0))
    path.write_text("regions: 3\n", encoding="utf-8")
    for _ in range(2):  # the same bad file fails every time
        with pytest.raises(ScenarioError):
            load_scenario(path)


# ---- timing model ---------------------------------------------------------------------------------


def test_transfer_time_is_latency_plus_bits_over_bandwidth():
    s = tiny()
    assert s.transfer_time("A", "B", 10**9) == pytest.approx(0.5 + 8 / 8)
    assert s.transfer_time("B", "A", 10**9) == pytest.approx(0.25 + 8 / 4)  # asymmetric matrix
    assert s.transfer_time(1, 1, 5 * 10**8) == pytest.approx(4 / 40)  # by index, intra-region
    assert s.transfer_time("A", "B", 0) == 0.5


def test_job_time_by_hand():
    s = tiny()
    # node 1 (B, speed 2): down A->B 0.5 + 1 s, 10 steps x 0.5 s, up B->A 0.25 + 1 s.
    jt = s.job_time(1, 10, 10**9, 5 * 10**8)
    assert (jt.down, jt.compute, jt.up) == pytest.approx((1.5, 5.0, 1.25))
    assert jt.total == pytest.approx(7.75)
    # node 0 sits with the server: intra-region 80 Gbit/s both ways.
    assert s.job_time(0, 10, 10**9, 5 * 10**8).total == pytest.approx(0.1 + 10 + 0.05)
    # a HALoS-style job against a local server in the node's own region.
    assert s.job_time(2, 1, 10**9, 10**9, peer_region="B").total == pytest.approx(0.2 + 2.0 + 0.2)


def test_speed_reference_and_heterogeneity_compose():
    d = tiny_scenario_dict(model={"step_time_s": 2.0, "reference_speed": 4.0},
                  heterogeneity={"eta_percent": 100})
    s = scenario_from_dict(d)
    # multipliers over K = 3 nodes: 1, 1.5, 2; speed_i = base / multiplier.
    assert [s.multiplier(i) for i in range(3)] == pytest.approx([1.0, 1.5, 2.0])
    assert [s.speed(i) for i in range(3)] == pytest.approx([1.0, 2 / 1.5, 0.25])
    assert s.step_time(0) == pytest.approx(2.0 * 4.0 / 1.0)
    assert s.step_time(2) == pytest.approx(2.0 * 4.0 / 0.25)


def test_random_spread_is_seeded_bounded_and_prefix_stable():
    d = tiny_scenario_dict(heterogeneity={"eta_percent": 50, "spread": "random", "seed": 7})
    a, b = scenario_from_dict(d), scenario_from_dict(d)
    ma = [a.multiplier(i) for i in range(3)]
    assert ma == [b.multiplier(i) for i in range(3)]
    assert all(1.0 <= m <= 1.5 for m in ma) and len(set(ma)) == 3
    two = scenario_for_nodes(a, 2)
    assert [two.multiplier(i) for i in range(2)] == ma[:2]
    other = scenario_from_dict(tiny_scenario_dict(heterogeneity={"eta_percent": 50, "spread": "random", "seed": 8}))
    assert [other.multiplier(i) for i in range(3)] != ma


def test_dynupd_steps():
    s = tiny()  # speeds 1, 2, 0.5; max 2
    assert [s.dynupd_steps(10, i) for i in range(3)] == [5, 10, 3]  # ceil(10*.5), 10, ceil(2.5)
    assert s.dynupd_steps(1, 2) == 1  # never below one step
    with pytest.raises(ValueError):
        s.dynupd_steps(0, 0)


def test_time_budget_steps():
    s = tiny()  # node 1: 0.5 s/step
    assert s.time_budget_steps(1.0, 1) == 2
    assert s.time_budget_steps(1.1, 1) == 3  # the step that crosses the budget is finished
    assert s.time_budget_steps(0.0, 1) == 1
    lan = scenario_from_dict(tiny_scenario_dict(model={"step_time_s": 0.1}))
    assert lan.time_budget_steps(0.3, 0) == 3  # 0.3 / 0.1 = 2.9999999999999996
    assert lan.time_budget_steps(0.7, 0) == 7


def test_payload_bytes_per_precision():
    assert BYTES_PER_PARAM == {"fp32": 4, "fp16": 2, "bf16": 2}
    assert [payload_bytes(p, 10) for p in ("fp32", "fp16", "bf16")] == [40, 20, 20]
    s = tiny()  # models 1000 parameters: the trained model's count is ignored
    assert s.payload_bytes("bf16", num_params=7) == 2000
    lan = load_scenario("lan_uniform")  # models none: the trained model's count is used
    assert lan.payload_bytes("fp32", 123) == 492
    with pytest.raises(ScenarioError, match="does not set model.num_params"):
        lan.payload_bytes("fp32")
    with pytest.raises(ScenarioError, match="valid: fp32, fp16, bf16"):
        payload_bytes("int3", 1)


# ---- synchronous rounds --------------------------------------------------------------------------


def test_ring_allreduce_two_regions_by_hand():
    s = tiny()
    # nodes 0 (A), 1 (B): ring A->B->A, slowest link 4 Gbit/s, largest latency 0.5 s, M = 2.
    ring = s.best_ring([0, 1])
    assert (ring.bandwidth_gbps, ring.latency_s) == (4.0, 0.5)
    assert s.allreduce_time([0, 1], 10**9) == pytest.approx(2 * 1 * 0.5 + 2 * 1 / 2 * 8 / 4)
    # add node 2 (B): the B-B link (40) joins the ring; M = 3.
    assert s.allreduce_time([0, 1, 2], 10**9) == pytest.approx(2 * 2 * 0.5 + 2 * 2 / 3 * 8 / 4)
    assert s.allreduce_time([1], 10**9) == 0.0


def test_ring_allreduce_four_regions_picks_the_widest_ring():
    s = four_regions()
    # Rings from W: W-X-Y-Z 1, W-X-Z-Y 5, W-Y-X-Z 1, W-Y-Z-X 5 (and reverses): best slowest link 5.
    ring = s.best_ring([0, 1, 2, 3])
    assert ring.bandwidth_gbps == 5.0 and ring.exact
    nbytes = 1_250_000_000  # 10 Gbit
    assert s.allreduce_time([0, 1, 2, 3], nbytes) == pytest.approx(2 * 3 / 4 * 10 / 5)
    s2 = four_regions(nodes_per_region=2)
    assert s2.allreduce_time(list(range(8)), nbytes) == pytest.approx(2 * 7 / 8 * 10 / 5)
    # only W and X take part: ring W->X->W over the 10 Gbit/s link.
    assert s.allreduce_time([0, 1], nbytes) == pytest.approx(2 * 1 / 2 * 10 / 10)


def test_ring_within_one_region_uses_the_intra_region_link():
    lan = load_scenario("lan_uniform")
    assert lan.allreduce_time([0, 1, 2, 3], 1_250_000_000) == pytest.approx(2 * 3 / 4 * 10 / 100)


def test_many_regions_fall_back_to_a_heuristic_ring():
    n = 10
    bw = [[100.0 if i == j else (10.0 if abs(i - j) in (1, n - 1) else 1.0) for j in range(n)] for i in range(n)]
    regions = [f"r{i}" for i in range(n)]
    s = scenario_from_dict({
        "name": "wide", "server_region": "r0", "regions": regions, "links": {"bandwidth_gbps": bw},
        "model": {"step_time_s": 1.0}, "nodes": [{"region": r} for r in regions],
    })
    ring = s.best_ring(list(range(n)))
    assert not ring.exact and ring.bandwidth_gbps == 10.0  # greedy finds the 10 Gbit/s cycle here


def test_sync_round_times_by_hand():
    s = tiny()
    # compute: node 2 (speed .5) takes 20 s for 10 steps; all-reduce as above 2 + 8/3 s.
    assert s.sync_round_time([0, 1, 2], [10, 10, 10], 10**9) == pytest.approx(20 + 2 + 8 / 3)
    # parameter-server round: max of node 0: .1+10+.1, node 1: 1.5+5+2.25, node 2: 1.5+20+2.25.
    assert s.sync_round_time_ps([0, 1, 2], [10, 10, 10], 10**9, 10**9) == pytest.approx(23.75)
    with pytest.raises(ValueError, match="step counts"):
        s.sync_round_time([0, 1], [1], 10)
    with pytest.raises(ValueError, match="distinct"):
        s.sync_round_time([0, 0], [1, 1], 10)


# ---- node counts ------------------------------------------------------------------------------


def test_scenario_for_nodes_truncates_or_refuses():
    s = load_scenario("dips_eta100")
    two = scenario_for_nodes(s, 2)
    assert two.num_nodes == 2 and [two.multiplier(i) for i in range(2)] == [1.0, 2.0]  # η re-spread
    assert scenario_for_nodes(s, 4) is s
    with pytest.raises(ScenarioError, match="models 4 nodes but the run has 5"):
        scenario_for_nodes(s, 5)
    with pytest.raises(ScenarioError, match="nodes 0..1"):
        two.step_time(3)


def test_failures_are_validated_and_follow_truncation():
    d = tiny_scenario_dict(failures=[{"node": 2, "at_time": 10.0, "duration": 5.0}, {"node": 0, "at_time": 3.0}])
    s = scenario_from_dict(d)
    assert [(f.node, f.at_time, f.duration) for f in s.failures] == [(2, 10.0, 5.0), (0, 3.0, None)]
    assert [f.node for f in scenario_for_nodes(s, 2).failures] == [0]


# ---- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,needles",
    [
        ({"regoins": ["A"]}, ["unknown key 'regoins'", "did you mean 'regions'", "valid keys here: name"]),
        ({"nodes": [{"region": "A", "sped": 2}]}, ["unknown key 'nodes[0].sped'", "valid keys here: region, speed, name, accelerator"]),
        ({"links": {"bandwith_gbps": [[1.0]]}}, ["unknown key 'links.bandwith_gbps'", "bandwidth_gbps, latency_s"]),
        ({"nodes": [{"region": "A"}, {"region": "B", "speed": "fast"}]}, ["'nodes[1].speed'", "could not be converted"]),
        ({"nodes": [{"region": "A", "speed": -1}]}, ["nodes[0].speed must be a finite number > 0"]),
        ({"nodes": [{"region": "Q"}]}, ["nodes[0].region 'Q' is not one of the regions (A, B)"]),
        ({"server_region": "C"}, ["server_region 'C' is not one of the regions"]),
        ({"links": {"bandwidth_gbps": [[1.0, 2.0]]}}, ["links.bandwidth_gbps must be a 2x2 matrix"]),
        ({"links": {"bandwidth_gbps": [[1.0, 0.0], [1.0, 1.0]]}}, ["links.bandwidth_gbps[0][1] (region 0 -> 1) must be > 0"]),
        ({"links": {"bandwidth_gbps": [[1.0, 1.0], [1.0]], "latency_s": [[0.0, -1.0], [0.0]]}}, ["links.latency_s[0][1]"]),
        ({"links": {}}, ["links.bandwidth_gbps is required"]),
        ({"model": {"step_time_s": 0}}, ["model.step_time_s must be > 0"]),
        ({"heterogeneity": {"spread": "gaussian"}}, ["heterogeneity.spread must be one of even, random"]),
        ({"heterogeneity": {"eta_percent": -5}}, ["heterogeneity.eta_percent must be >= 0"]),
        ({"failures": [{"node": 9}]}, ["failures[0].node must be in 0..2"]),
        ({"failures": [{"node": 0, "duration": 0}]}, ["failures[0].duration must be > 0"]),
        ({"regions": ["A", "A"]}, ["regions must be unique; repeated: A"]),
        ({"nodes": {"region": "A"}}, ["'nodes' must be a list"]),
    ],
)
def test_bad_scenarios_are_clear_errors(change, needles):
    with pytest.raises(ScenarioError) as exc:
        scenario_from_dict(tiny_scenario_dict(**change), source="tiny.yaml")
    msg = str(exc.value)
    assert msg.startswith("tiny.yaml: ")
    for needle in needles:
        assert needle in msg, msg
    assert isinstance(exc.value, ConfigError)  # callers catch configuration errors uniformly


def test_missing_scenario_lists_the_available_ones(tmp_path):
    with pytest.raises(ScenarioError, match="available: .*halos_4x4"):
        load_scenario("halos_5x5")
    with pytest.raises(ScenarioError, match="scenario file not found"):
        load_scenario(tmp_path / "nope.yaml")
    with pytest.raises(ScenarioError, match="unknown key 'heterogeneity.eta'"):
        load_scenario("dips_eta0", ["heterogeneity.eta=3"])
    with pytest.raises(ScenarioError, match="key=value"):
        load_scenario("dips_eta0", ["heterogeneity"])


def test_yaml_file_errors_name_the_file(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\nregions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[1.0]]}\n"
                 "model: {step_time_s: 1.0}\nnodes: [{region: a, speeed: 1}]\n")
    with pytest.raises(ScenarioError, match=r"mine.yaml: unknown key 'nodes\[0\].speeed'"):
        load_scenario(p)
    p.write_text("regions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[.inf]]}\n"
                 "model: {step_time_s: 1.0}\nnodes: [{region: a}]\n")
    s = load_scenario(p)  # name defaults to the file stem; an infinite link costs nothing
    assert s.name == "mine" and s.transfer_time("a", "a", 10**12) == 0.0
    assert not math.isnan(s.allreduce_time([0], 10))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: x\nregions: [a]\nregions: [b]\n", "key 'regions' appears twice in one mapping (line 2 and line 3)"),
        ("name: !!python/object/apply:os.getcwd []\n", "YAML tag refused at line 1"),
        ("", "the scenario file is empty"),
        ("- a\n", "a scenario file must be a mapping of keys, got list"),
        ("regions: [a\n", "not valid YAML at line 2"),
        ("regions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[.nan]]}\nmodel: {step_time_s: 1.0}\n"
         "nodes: [{region: a}]\n", "links.bandwidth_gbps[0][0] (region 0 -> 0) must be > 0 Gbit/s, got nan"),
        ("regions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[1.0]], latency_s: [[-0.5]]}\n"
         "model: {step_time_s: 1.0}\nnodes: [{region: a}]\n", "links.latency_s[0][0] (region 0 -> 0) must be a finite value >= 0"),
        ("regions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[1.0]], latency_s: [[.inf]]}\n"
         "model: {step_time_s: 1.0}\nnodes: [{region: a}]\n", "must be a finite value >= 0, got inf"),
        ("regions: [a]\nserver_region: a\nlinks: {bandwidth_gbps: [[1.0]]}\nmodel: {step_time_s: .inf}\n"
         "nodes: [{region: a}]\n", "model.step_time_s must be > 0"),
    ],
)
def test_bad_scenario_files_are_one_clear_error(tmp_path, text, needle):
    """Scenario files go through the same plain-data YAML reader as configs: a duplicate key, a
    Python tag, an empty file, bad syntax, and NaN / negative / infinite times are each a
    ScenarioError (a ConfigError: one line, exit 2 from the CLI) naming the problem."""
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(p)
    assert str(exc.value).startswith(f"{p}: ") and needle in str(exc.value), str(exc.value)
