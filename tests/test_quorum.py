"""Quorum rounds (strategy.quorum, strategy.late_replies): a synchronous round steps once a share
of its nodes replied; the stragglers keep training and their replies come in a later round. On
the tiny scenario's virtual clock (1 s per step at speed 1; nodes at speeds 1, 2 and 0.5, the
last two in region B, 0.5 s + 0.25 s of link latency away from the server: H = 3 steps are done
at 3 s, 2.25 s and 6.75 s) every time is computable by hand."""

from __future__ import annotations

import json

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.scenario_files import scenario_from_dict
from fl_geo.server_app import run_server
from tests.conftest import tiny_scenario_dict

PER_JOB = 3 * 4 * 32  # H x batch x seq_len


def _run(tiny, tmp_path, name, *overrides):
    scen = tmp_path / "tiny.yaml"
    scen.write_text(json.dumps(tiny_scenario_dict()))
    cfg = tiny("run.clock=virtual", f"run.scenario={scen}", "strategy.inner_steps=3", "run.rounds=3", *overrides)
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    summary = run_server(grid, cfg, tmp_path / name)
    final = torch.load(tmp_path / name / "final_model.pt")["params"]
    return summary, final, read_metrics(tmp_path / name)[1:], cfg


def _allreduce(cfg, slots):
    sc = scenario_from_dict(tiny_scenario_dict())
    return sc.allreduce_time(slots, sc.payload_bytes(cfg.wire.up, sc.modelled_params(fallback=1)))


def test_a_quorum_round_steps_at_the_quorum_and_drops_the_straggler_late(tiny, tmp_path):
    summary, _, rows, cfg = _run(tiny, tmp_path, "quorum", "strategy.quorum=0.6")
    ar2 = _allreduce(cfg, [0, 1])
    # round 1: 3 nodes, quorum ceil(0.6 x 3) = 2: ends when node 0 (3 s) has replied; node 2 (6.75 s) is late
    # round 2: nodes 0 and 1 only (node 2 still busy), quorum 2: 3 s more; node 2's reply comes (t = 6.75) and is dropped
    # round 3: node 2 is free again: as round 1
    assert [r["outer/accepted"] for r in rows] == [2, 2, 2]
    assert [r["outer/pending"] for r in rows] == [1, 0, 1]
    assert [r["outer/late_dropped"] for r in rows] == [0, 1, 0]
    assert [r["time/virtual_s"] for r in rows] == pytest.approx([3 + ar2, 2 * (3 + ar2), 3 * (3 + ar2)], rel=1e-9)
    assert summary["tokens"] == 6 * PER_JOB and summary["rejected"] == 0
    # goodput by hand at the end of round 3 (t = 3T, T = 3 s + ar2): nodes 0 and 1 each folded 3
    # jobs (3 s of compute; 1.5 s of compute + 0.75 s of latency); node 2's dropped late reply is
    # its whole 6.75 s job thrown away as stale, never useful; its round-3 job has run T s
    t_round = 3 + ar2
    g = rows[-1]
    assert g["goodput/useful_s"] == pytest.approx(3 * (3 + 1.5))
    assert g["goodput/comm_s"] == pytest.approx(3 * 0.75)
    assert g["goodput/stale_s"] == pytest.approx(6.75) and g["goodput/lost_s"] == 0
    assert g["goodput/in_flight_s"] == pytest.approx(t_round)
    assert g["goodput/provisioned_s"] == pytest.approx(3 * 3 * t_round)
    assert g["goodput/waiting_s"] == pytest.approx(9 * t_round - 13.5 - 2.25 - 6.75 - t_round)
    assert summary["goodput"] == pytest.approx(13.5 / (9 * t_round))
    waited, _, full, _ = _run(tiny, tmp_path, "waited")  # every round waits for node 2: 6.75 s each
    ar3 = _allreduce(cfg, [0, 1, 2])
    assert [r["time/virtual_s"] for r in full] == pytest.approx([6.75 + ar3, 2 * (6.75 + ar3), 3 * (6.75 + ar3)], rel=1e-9)
    assert waited["tokens"] == 9 * PER_JOB


def test_late_replies_can_be_folded_next_round_with_the_staleness_weight(tiny, tmp_path):
    summary, final, rows, _ = _run(tiny, tmp_path, "fold", "strategy.quorum=0.6", "strategy.late_replies=fold")
    assert [r["outer/accepted"] for r in rows] == [2, 3, 2] and [r["outer/late_folded"] for r in rows] == [0, 1, 0]
    assert summary["tokens"] == 7 * PER_JOB
    # the folded late reply is accepted progress: node 2's 6 s of compute count as useful
    assert rows[-1]["goodput/useful_s"] == pytest.approx(3 * (3 + 1.5) + 6)
    assert rows[-1]["goodput/stale_s"] == 0 and rows[-1]["goodput/comm_s"] == pytest.approx(4 * 0.75)
    _, dropped, _, _ = _run(tiny, tmp_path, "drop", "strategy.quorum=0.6")
    assert not torch.equal(final, dropped)  # the late update was folded


def test_a_quorum_of_every_node_is_the_waiting_round_bit_for_bit(tiny, tmp_path):
    _, waited, rows_w, _ = _run(tiny, tmp_path, "waited")
    _, everyone, rows_q, _ = _run(tiny, tmp_path, "everyone", "strategy.quorum=1.0")
    assert torch.equal(waited, everyone)
    assert [r["time/virtual_s"] for r in rows_w] == [r["time/virtual_s"] for r in rows_q]


@pytest.mark.parametrize("overrides, needle", [
    (["strategy.quorum=1.5"], r"strategy.quorum must be in \[0, 1\]"),
    (["strategy.quorum=0.5", "strategy.name=fedbuff"], "strategy.quorum is for synchronous strategies"),
    (["strategy.late_replies=keep"], "strategy.late_replies must be drop or fold"),
    (["strategy.quorum=0.5", "strategy.late_replies=fold", "strategy.name=edit"], "late_replies=fold with the penalty"),
    (["strategy.quorum=0.5", "run.checkpoint_every=1"], "strategy.quorum with run.checkpoint_every"),
    (["strategy.quorum=0.5", "strategy.late_replies=fold", "strategy.robust=median_norm"],
     "late_replies=fold with strategy.robust=median_norm"),
])
def test_bad_quorum_settings_are_config_errors(tiny, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny(*overrides)
