"""HALoS under a failure trace on the virtual clock: a local server whose workers are all down,
every worker down, and workers woken at their repair time (not at the next unrelated event).

Tiny scenario: node 0 in region A (1 s per step), nodes 1 and 2 in region B (speeds 2 and 0.5);
each worker talks to its region's local server over the intra-region link (4,000 bytes at 80 or
40 Gbit/s: microseconds), so with H = 2 a job of node 0 takes 2 s, node 1 1 s, node 2 4 s.
"""

from __future__ import annotations

import json

import pytest
from flwr.app import MessageType

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.dispatch import Dispatcher
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import tiny_scenario_dict

HALOS = ("strategy.name=halos", "halos.accumulate=2", "halos.local_buffer=2", "strategy.delay_buffer=2",
         "strategy.inner_steps=2", "run.clock=virtual")


def _run(tiny, tmp_path, monkeypatch, failures, *overrides):
    """Run HALoS; returns the summary, the metric rows and every train dispatch (virtual time,
    partition id, the local server model version it was sent)."""
    sc = tmp_path / "sc.json"
    sc.write_text(json.dumps(tiny_scenario_dict(failures=failures)))
    sent: list[tuple[float, int, int]] = []
    submit = Dispatcher.submit

    def recording(self, messages, timings=None, meta=None, **kwargs):
        for i, m in enumerate(messages):
            if m.metadata.message_type == MessageType.TRAIN and timings is not None:
                sent.append((self.clock.now(), timings[i].slot, int(meta[i]["version"])))
        return submit(self, messages, timings, meta, **kwargs)

    monkeypatch.setattr(Dispatcher, "submit", recording)
    cfg = tiny(*HALOS, f"run.scenario={sc}", *overrides)
    summary = run_server(InlineGrid(client_app, cfg.run.num_clients, seed=0), cfg, tmp_path / "run")
    return summary, read_metrics(tmp_path / "run")[1:], sent


def test_every_worker_down_waits_for_the_first_repair(tiny, tmp_path, monkeypatch):
    """Both regions out from 0 s (A until 5 s, B until 9 s): no stall, no 'no live node' stop;
    node 0 gets the first job at 5 s, nodes 1 and 2 theirs at 9 s."""
    s, rows, sent = _run(tiny, tmp_path, monkeypatch,
                         [{"region": "A", "at_time": 0.0, "duration": 5.0},
                          {"region": "B", "at_time": 0.0, "duration": 9.0}], "run.rounds=3")
    assert s["failure"] is None and s["outer_steps"] == 3
    first = {}
    for t, slot, _ in sent:
        first.setdefault(slot, t)
    assert first == {0: 5.0, 1: 9.0, 2: 9.0}
    t = rows[0]["time/virtual_s"]
    assert rows[0]["goodput/provisioned_s"] == pytest.approx((t - 5.0) + 2 * max(0.0, t - 9.0), abs=1e-9)


def test_a_local_server_whose_workers_are_all_down_is_woken_at_their_repair(tiny, tmp_path, monkeypatch):
    """Region B (local server 1: nodes 1 and 2) is out over [1.5, 3.5): node 1's second job (sent
    at ~1 s) and node 2's first (4 s long) are lost at 1.5 s. Region A keeps training meanwhile.
    At 3.5 s, between node 0's replies (~2, ~4 s), both B workers get a job at once, each with
    local server 1's current model version."""
    s, rows, sent = _run(tiny, tmp_path, monkeypatch, [{"region": "B", "at_time": 1.5, "duration": 2.0}],
                         "run.rounds=4")
    assert s["failure"] is None and s["outer_steps"] == 4 and s["lost_to_failures"] == 2
    b_jobs = [(t, slot, v) for t, slot, v in sent if slot in (1, 2)]
    assert not [t for t, _, _ in b_jobs if 1.5 <= t < 3.5]  # nothing is sent to a down worker
    rejoined = [(slot, v) for t, slot, v in b_jobs if t == 3.5]
    assert sorted(slot for slot, _ in rejoined) == [1, 2]
    # both are sent the same (latest) local-server model, at least as new as any earlier B job's
    versions = {v for _, v in rejoined}
    assert len(versions) == 1 and versions.pop() >= max(v for t, _, v in b_jobs if t < 3.5)
    assert [t for t, slot, _ in sent if slot == 0][:3] == pytest.approx([0.0, 2.0, 4.0], abs=1e-4)
