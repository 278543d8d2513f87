"""Asynchronous strategies end to end on the virtual clock (in-process grid, real ClientApp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import fail_train_on, keep_declaration

VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16"]
DIPS = ["strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
        "penalty.clip=1.0", "penalty.warmup=2"]


def _run(cfg, tmp_path, name="run", grid=None, hook=None, seed=0):
    grid = grid or InlineGrid(client_app, cfg.run.num_clients, seed=seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"], grid


@pytest.mark.parametrize(
    "strategy",
    [["strategy.name=fedbuff", "strategy.staleness_weighting=true"], ["strategy.name=fedasync"],
     ["strategy.name=async_diloco"], ["strategy.name=async_local_sgd", "strategy.dynupd=true"], DIPS],
    ids=["fedbuff", "fedasync", "async_diloco", "async_local_sgd", "dips"],
)
def test_same_seed_same_bits_whatever_the_node_ids(tiny, tmp_path, strategy):
    cfg = tiny(*VIRTUAL, *strategy, "run.rounds=5")
    s1, a, _ = _run(cfg, tmp_path, "a", seed=0)
    s2, b, _ = _run(cfg, tmp_path, "b", seed=7)  # other Flower node ids, other push order
    assert torch.equal(a, b)
    assert s1["outer_steps"] == s2["outer_steps"] == 5 and s1["virtual_s"] == s2["virtual_s"] > 0


def test_staleness_grows_for_slow_workers_and_is_logged(tiny, tmp_path):
    _run(tiny(*VIRTUAL, "strategy.name=async_diloco", "run.rounds=8"), tmp_path)
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["outer/accepted"] for r in rows] == [1] * 8
    assert max(r["outer/staleness_max"] for r in rows) >= 2
    times = [r["time/virtual_s"] for r in rows]
    assert times == sorted(times) and times[0] > 0


class InFlightGuard(InlineGrid):
    """Fails the test if a node ever has two messages queued."""

    def push_messages(self, messages):
        messages = list(messages)
        queued = [m.metadata.dst_node_id for m in self._queue.values()]
        for m in messages:
            assert m.metadata.dst_node_id not in queued, "two messages in flight to one node"
            queued.append(m.metadata.dst_node_id)
        return super().push_messages(messages)


def test_never_two_messages_in_flight_to_one_node(tiny, tmp_path):
    cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=6")
    summary, _, grid = _run(cfg, tmp_path, grid=InFlightGuard(client_app, 4))
    assert summary["outer_steps"] == 6
    assert not grid._queue  # clean drain: nothing left in flight


def _scale_once(node_pick, factor):
    state = {"done": False, "trains": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        state["trains"] += 1
        if state["done"] or state["trains"] < node_pick:
            return reply
        state["done"] = True
        arrays = reply.content.array_records["arrays"]
        scaled = {}
        for k, a in arrays.items():
            x = torch.from_numpy(a.numpy().copy()).view(torch.bfloat16).float() * factor
            scaled[k] = Array(x.to(torch.bfloat16).view(torch.int16).numpy())
        content = keep_declaration(reply, {"arrays": ArrayRecord(scaled), "metrics": reply.content.metric_records["metrics"]})
        return Message(content, reply_to=msg)

    return hook


def test_update_scaled_x100_after_warmup_is_rejected_others_accepted(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=12", "strategy.inner_steps=4")
    summary, final, _ = _run(cfg, tmp_path, hook=_scale_once(node_pick=14, factor=100.0))
    assert summary["rejected"] == 1
    assert "outlier" in caplog.text and "rejected update from node" in caplog.text
    assert torch.isfinite(final).all() and summary["outer_steps"] == 12


def test_without_penalty_the_scaled_update_gets_in(tiny, tmp_path):
    cfg = tiny(*VIRTUAL, "strategy.name=async_diloco", "run.rounds=12", "strategy.inner_steps=4")
    summary, _, _ = _run(cfg, tmp_path, hook=_scale_once(node_pick=5, factor=100.0))
    assert summary["rejected"] == 0  # naive async DiLoCo has no outlier test


@pytest.mark.parametrize("kind", ["nan", "shape"])
def test_bad_payload_is_rejected_and_the_run_continues(tiny, tmp_path, kind):
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error() or hook.done:
            return reply
        hook.done = True
        items = dict(reply.content.array_records["arrays"].items())
        key = next(iter(items))
        arr = items[key].numpy().copy()
        if kind == "nan":
            arr.reshape(-1)[0] = np.int16(0x7FC0)  # a bf16 NaN bit pattern
        else:
            arr = arr.reshape(-1)[:-1]
        items[key] = Array(arr)
        return Message(keep_declaration(reply, {"arrays": ArrayRecord(items), "metrics": reply.content.metric_records["metrics"]}), reply_to=msg)

    hook.done = False
    summary, final, _ = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=4"), tmp_path, hook=hook)
    assert summary["rejected"] == 1 and summary["outer_steps"] == 4 and torch.isfinite(final).all()


@pytest.mark.parametrize("lie, reason", [
    ({"tokens": float("nan")}, "metric 'tokens' is nan"),
    ({"steps": 10**6}, "steps=1000000, must be a whole number"),
    ({"step_time_s": float("inf")}, "metric 'step_time_s' is inf"),
    ({"tokens": 2**40}, "tokens=1099511627776 is more than"),
], ids=["tokens-nan", "steps-beyond-job", "step-time-inf", "tokens-beyond-job"])
def test_lying_metrics_are_rejected_and_the_run_continues(tiny, tmp_path, lie, reason, caplog):
    """The first train reply lies in one metric: it is rejected for that field (logged, counted
    once), and the asynchronous loop goes on exactly as when that same reply is refused for
    another reason: the same outer steps and a bit-identical model (before: int(nan) or the
    unchecked value ended or skewed the run)."""
    def lying(lie):
        def hook(node, msg, reply):
            if msg.metadata.message_type != "train" or reply.has_error() or hook.done:
                return reply
            hook.done = True
            metrics = MetricRecord({**dict(reply.content.metric_records["metrics"]), **lie})
            return Message(keep_declaration(reply, {"arrays": reply.content.array_records["arrays"],
                                                    "metrics": metrics}), reply_to=msg)
        hook.done = False
        return hook

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=4")
    summary, final, _ = _run(cfg, tmp_path, "lie", hook=lying(lie))
    assert summary["rejected"] == 1 and summary["outer_steps"] == 4
    assert caplog.text.count(reason) == 1, caplog.text[-2000:]
    refused, reference, _ = _run(cfg, tmp_path, "refused", hook=lying({"train_loss": float("nan")}))
    assert refused["rejected"] == 1 and torch.equal(final, reference)


def test_node_leaving_mid_run_loses_nothing_and_does_not_stall(tiny, tmp_path):
    cfg = tiny(*VIRTUAL, "strategy.name=async_diloco", "run.rounds=10")
    grid = InlineGrid(client_app, 4, seed=0)
    victim = sorted(grid.contexts)[3]  # the slowest datacenter of the eta scenario
    seen = {"n": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train":
            seen["n"] += 1
            if seen["n"] == 5:
                grid.remove_node(victim)
        return reply

    summary, final, _ = _run(cfg, tmp_path, grid=grid, hook=hook)
    assert summary["outer_steps"] == 10 and torch.isfinite(final).all()
    rows = read_metrics(tmp_path / "run")[1:]
    assert sum(r["outer/accepted"] for r in rows) == 10  # every accepted update became a step


def test_node_joining_mid_run_gets_the_latest_model(tiny, tmp_path):
    cfg = tiny(*VIRTUAL, "strategy.name=async_diloco", "run.rounds=8", "run.min_nodes=3")
    grid = InlineGrid(client_app, 3, seed=0, node_configs=[{"partition-id": i, "num-partitions": 4} for i in range(3)])
    joined = {}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train" and "id" not in joined:
            joined["id"] = grid.add_node({"partition-id": 3, "num-partitions": 4})
        if node == joined.get("id") and msg.metadata.message_type == "train":
            joined.setdefault("base_version", int(msg.content.config_records["fl-geo"]["base_version"]))
        return reply

    summary, _, _ = _run(cfg, tmp_path, grid=grid, hook=hook)
    assert summary["outer_steps"] == 8
    assert joined.get("base_version", -1) >= 1  # it started from a model that had already been stepped


def test_share_lr_scaling_scales_single_update_steps(tiny, tmp_path):
    """With buffer 1 and 4 workers, lr x 1/4 per step: the first step moves the model 4x less."""
    from fl_geo.core.state import flatten
    from fl_geo.runtime.builders import make_model

    base = ["strategy.name=async_diloco", "strategy.outer_momentum=0.0", "run.rounds=1", *VIRTUAL]
    init = flatten(make_model(tiny(*base).model, 0).state_dict())
    _, full, _ = _run(tiny(*base), tmp_path, "full")
    _, share, _ = _run(tiny(*base, "strategy.outer_lr_scaling=share"), tmp_path, "share")
    torch.testing.assert_close(share - init, (full - init) / 4, rtol=1e-4, atol=1e-6)


def test_a_node_failing_three_jobs_in_a_row_is_benched_and_the_run_goes_on(tiny, tmp_path, caplog):
    """A site whose ClientApp raises on every train message: three error replies (each counted
    in ``outer/failed``), then it is benched: no fourth job goes to it, the run ends its steps."""
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny(*VIRTUAL, "strategy.name=async_diloco", "run.rounds=8")
    grid = InlineGrid(client_app, 4, seed=0)
    victim = sorted(grid.contexts)[0]
    fail_train_on(grid, victim)
    summary, final, _ = _run(cfg, tmp_path, grid=grid)
    assert summary["outer_steps"] == 8 and summary["rejected"] == 0
    assert [t for n, t in grid.executed if n == victim].count("train") == 3
    assert sum(r["outer/failed"] for r in read_metrics(tmp_path / "run")[1:]) == 3
    assert f"node {victim} failed 3 jobs in a row; no more jobs go to it" in caplog.text
