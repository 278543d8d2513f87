"""The cost model (fl_geo/timing/cost.py) against hand computations on the shared tiny scenario:
server in region A; node 0 in A (speed 1), nodes 1 and 2 in B (speeds 2 and 0.5); A->B 8 Gbit/s +
0.5 s, B->A 4 Gbit/s + 0.25 s, B->B 40 Gbit/s; 1 s per step at speed 1; 1,000 modelled parameters."""

from __future__ import annotations

import pytest

from fl_geo.core.compress import CompressSettings
from fl_geo.core.quantize import quantized_nbytes
from fl_geo.scenario_files import scenario_from_dict
from fl_geo.timing.cost import CostModel
from fl_geo.timing.scenario import JobTime, ScenarioError
from tests.conftest import tiny_scenario_dict


@pytest.fixture
def cost() -> CostModel:
    return CostModel(10, scenario_from_dict(tiny_scenario_dict()))  # a 10-parameter proxy


def test_sent_bytes_are_the_trained_model_and_charged_bytes_the_modelled_one(cost):
    assert (cost.sent_bytes("fp32"), cost.sent_bytes("bf16"), cost.sent_bytes("fp16")) == (40, 20, 20)
    assert (cost.charged_bytes("fp32"), cost.charged_bytes("bf16")) == (4000, 2000)
    assert cost.job_bytes("bf16", "fp32") == (2000, 4000)
    assert cost.modelled_params == 1000
    with pytest.raises(ScenarioError, match="wire precision 'fp8' is unknown"):
        cost.charged_bytes("fp8")


def test_a_scenario_without_a_modelled_model_charges_the_trained_one():
    d = tiny_scenario_dict()
    d["model"] = {"step_time_s": 1.0}
    cost = CostModel(10, scenario_from_dict(d))
    assert cost.modelled_params == 10 and cost.charged_bytes("fp32") == cost.sent_bytes("fp32") == 40


def test_without_a_scenario_nothing_takes_time_and_charged_equals_sent():
    cost = CostModel(10)
    assert cost.charged_bytes("bf16") == cost.sent_bytes("bf16") == 20
    assert cost.job_time(0, 100, "fp32", "fp32") == JobTime(0.0, 0.0, 0.0)
    assert cost.transfer_s("A", "B", "fp32") == 0.0 and cost.allreduce_s([0, 1], 10**9) == 0.0


def test_job_time_is_download_steps_upload_on_the_nodes_links(cost):
    # node 1 sits in B at speed 2: 0.5 s per step
    jt = cost.job_time(1, 3, "bf16", "fp32")
    assert jt.down == pytest.approx(0.5 + 2000 * 8 / 8e9)  # A -> B
    assert jt.compute == pytest.approx(1.5)
    assert jt.up == pytest.approx(0.25 + 4000 * 8 / 4e9)  # B -> A
    # a HALoS local server in the node's own region: the intra-region link both ways
    local = cost.job_time(1, 3, "bf16", "fp32", peer_region="B")
    assert (local.down, local.up) == pytest.approx((2000 * 8 / 40e9, 4000 * 8 / 40e9))


def test_transfer_and_allreduce(cost):
    assert cost.transfer_s("B", "A", "fp16") == pytest.approx(0.25 + 2000 * 8 / 4e9)
    # a ring of nodes 0 (A) and 1 (B): 2(M-1) latency hops of the ring's slowest latency (0.5 s)
    # and 2(M-1)/M of the bytes over its narrowest link (4 Gbit/s)
    assert cost.allreduce_s([0, 1], 10**9) == pytest.approx(2 * 0.5 + 1 * 8e9 / 4e9)
    assert cost.allreduce_s([1], 10**9) == 0.0 and cost.allreduce_s([], 10**9) == 0.0


def test_a_share_of_the_model_is_charged_as_its_share_of_the_modelled_model(cost):
    assert cost.charged_share_bytes(5, "bf16") == 500 * 2
    assert cost.charged_share_bytes(3, "fp32") == 300 * 4
    int8 = CostModel(cost.numel, cost.scenario, uplink=CompressSettings(codec="int8", block=64, error_feedback=False))
    assert int8.charged_share_bytes(5, "bf16") == quantized_nbytes("int8", 500, 64)  # streaming.quantize's bytes
    assert cost.charged_share_bytes(10, "fp32") == cost.charged_bytes("fp32")
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="not part of a 10-parameter model"):
            cost.charged_share_bytes(bad, "fp32")


def test_a_negative_parameter_count_is_refused():
    with pytest.raises(ValueError, match="numel must be >= 0"):
        CostModel(-1)
