"""Link slow-downs over time windows (scenario ``link_windows``), timed by hand.

The tiny scenario: region A -> B is 8 Gbit/s with 0.5 s latency, B -> A 4 Gbit/s with 0.25 s,
so 1 GB (8e9 bits) takes 1 s of bits A -> B and 2 s B -> A. A transfer pays its latency first
(plus the extra latency of the windows open when it starts), then its bits flow at the bandwidth
times the factors of the windows open at each instant.
"""

from __future__ import annotations

import math

import pytest

from fl_geo.scenario_files import scenario_from_dict
from fl_geo.timing.clock import VirtualClock
from fl_geo.timing.scenario import ScenarioError, scenario_for_nodes
from tests.conftest import tiny_scenario_dict

GB = 10**9


def _sc(*windows):
    return scenario_from_dict(tiny_scenario_dict(link_windows=list(windows)))


def test_no_window_or_no_start_is_the_static_formula_bit_for_bit():
    plain = scenario_from_dict(tiny_scenario_dict())
    sc = _sc({"link": ["A", "B"], "at_time": 0.0, "until_time": 5.0, "bandwidth_factor": 0.5})
    static = plain.transfer_time("A", "B", GB)
    assert static == 0.5 + 1.0
    assert sc.transfer_time("A", "B", GB) == static  # no start: windows do not apply
    assert plain.transfer_time("A", "B", GB, start=1.0) == static
    assert sc.transfer_time("A", "B", GB, start=5.0) == static  # the window is closed at 5 s


def test_a_transfer_straddling_a_window_start_is_timed_piecewise():
    sc = _sc({"link": ["B", "A"], "at_time": 0.9, "until_time": 10.0, "bandwidth_factor": 0.25,
              "extra_latency_s": 0.2})
    # from 0: 0.5 s latency (the window is not open yet), bits from 0.5 s: 0.4 s at 8e9 bit/s =
    # 3.2e9 bits by 0.9 s, the other 4.8e9 at 2e9 bit/s = 2.4 s: done at 3.3 s
    assert sc.transfer_time("A", "B", GB, start=0.0) == pytest.approx(3.3, abs=1e-12)
    # from 1: latency 0.5 + 0.2, then 8e9 bits at 2e9 bit/s: done at 1.7 + 4 = 5.7 s
    assert sc.transfer_time("A", "B", GB, start=1.0) == pytest.approx(4.7, abs=1e-12)
    # the link selector is both directions: B -> A (4 Gbit/s, 0.25 s) from 9 s: 0.45 s latency,
    # bits from 9.45 s at 1e9 bit/s until 10 s (0.55e9), the rest 7.45e9 at 4e9 bit/s
    assert sc.transfer_time("B", "A", GB, start=9.0) == pytest.approx(0.45 + 0.55 + 7.45 / 4, abs=1e-12)
    assert sc.transfer_time("A", "A", GB, start=1.0) == pytest.approx(8 / 80)  # another link


def test_overlapping_region_and_node_windows_multiply_and_add():
    sc = _sc({"region": "B", "at_time": 0.0, "until_time": 1.5, "bandwidth_factor": 0.5},
             {"node": 1, "at_time": 1.0, "until_time": 2.0, "bandwidth_factor": 0.5, "extra_latency_s": 1.0})
    # a region-B transfer of no node: 0.5 s latency, bits at 4e9 from 0.5 to 1.5 s (4e9), then 8e9: 0.5 s
    assert sc.transfer_time("A", "B", GB, start=0.0) == pytest.approx(2.0, abs=1e-12)
    # node 1's transfer from 0.5: latency 0.5 (node window not open yet) -> bits from 1.0;
    # 1.0-1.5 at 8e9 x 0.25 = 1e9, 1.5-2.0 at 8e9 x 0.5 = 2e9, then 5e9 at 8e9 = 0.625 s
    assert sc.transfer_time("A", "B", GB, start=0.5, node=1) == pytest.approx(2.625 - 0.5, abs=1e-12)
    # node 2 is not selected by the node window
    assert sc.transfer_time("A", "B", GB, start=0.5, node=2) == sc.transfer_time("A", "B", GB, start=0.5)


def test_the_virtual_clock_times_a_job_through_a_window():
    """Node 2 (region B, speed 0.5: 2 s per step): 1 GB down, 2 steps, 1 GB up, dispatched at 0.
    A window on region B halves the bandwidth over [4, 6): the download (0.5 + 1 s, done at 1.5)
    is untouched, compute ends at 5.5, the upload (B -> A: 0.25 s latency, then 8e9 bits at
    4e9 bit/s) starts at 5.5 with 0.25 s of latency, sends 0.25 s x 2e9 = 0.5e9 bits by 6 s and
    the other 7.5e9 at 4e9 bit/s: done at 6 + 1.875 = 7.875 s (7.75 s without the window)."""
    sc = _sc({"region": "B", "at_time": 4.0, "until_time": 6.0, "bandwidth_factor": 0.5})
    clock = VirtualClock(sc)
    assert clock.schedule("j", 2, steps=2, bytes_down=GB, bytes_up=GB) == pytest.approx(7.875, abs=1e-12)
    jt = sc.job_time(2, 2, GB, GB, start=0.0)
    assert (jt.down, jt.compute) == (1.5, 4.0) and jt.up == pytest.approx(2.375, abs=1e-12)
    assert sc.job_time(2, 2, GB, GB).total == 7.75  # without a start: static


