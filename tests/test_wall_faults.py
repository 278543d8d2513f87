"""Wall-clock faults (run.wall_faults): the failure trace of the scenario drives real faults through
the real dispatcher and fl-geo's real ClientApp (its fault mod) on the in-process grid.

Which job fails is decided by dispatch order on each node's own modelled time line
(fl_geo/runtime/wall_faults.py). Tiny scenario, node 2 (region B, speed 0.5 => 2 s per step):
a job of H = 3 steps with the 4,000-byte fp32 payloads takes 0.5 s + 32,000/8e9 s down, 6 s of
compute and 0.25 s + 32,000/4e9 s up = 6.75 s + 12 us, so its jobs occupy [0, J), [J, 2J), ...
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.runtime.wall_faults import FAULT_RECORD, WALL_FAULT_CODE, WallFaults, wall_fault_mod
from fl_geo.scenario_files import scenario_from_dict
from fl_geo.server_app import run_server
from tests.conftest import tiny_scenario_dict

J2 = 0.5 + 32_000 / 8e9 + 6.0 + 0.25 + 32_000 / 4e9  # node 2's modelled job time (H = 3, fp32)
REQ = {"inner_steps": 3, "wire_down": "fp32", "wire_up": "fp32"}


def test_jobs_fail_by_dispatch_order_on_each_nodes_time_line():
    sc = scenario_from_dict(tiny_scenario_dict(failures=[{"node": 2, "at_time": J2 + 1.0, "duration": 3.0},
                                                         {"node": 0, "at_time": 0.0, "duration": 2.0}]))
    now = [100.0]
    wf = WallFaults(sc, scale=0.5, num_params=1000, time_fn=lambda: now[0])
    assert wf.plan(2, REQ) is None  # [0, J2): up
    f = wf.plan(2, REQ)  # [J2, 2 J2): down at J2 + 1 for 3 s
    assert f is not None and f.fail_after_s == pytest.approx(0.5 * 1.0) and f.down_s == pytest.approx(1.5)
    assert wf.cursor[2] == pytest.approx(J2 + 4.0)  # its next job starts at the repair
    assert wf.plan(2, REQ) is None
    # node 0 is down at 0: its first job fails at once, and it is down for the 2 s outage
    f0 = wf.plan(0, REQ)
    assert f0 is not None and f0.fail_after_s == 0.0 and f0.down_s == pytest.approx(1.0)
    # wall side: down from the failure the server saw for down_s
    wf.failed(7, f)
    assert wf.is_down(7) and wf.next_up([7, 8]) == pytest.approx(101.5)
    now[0] = 101.5
    assert not wf.is_down(7) and wf.take_repaired() and not wf.take_repaired()


def test_a_node_down_for_good_fails_every_job_and_a_trace_is_required():
    sc = scenario_from_dict(tiny_scenario_dict(failures=[{"node": 1, "at_time": 0.5}]))
    wf = WallFaults(sc, scale=1.0, num_params=1000)
    f = wf.plan(1, REQ)
    assert f is not None and f.fail_after_s == 0.5 and math.isinf(f.down_s)
    assert math.isinf(wf.plan(1, REQ).down_s)
    with pytest.raises(ValueError, match="models no failure"):
        WallFaults(scenario_from_dict(tiny_scenario_dict()), scale=1.0, num_params=1000)


def test_the_client_mod_answers_a_failing_job_with_an_error():
    calls = []

    def handler(msg, ctx):
        calls.append(msg)
        return Message(RecordDict(), reply_to=msg)

    InlineGrid(client_app, 0)  # sets Flower's task identity, which a server-made Message needs
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    plain = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
    assert not wall_fault_mod(plain, ctx, handler).has_error() and len(calls) == 1
    doomed = Message(RecordDict({FAULT_RECORD: ConfigRecord({"fail_after_s": 0.0, "down_s": 2.0})}),
                     dst_node_id=1, message_type=MessageType.TRAIN)
    reply = wall_fault_mod(doomed, ctx, handler)
    assert reply.has_error() and reply.error.code == WALL_FAULT_CODE and len(calls) == 1  # never trained


def _run(tiny, tmp_path, name, failures, *overrides, hook=None, app=client_app):
    sc = tmp_path / f"{name}.json"
    sc.write_text(json.dumps(tiny_scenario_dict(failures=failures)))
    cfg = tiny("run.clock=wall", f"run.scenario={sc}", *overrides)
    grid = InlineGrid(app, cfg.run.num_clients, seed=0)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"], read_metrics(tmp_path / name)[1:], grid


def _versions(seen):
    def hook(node, msg, reply):
        if msg.metadata.message_type == MessageType.TRAIN:
            seen.setdefault(node, []).append(int(msg.content.config_records["fl-geo"]["base_version"]))
        return reply
    return hook


def test_a_failing_job_is_never_folded_and_the_node_rejoins_with_the_latest_model(tiny, tmp_path):
    """Node 2 fails 1 s into its first job (modelled), down 0.5 s: with scale 0 its ClientApp
    errors at once and it is back for round 2. The model equals, bit for bit, the run without
    wall faults in which that one job fails before training (a node that dies loses its work in
    flight, its saved inner state stays as it was), and round 2 sends node 2 version 1."""
    failures = [{"node": 2, "at_time": 1.0, "duration": 0.5}]
    seen: dict[int, list[int]] = {}
    s, faulty, rows, grid = _run(tiny, tmp_path, "faulty", failures, "run.wall_faults=true", hook=_versions(seen))
    victim = sorted(grid.contexts)[2]
    assert s["failure"] is None and s["lost_to_failures"] == 1 and s["failed_jobs"] == 1
    assert [r["outer/accepted"] for r in rows] == [2, 3] and [r["outer/failed"] for r in rows] == [1, 0]
    assert seen[victim] == [0, 1]  # trains again from the latest model after its repair
    count = {"n": 0}

    def fail_first(msg, context):
        if msg.metadata.dst_node_id == victim and msg.metadata.message_type == MessageType.TRAIN:
            count["n"] += 1
            if count["n"] == 1:
                return Message(Error(code=0, reason="failed by the test"), reply_to=msg)
        return client_app(msg, context)

    _, refused, _, _ = _run(tiny, tmp_path, "refused", failures, app=fail_first)
    assert count["n"] == 2 and torch.equal(faulty, refused)


def test_asynchronous_loop_waits_for_a_repair_and_wakes_the_repaired_node(tiny, tmp_path):
    """Every node is down at 0 (region outages of 2 modelled s = 0.1 wall s): each first job
    errors at once and the loop must wait (wall time) for the repairs instead of stopping; the
    first node back is sent work by that wait, the others when the dispatcher wakes the loop for
    them while the first trains, each from the model of the moment it is back."""
    failures = [{"region": "A", "at_time": 0.0, "duration": 2.0}, {"region": "B", "at_time": 0.0, "duration": 2.0}]
    seen: dict[int, list[int]] = {}
    s, _, rows, grid = _run(tiny, tmp_path, "async", failures, "run.wall_faults=true", "run.wall_fault_scale=0.05",
                            "strategy.name=async_diloco", "run.rounds=4", hook=_versions(seen))
    assert s["failure"] is None and s["outer_steps"] == 4 and s["lost_to_failures"] == 3
    for node in sorted(grid.contexts):
        assert len(seen[node]) >= 2 and seen[node][0] == 0  # the lost first job, then work after the repair
        assert seen[node] == sorted(seen[node])
    assert max(v for vs in seen.values() for v in vs) >= 1  # later jobs carry the newer models


def test_wall_fault_settings_are_checked(tiny, tmp_path):
    with pytest.raises(ConfigError, match="run.wall_faults=true needs run.clock=wall"):
        tiny("run.wall_faults=true", "run.clock=virtual")
    with pytest.raises(ConfigError, match="run.wall_fault_scale must be >= 0"):
        tiny("run.wall_fault_scale=-1")
    sc = tmp_path / "none.json"
    sc.write_text(json.dumps(tiny_scenario_dict()))
    with pytest.raises(ConfigError, match="models no failure"):
        run_server(InlineGrid(client_app, 3), tiny("run.wall_faults=true", f"run.scenario={sc}"), tmp_path / "x")
