"""Clocks: virtual finish times by hand, hand-over order independent of real timing, checkpoints."""

from __future__ import annotations

import json
import math
import random

import pytest

from fl_geo.scenario_files import load_scenario, scenario_from_dict
from fl_geo.timing.clock import VirtualClock, WallClock
from fl_geo.timing.cost import CostModel
from tests.conftest import tiny_scenario_dict


def tiny():
    """The shared two-region test scenario (tests/conftest.py): server in A, node 0 in A (speed 1),
    nodes 1, 2 in B (speeds 2, 0.5); A->B 8 Gbit/s + 0.5 s, B->A 4 Gbit/s + 0.25 s; 1 s/step."""
    return scenario_from_dict(tiny_scenario_dict())


def drain(clock: VirtualClock) -> list[str]:
    order = []
    while (job := clock.due()) is not None:
        order.append(job)
        clock.complete(job)
    return order


def test_finish_time_by_hand():
    c = VirtualClock(tiny())
    # node 1: start 2 + down (0.5 + 8 Gbit / 8) + 10 steps x 0.5 s + up (0.25 + 4 Gbit / 4).
    assert c.schedule("a", 1, 2.0, steps=10, bytes_down=10**9, bytes_up=5 * 10**8) == pytest.approx(9.75)
    # node 0, start defaults to now (0): 0.1 + 10 + 0.05.
    assert c.schedule("b", 0, steps=10, bytes_down=10**9, bytes_up=5 * 10**8) == pytest.approx(10.15)
    assert c.finish_time("a") == pytest.approx(9.75) and c.start_time("a") == 2.0
    assert c.due() == "a" and c.is_due("a") and not c.is_due("b")
    assert c.complete("a") == pytest.approx(9.75) and c.now() == pytest.approx(9.75)
    # a job dispatched now starts from the advanced time.
    assert c.schedule("c", 2, steps=1, bytes_down=0, bytes_up=0) == pytest.approx(9.75 + 0.5 + 2 + 0.25)
    assert drain(c) == ["b", "c"]


def test_peer_region_models_a_local_server():
    c = VirtualClock(tiny())
    # node 2 against a server in its own region B: 40 Gbit/s, no latency, 2 s per step.
    assert c.schedule("j", 2, steps=1, bytes_down=10**9, bytes_up=10**9, peer_region="B") == pytest.approx(2.4)


def _jobs():
    # (job id, node, start, steps): several ties in finish time on purpose.
    return [("n0-a", 0, 0.0, 4), ("n1-a", 1, 0.0, 8), ("n2-a", 2, 0.0, 1), ("n3-a", 3, 0.0, 4),
            ("n0-b", 0, 4.0, 2), ("n1-b", 1, 1.0, 3), ("n2-b", 2, 6.0, 0), ("n3-b", 3, 0.9, 4)]


def test_due_order_does_not_depend_on_scheduling_or_arrival_order():
    lan = load_scenario("lan_uniform")  # 0.1 s/step, comm negligible
    reference = None
    rng = random.Random(0)
    for _ in range(20):
        jobs = _jobs()
        rng.shuffle(jobs)
        c = VirtualClock(lan)
        nbytes = CostModel(1000, lan).charged_bytes("fp32")
        for jid, node, start, steps in jobs:
            c.schedule(jid, node, start, steps=steps, bytes_down=nbytes, bytes_up=nbytes)
        # Replies arrive in a random real order; the dispatcher hands one over only when it is due.
        arrivals = [j[0] for j in jobs]
        rng.shuffle(arrivals)
        arrived: set[str] = set()
        handed = []
        for jid in arrivals:
            arrived.add(jid)
            while (due := c.due()) in arrived:
                handed.append(due)
                c.complete(due)
        assert c.pending() == 0
        if reference is None:
            reference = handed
        assert handed == reference
    # finish = start + steps * 0.1 + the same tiny comm for all; ties (n0-a/n3-a at 0.4, n1-b/n3-b
    # at 1.3 up to rounding noise) go to the smaller node index.
    expected = sorted(_jobs(), key=lambda j: (round((j[2] + j[3] * 0.1) * 1e6), j[1]))
    assert reference == [j[0] for j in expected]


def test_ties_break_by_node_index_then_dispatch_sequence():
    c = VirtualClock(load_scenario("lan_uniform"))
    for node in (3, 1, 2, 0):
        c.schedule(f"n{node}", node, steps=5, bytes_down=40, bytes_up=40)
    c.schedule_at("late-twin", c.finish_time("n2"), node=2)  # same node, same time, later dispatch
    c.schedule_at("server", c.finish_time("n0"))  # node -1: server-side events win ties
    assert drain(c) == ["server", "n0", "n1", "n2", "late-twin", "n3"]


def test_rounding_noise_counts_as_a_tie():
    c = VirtualClock(tiny())
    c.schedule_at("x", 0.1 + 0.2, node=2)  # 0.30000000000000004
    c.schedule_at("y", 0.3, node=1)
    assert drain(c) == ["y", "x"]


def test_complete_is_monotone():
    c = VirtualClock(tiny())
    c.schedule("early", 0, steps=1, bytes_down=0, bytes_up=0)  # finishes at 1
    c.schedule("late", 0, 0.0, steps=5, bytes_down=0, bytes_up=0)  # at 5
    assert c.complete("late") == 5.0  # out of order (a synchronous round collecting everything)
    assert c.complete("early") == 5.0  # never backwards
    c.schedule("j", 0, steps=1, bytes_down=0, bytes_up=0)
    c.advance_to(100.0)  # e.g. a modelled outer step
    c.advance_to(50.0)
    assert c.now() == 100.0
    assert c.complete("j") == 100.0
    with pytest.raises(ValueError):
        c.advance_to(math.inf)