def test_the_allreduce_is_slowed_by_a_window_on_its_links():
    """Nodes 0 (A) and 1 (B): the ring A -> B -> A has its slowest link B -> A at 4 Gbit/s and
    largest latency 0.5 s; M = 2: 2 x 0.5 s of latency, then 8e9 bits (2(M-1)/M x 1 GB) at
    4e9 bit/s: 3 s. A window on [A, B] halves both links over [1.5, 3) with 0.1 s extra latency."""
    sc = _sc({"link": ["A", "B"], "at_time": 1.5, "until_time": 3.0, "bandwidth_factor": 0.5, "extra_latency_s": 0.1})
    assert sc.allreduce_time([0, 1], GB) == 3.0
    # from 0: bits from 1 s; 1-1.5 s at 4e9 (2e9 bits), 1.5-3 s at 2e9 (3e9), the last 3e9 at 4e9: 3.75 s
    assert sc.allreduce_time([0, 1], GB, start=0.0) == pytest.approx(3.75, abs=1e-12)
    # from 2: latency 2 x (0.5 + 0.1) -> bits from 3.2 s, after the window: 2 s more
    assert sc.allreduce_time([0, 1], GB, start=2.0) == pytest.approx(3.2, abs=1e-12)
    # a node window acts on the ring links at its region, only when the node is in the ring
    node0 = _sc({"node": 0, "at_time": 1.5, "until_time": 3.0, "bandwidth_factor": 0.5})
    assert node0.allreduce_time([0, 1], GB, start=0.0) == pytest.approx(3.75, abs=1e-12)
    node2 = _sc({"node": 2, "at_time": 0.0, "until_time": 9.0, "bandwidth_factor": 0.5})
    assert node2.allreduce_time([0, 1], GB, start=0.0) == 3.0


def test_bad_windows_are_one_line_errors():
    cases = [
        ({"node": 7, "at_time": 0.0, "until_time": 1.0}, r"link_windows\[0\]\.node must be in 0\.\.2"),
        ({"region": "Z", "at_time": 0.0, "until_time": 1.0}, r"link_windows\[0\]\.region 'Z' is not one of"),
        ({"link": ["A", "Q"], "at_time": 0.0, "until_time": 1.0}, r"link_windows\[0\]\.link region 'Q'"),
        ({"link": ["A"], "at_time": 0.0, "until_time": 1.0}, r"link must name two regions"),
        ({"at_time": 0.0, "until_time": 1.0}, "exactly one of 'node', 'region' and 'link'"),
        ({"node": 0, "region": "A", "at_time": 0.0, "until_time": 1.0}, "exactly one of"),
        ({"node": 0, "at_time": -1.0, "until_time": 1.0}, r"at_time must be a finite time >= 0"),
        ({"node": 0, "at_time": 2.0, "until_time": 2.0}, r"until_time must be > at_time"),
        ({"node": 0, "at_time": 0.0, "until_time": 1.0, "bandwidth_factor": 0.0}, "bandwidth_factor must be"),
        ({"node": 0, "at_time": 0.0, "until_time": 1.0, "bandwidth_factor": -0.5}, "bandwidth_factor must be"),
        ({"node": 0, "at_time": 0.0, "until_time": 1.0, "extra_latency_s": -1.0}, "extra_latency_s must be"),
        ({"node": 0, "at_time": 0.0, "until": 1.0}, r"unknown key 'link_windows\[0\]\.until'"),
    ]
    for window, needle in cases:
        with pytest.raises(ScenarioError, match=needle) as info:
            _sc(window)
        assert "\n" not in str(info.value)


def test_windows_of_dropped_nodes_are_dropped_with_them():
    sc = _sc({"node": 2, "at_time": 0.0, "until_time": 1.0, "bandwidth_factor": 0.5},
             {"region": "B", "at_time": 0.0, "until_time": math.inf, "bandwidth_factor": 0.5})
    two = scenario_for_nodes(sc, 2)
    assert [w.region for w in two.link_windows] == ["B"]


def test_the_example_scenario_slows_cluster_3_in_its_window():
    from fl_geo.scenario_files import load_scenario

    sc = load_scenario("dips_eta100_slow_link")
    bits = sc.payload_bytes("bf16") * 8
    assert sc.transfer_time("ps", "c3", sc.payload_bytes("bf16"), start=0.0) == bits / 10e9
    assert sc.transfer_time("ps", "c3", sc.payload_bytes("bf16"), start=150.0, node=3) == pytest.approx(
        0.05 + bits / 2.5e9, rel=1e-12)
    assert sc.transfer_time("ps", "c2", sc.payload_bytes("bf16"), start=150.0) == bits / 10e9
