"""Failure traces on the virtual clock (fl_geo.timing.failures) and goodput (fl_geo.runtime.goodput).

Tiny scenario (tests/conftest.py): node 0 in A (speed 1), nodes 1, 2 in B (speeds 2, 0.5), 1 s per
step at speed 1, latency A->B 0.5 s and B->A 0.25 s, 3 inner steps. A job on node 2 therefore runs
0.5 + 6 + 0.25 = 6.75 s, one on node 1 2.25 s, one on node 0 3 s.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import yaml
from flwr.app import Error, Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.goodput import GoodputMeter, JobCost
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.scenario_files import scenario_from_dict
from fl_geo.server_app import run_server
from fl_geo.timing.clock import VirtualClock
from fl_geo.timing.failures import FailureTimeline
from fl_geo.timing.scenario import ScenarioError, scenario_for_nodes
from tests.conftest import tiny_scenario_dict

BUCKETS = ("useful", "comm", "lost", "rejected", "stale", "in_flight", "waiting")


def _scenario_file(tmp_path, name="sc", **extra):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(**extra)))
    return path


def _run(tiny, tmp_path, name, scenario, *overrides, hook=None, seed=0):
    cfg = tiny("run.clock=virtual", f"run.scenario={scenario}", *overrides)
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    params = torch.load(tmp_path / name / "final_model.pt")["params"]
    return summary, params, read_metrics(tmp_path / name)[1:], grid


# ---- the trace ------------------------------------------------------------------------------------


def test_trace_expands_explicit_region_and_process_events():
    s = scenario_from_dict(tiny_scenario_dict(
        failures=[{"node": 0, "at_time": 10.0, "duration": 5.0},
                  {"region": "B", "at_time": 12.0, "duration": 8.0},  # nodes 1 and 2
                  {"node": 2, "at_time": 18.0, "duration": 4.0},  # overlaps the region outage
                  {"node": 0, "at_time": 30.0}],  # for good
        failure_process={"mtbf_s": 100.0, "repair_s": 10.0, "seed": 5, "nodes": [1]},
    ))
    tl = FailureTimeline.from_scenario(s)
    assert tl is not None
    assert tl.intervals(0, 1000.0) == [(10.0, 15.0), (30.0, math.inf)]
    assert tl.intervals(2, 1000.0) == [(12.0, 22.0)]  # merged
    # node 1: the region outage plus its process, drawn from Random("fl-geo-failures/<seed>/<node>")
    rng = random.Random("fl-geo-failures/5/1")
    d1 = rng.expovariate(1 / 100.0)
    d2 = d1 + 10.0 + rng.expovariate(1 / 100.0)
    assert tl.intervals(1, d2 + 1) == [(12.0, 20.0), (d1, d1 + 10.0), (d2, d2 + 10.0)]
    assert tl.is_down(2, 12.0) and not tl.is_down(2, 22.0) and not tl.is_down(2, 11.999)
    assert tl.up_at(2, 13.0) == 22.0 and tl.up_at(0, 31.0) == math.inf and tl.up_at(0, 5.0) == 5.0
    assert tl.first_down(2, 5.0, 12.0) is None  # failing exactly at the finish: delivered
    assert tl.first_down(2, 5.0, 12.5) == 12.0 and tl.first_down(2, 13.0, 14.0) == 13.0
    assert tl.uptime(0, 0.0, 40.0) == 10.0 + 15.0 and tl.uptime(2, 0.0, 30.0) == 20.0
    assert tl.events(16.0) == [(10.0, 0, "down"), (12.0, 1, "down"), (12.0, 2, "down"), (15.0, 0, "up")]
    # the first two nodes keep their trace when a run uses fewer nodes
    tl2 = FailureTimeline.from_scenario(scenario_for_nodes(s, 2))
    assert tl2.intervals(1, d2 + 1) == tl.intervals(1, d2 + 1) and tl2.num_nodes == 2
    assert FailureTimeline.from_scenario(scenario_from_dict(tiny_scenario_dict())) is None


def test_process_is_seeded_and_independent_of_query_order():
    s = scenario_from_dict(tiny_scenario_dict(failure_process={"mtbf_s": 50.0, "repair_s": 5.0,
                                                               "repair": "exponential", "seed": 3}))
    a, b = FailureTimeline.from_scenario(s), FailureTimeline.from_scenario(s)
    for t in (1000.0, 10.0, 400.0):  # b asked out of order, a only once
        b.is_down(1, t)
    assert a.events(1000.0) == b.events(1000.0) and len(a.events(1000.0)) > 10
    other = FailureTimeline.from_scenario(scenario_from_dict(tiny_scenario_dict(
        failure_process={"mtbf_s": 50.0, "repair_s": 5.0, "repair": "exponential", "seed": 4})))
    assert other.events(1000.0) != a.events(1000.0)


@pytest.mark.parametrize(("extra", "message"), [
    ({"failures": [{"at_time": 1.0}]}, "failures[0] must set exactly one of 'node'"),
    ({"failures": [{"node": 0, "region": "A"}]}, "failures[0] must set exactly one of 'node'"),
    ({"failures": [{"region": "C"}]}, "failures[0].region 'C' is not one of the regions"),
    ({"failure_process": {"mtbf_s": 10.0}}, "failure_process.repair_s must be > 0"),
    ({"failure_process": {"mtbf_s": 10.0, "repair_s": 1.0, "repair": "weibull"}}, "failure_process.repair must be one of"),
    ({"failure_process": {"mtbf_s": 10.0, "repair_s": 1.0, "nodes": [3]}}, "failure_process.nodes[0] must be in 0..2"),
    ({"failure_process": {"mtbf_s": -1.0}}, "failure_process.mtbf_s must be >= 0"),
])
def test_failure_fields_are_validated(extra, message):
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        scenario_from_dict(tiny_scenario_dict(**extra))


def test_process_of_dropped_nodes_only_is_off_not_every_node():
    s = scenario_from_dict(tiny_scenario_dict(failure_process={"mtbf_s": 10.0, "repair_s": 1.0, "nodes": [2]}))
    assert FailureTimeline.from_scenario(scenario_for_nodes(s, 2)) is None


def test_clock_ends_a_job_at_its_nodes_failure_and_marks_it_lost():
    clock = VirtualClock(scenario_from_dict(tiny_scenario_dict(failures=[{"node": 2, "at_time": 3.0, "duration": 10.0}])))
    assert clock.schedule("a", 2, steps=3, bytes_down=0, bytes_up=0) == 3.0 and clock.lost("a")
    assert clock.schedule("b", 0, steps=3, bytes_down=0, bytes_up=0) == 3.0 and not clock.lost("b")
    assert clock.due() == "b"  # tie at 3.0: node index first
    clock.complete("b")
    assert clock.complete("a") == 3.0 and clock.is_down(2) and not clock.is_down(0)
    assert clock.next_up([0, 1, 2]) == 13.0
    assert clock.schedule("c", 2, steps=1, bytes_down=0, bytes_up=0) == 3.0 and clock.lost("c")  # sent to a down node
    state = clock.state_dict()
    assert [j.get("lost") for j in state["jobs"]] == [True]
    clock.load_state_dict(state)
    assert clock.lost("c")


# ---- runs on the in-process grid with the real dispatcher -----------------------------------------


@pytest.mark.parametrize("strategy", ["diloco", "fedbuff"])
def test_a_failure_trace_replays_identically(tiny, tmp_path, strategy):
    sc = _scenario_file(tmp_path, failures=[{"region": "B", "at_time": 20.0, "duration": 7.0}],
                        failure_process={"mtbf_s": 12.0, "repair_s": 4.0, "seed": 11})
    s1, a, rows1, _ = _run(tiny, tmp_path, "a", sc, f"strategy.name={strategy}", "run.rounds=6", seed=0)
    s2, b, rows2, _ = _run(tiny, tmp_path, "b", sc, f"strategy.name={strategy}", "run.rounds=6", seed=7)
    assert torch.equal(a, b)
    assert [r["time/virtual_s"] for r in rows1] == [r["time/virtual_s"] for r in rows2]
    assert [r["outer/failed"] for r in rows1] == [r["outer/failed"] for r in rows2]
    assert s1["lost_to_failures"] == s2["lost_to_failures"] > 0 and s1["goodput"] == s2["goodput"]
    assert s1["outer_steps"] == s2["outer_steps"] > 0 and s1["failure"] is None  # a round may lose every job


def test_a_job_lost_to_a_failure_is_never_folded(tiny, tmp_path):
    """Node 2 fails at 3 s inside its first 6.75 s job and is back at 3.5 s, before round 2. The
    model must equal, bit for bit, a run without failures where that one reply is refused, and
    differ from a run where it is folded."""
    sc = _scenario_file(tmp_path, "fail", failures=[{"node": 2, "at_time": 3.0, "duration": 0.5}])
    plain = _scenario_file(tmp_path, "plain")
    s_fail, failed, rows, grid = _run(tiny, tmp_path, "fail", sc, "run.rounds=3")
    victim = sorted(grid.contexts)[2]
    seen = {"n": 0}

    def refuse_first(node, msg, reply):
        if node == victim and msg.metadata.message_type == "train":
            seen["n"] += 1
            if seen["n"] == 1:
                return Message(Error(code=0, reason="refused by the test"), reply_to=msg)
        return reply

    _, refused, _, _ = _run(tiny, tmp_path, "refused", plain, "run.rounds=3", hook=refuse_first)
    _, folded, _, _ = _run(tiny, tmp_path, "folded", plain, "run.rounds=3")
    assert s_fail["lost_to_failures"] == 1 and s_fail["failed_jobs"] == 1
    assert [r["outer/accepted"] for r in rows] == [2, 3, 3] and [r["outer/failed"] for r in rows] == [1, 0, 0]
    assert torch.equal(failed, refused) and not torch.equal(failed, folded)
    assert rows[0]["goodput/lost_s"] == 3.0  # lost at the failure: 3 s of node 2's job


def test_a_rejoined_node_trains_from_the_latest_model(tiny, tmp_path):
    """Asynchronous: node 2 fails at 3 s in its first job and is repaired at 10 s; its next job is
    sent at 10 s with the model of every step taken by then, not the one it started from."""
    sc = _scenario_file(tmp_path, failures=[{"node": 2, "at_time": 3.0, "duration": 7.0}])
    cfg_nodes = {}

    def record(node, msg, reply):
        if msg.metadata.message_type == "train":
            cfg_nodes.setdefault(node, []).append(int(msg.content.config_records["fl-geo"]["base_version"]))
        return reply

    s, _, rows, grid = _run(tiny, tmp_path, "run", sc, "strategy.name=async_diloco", "run.rounds=12", hook=record)
    victim = sorted(grid.contexts)[2]
    assert s["lost_to_failures"] == 1 and s["outer_steps"] == 12
    steps_by_10 = max(int(r["outer/step"]) for r in rows if r["time/virtual_s"] <= 10.0)
    assert steps_by_10 >= 5
    assert cfg_nodes[victim][:2] == [0, steps_by_10]  # first job from v0 (lost), next from the latest
    # while down it got no job: its second train message is the one sent at the repair
    assert rows[0]["outer/failed"] + sum(r["outer/failed"] for r in rows[1:]) == 1


@pytest.mark.parametrize("strategy", ["diloco", "async_diloco"])
def test_every_node_down_waits_for_the_first_repair(tiny, tmp_path, strategy):
    """Region outages of both regions from 0 s: the run starts when A is back at 5 s."""
    sc = _scenario_file(tmp_path, failures=[{"region": "A", "at_time": 0.0, "duration": 5.0},
                                            {"region": "B", "at_time": 0.0, "duration": 9.0}])
    s, _, rows, _ = _run(tiny, tmp_path, "run", sc, f"strategy.name={strategy}", "run.rounds=2")
    assert s["failure"] is None and s["outer_steps"] == 2
    assert rows[0]["time/virtual_s"] == pytest.approx(5.0 + 3.0, abs=1e-4)  # node 0's 3 s job from 5 s
    assert rows[0]["goodput/provisioned_s"] == pytest.approx(rows[0]["time/virtual_s"] - 5.0, abs=1e-4)


# ---- goodput ------------------------------------------------------------------------------------


def test_goodput_is_one_when_nothing_waits(tiny, tmp_path):
    """One node, infinitely fast links, a step per reply: every second is an inner step."""
    sc = tmp_path / "solo.yaml"
    sc.write_text(yaml.safe_dump({"name": "solo", "server_region": "A", "regions": ["A"],
                                  "links": {"bandwidth_gbps": [[math.inf]]},
                                  "model": {"num_params": 1000, "step_time_s": 0.5}, "nodes": [{"region": "A"}]}))
    s, _, rows, _ = _run(tiny, tmp_path, "run", sc, "strategy.name=async_diloco", "run.num_clients=1", "run.rounds=3")
    assert [r["goodput/ratio"] for r in rows] == pytest.approx([1.0] * 3, abs=1e-12)
    assert rows[-1]["goodput/useful_s"] == pytest.approx(3 * 3 * 0.5) and s["goodput"] == pytest.approx(1.0)


def test_goodput_of_a_synchronous_round_by_hand_and_under_a_failure(tiny, tmp_path):
    plain = _scenario_file(tmp_path, "plain")
    s, _, rows, _ = _run(tiny, tmp_path, "plain", plain, "run.rounds=1")
    allreduce = scenario_from_dict(tiny_scenario_dict()).allreduce_time([0, 1, 2], 4000)
    t = 6.75 + allreduce  # slowest job, then the all-reduce
    g = s["goodput_s"]
    assert rows[0]["time/virtual_s"] == pytest.approx(t)
    assert g["provisioned"] == pytest.approx(3 * t) and g["useful"] == pytest.approx(3 + 1.5 + 6)
    assert g["comm"] == pytest.approx(0.75 + 0.75) and g["lost"] == 0 and g["in_flight"] == 0
    assert g["waiting"] == pytest.approx(3 * t - 12.0)
    assert s["goodput"] == pytest.approx(10.5 / (3 * t))
    # node 2 fails for good at 6 s, just before its job would end: 6 s lost, the round waited for
    # nothing, and node 2 is not provisioned after 6 s
    sc = _scenario_file(tmp_path, "fail", failures=[{"node": 2, "at_time": 6.0}])
    sf, _, rows_f, _ = _run(tiny, tmp_path, "fail", sc, "run.rounds=1")
    gf = sf["goodput_s"]
    tf = rows_f[0]["time/virtual_s"]
    ar2 = scenario_from_dict(tiny_scenario_dict()).allreduce_time([0, 1], 4000)
    assert tf == pytest.approx(6.0 + ar2)  # the failure is the round's last event
    assert gf["lost"] == pytest.approx(6.0) and gf["useful"] == pytest.approx(3 + 1.5)
    assert gf["provisioned"] == pytest.approx(2 * tf + 6.0)
    assert sum(gf[b] for b in BUCKETS) == pytest.approx(gf["provisioned"])
    assert sf["goodput"] < s["goodput"]


def test_goodput_meter_books_verdicts_and_unused_steps():
    m = GoodputMeter(lambda t: 2 * t)
    m.resolved(1, JobCost(4.0, 3.0), ok=True)
    m.resolved(2, JobCost(5.0, 4.0), ok=True)
    m.resolved(3, JobCost(2.0, 2.0), ok=False)
    m.verdict(2)
    m.verdict(9)  # no held reply: ignored
    assert m.metrics(10.0, in_flight_s=1.0)["goodput/in_flight_s"] == 5.0  # 1 s in flight + the held 4 s
    m.settle(accepted=True)
    m.resolved(1, JobCost(1.0, 1.0), ok=True)
    m.settle(accepted=False)
    out = m.metrics(10.0, in_flight_s=0.0)
    assert (out["goodput/useful_s"], out["goodput/comm_s"], out["goodput/lost_s"], out["goodput/rejected_s"]) == (3.0, 1.0, 2.0, 6.0)
    assert out["goodput/waiting_s"] == 20.0 - 12.0 and out["goodput/ratio"] == 3.0 / 20.0
    with pytest.raises(ValueError):
        m.verdict(1, "late")