def test_cancel_and_job_id_reuse():
    c = VirtualClock(tiny())
    c.schedule("a", 0, steps=1, bytes_down=0, bytes_up=0)
    c.schedule("b", 0, steps=2, bytes_down=0, bytes_up=0)
    c.cancel("a")
    c.cancel("a")  # idempotent
    c.cancel("never-scheduled")
    assert c.due() == "b" and c.pending() == 1 and "a" not in c
    with pytest.raises(KeyError, match="not pending"):
        c.complete("a")
    with pytest.raises(ValueError, match="already pending"):
        c.schedule("b", 1, steps=1, bytes_down=0, bytes_up=0)
    c.schedule("a", 0, steps=5, bytes_down=0, bytes_up=0)  # the id is free again
    assert drain(c) == ["b", "a"] and c.now() == 5.0


def test_many_cancellations_keep_the_heap_consistent():
    c = VirtualClock(load_scenario("lan_uniform"))
    rng = random.Random(1)
    finishes = {}
    for i in range(300):
        jid = f"j{i}"
        finishes[jid] = c.schedule_at(jid, rng.uniform(0, 1000), node=i % 4)
    dropped = rng.sample(sorted(finishes), 250)
    for jid in dropped:
        c.cancel(jid)
    keep = sorted((f, int(j[1:]) % 4, int(j[1:]), j) for j, f in finishes.items() if j not in dropped)
    assert c.pending() == 50
    assert drain(c) == [k[3] for k in keep]


def test_bad_jobs_are_refused():
    c = VirtualClock(tiny())
    with pytest.raises(ValueError, match="nodes 0..2"):
        c.schedule("x", 3, steps=1, bytes_down=0, bytes_up=0)
    with pytest.raises(ValueError, match="byte counts"):
        c.schedule("x", 0, steps=1, bytes_down=-1, bytes_up=0)
    with pytest.raises(ValueError, match="steps"):
        c.schedule("x", 0, steps=-1, bytes_down=0, bytes_up=0)
    assert c.pending() == 0


def test_dynupd_jobs_finish_together():
    """DynUpd's purpose, checked through the clock: steps scaled by speed equalise job times."""
    s = load_scenario("halos_4x4")
    c = VirtualClock(s)
    for node in range(16):
        c.schedule(f"w{node}", node, steps=s.dynupd_steps(8, node), bytes_down=0, bytes_up=0)
    fastest = 8 * 0.2384
    for n in range(16):
        # ceil: at least the fastest worker's job time, less than one extra own step beyond it.
        assert fastest - 1e-9 <= c.finish_time(f"w{n}") < fastest + s.step_time(n)


def test_sync_round_times_and_payload():
    s = tiny()
    cost = CostModel(7, s)  # the scenario models 1000 parameters: the clock charges those
    assert cost.charged_bytes("fp32") == 4000 and cost.charged_bytes("bf16") == 2000
    assert cost.sent_bytes("fp32") == 28
    assert s.sync_round_time([0, 1, 2], [10, 10, 10], 10**9) == pytest.approx(20 + 2 + 8 / 3)
    assert s.sync_round_time_ps([0, 1, 2], [10, 10, 10], 10**9, 10**9) == pytest.approx(23.75)


def test_virtual_state_round_trips_through_json():
    s = tiny()
    c = VirtualClock(s)
    for i, node in enumerate((2, 0, 1, 0)):
        c.schedule(f"j{i}", node, steps=i + 1, bytes_down=10**8, bytes_up=10**8)
    c.complete(c.due())
    c.cancel("j3")
    state = json.loads(json.dumps(c.state_dict()))
    d = VirtualClock(s)
    d.load_state_dict(state)
    assert d.now() == c.now() and d.pending() == c.pending()
    d.schedule("new", 1, steps=1, bytes_down=0, bytes_up=0)
    c.schedule("new", 1, steps=1, bytes_down=0, bytes_up=0)
    assert drain(d) == drain(c)
    other = load_scenario("lan_uniform")
    with pytest.raises(ValueError, match="saved under scenario 'tiny'"):
        VirtualClock(other).load_state_dict(state)
    with pytest.raises(ValueError, match="not a VirtualClock state"):
        VirtualClock(s).load_state_dict(WallClock().state_dict())


def test_wall_clock_hands_over_on_arrival():
    t = [100.0]
    c = WallClock(time_fn=lambda: t[0])
    assert c.now() == 0.0 and not c.is_virtual
    assert math.isnan(c.schedule("a", 0, steps=5, bytes_down=1, bytes_up=1))
    c.schedule("b", 1, steps=1, bytes_down=1, bytes_up=1)
    assert c.due() is None and c.is_due("b") and c.is_due("a") and c.pending() == 2
    t[0] = 103.5
    assert c.complete("b") == 3.5
    c.cancel("a")
    c.cancel("a")
    with pytest.raises(KeyError):
        c.complete("a")
    c.advance_to(1e9)  # real time cannot be advanced
    assert c.now() == 3.5
    state = c.state_dict()
    t[0] = 500.0
    d = WallClock(time_fn=lambda: t[0])
    d.load_state_dict(state)
    assert d.now() == 3.5  # a resumed run continues its time axis
    t[0] = 501.0
    assert d.now() == 4.5
