"""HALoS in one ServerApp on the in-process grid: local servers per region, updates flowing through
both tiers in virtual-time order, determinism, grouping and bad input."""

from __future__ import annotations

import json

import torch
from flwr.app import Array, ArrayRecord, Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import keep_declaration, partition_reply_hook, tiny_scenario_dict

HALOS = ("strategy.name=halos", "halos.accumulate=2", "halos.local_buffer=2", "strategy.delay_buffer=2",
         "strategy.inner_steps=2", "run.rounds=3", "run.clock=virtual")


def _scenario(tmp_path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_scenario_dict()))
    return str(path)


def _run(cfg, tmp_path, name="run", hook=None):
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"], grid


def test_updates_flow_through_both_tiers(tiny, tmp_path, caplog):
    caplog.set_level("INFO", logger="fl_geo")
    cfg = tiny(*HALOS, f"run.scenario={_scenario(tmp_path)}")
    summary, final, grid = _run(cfg, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert summary["outer_steps"] == 3  # global updates
    # two local servers: region A (node 0) and region B (nodes 1, 2)
    assert "local server 0 in region A" in caplog.text and "local server 1 in region B" in caplog.text
    assert "local server 2" not in caplog.text
    # every global update needed K = 2 local updates from one local server
    assert rows[-1]["outer/local_updates"] >= 2 * 3
    assert all(r["outer/group"] in (0, 1) for r in rows[:3])
    times = [r["time/virtual_s"] for r in rows]
    assert times == sorted(times) and times[0] > 0
    assert torch.isfinite(final).all() and rows[-1]["val/loss"] < read_metrics(tmp_path / "run")[0]["val/loss"]


def test_same_seed_same_model(tiny, tmp_path):
    cfg = tiny(*HALOS, f"run.scenario={_scenario(tmp_path)}")
    _, a, _ = _run(cfg, tmp_path, "a")
    _, b, _ = _run(cfg, tmp_path, "b")
    assert torch.equal(a, b)


def test_consistent_grouping_makes_one_local_server_per_group(tiny, tmp_path, caplog):
    caplog.set_level("INFO", logger="fl_geo")
    cfg = tiny(*HALOS, "halos.group_size=1", f"run.scenario={_scenario(tmp_path)}")
    _run(cfg, tmp_path)
    assert "local server 2 in region B" in caplog.text


def test_wall_clock_exchanges_at_once(tiny, tmp_path):
    cfg = tiny(*[o for o in HALOS if o != "run.clock=virtual"])
    summary, final, _ = _run(cfg, tmp_path)
    assert summary["outer_steps"] == 3 and torch.isfinite(final).all()


def test_a_nan_update_is_rejected_and_the_run_goes_on(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    seen = {"n": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        seen["n"] += 1
        if seen["n"] == 2:  # the second reply carries a NaN
            items = dict(reply.content.array_records["arrays"].items())
            key = next(iter(items))
            arr = items[key].numpy().copy()
            arr.reshape(-1)[0] = float("nan")
            items[key] = Array(arr)
            content = keep_declaration(reply, {"arrays": ArrayRecord(items), "metrics": reply.content.metric_records["metrics"]})
            return Message(content, reply_to=msg)
        return reply

    cfg = tiny(*HALOS, f"run.scenario={_scenario(tmp_path)}")
    summary, final, _ = _run(cfg, tmp_path, hook=hook)
    assert summary["rejected"] == 1 and summary["outer_steps"] == 3
    assert torch.isfinite(final).all() and "rejected update from node" in caplog.text


def test_diloco_with_dynupd_gives_speed_proportional_steps(tiny, tmp_path):
    """HALoS Table 1's DiLoCo+DynUpd: speeds 1, 2, 0.5 and H = 4 give ceil(4·s/2) = 2, 4, 1 steps."""
    cfg = tiny("strategy.dynupd=true", "strategy.inner_steps=4", "run.rounds=1", "run.clock=virtual",
               f"run.scenario={_scenario(tmp_path)}")
    summary, _, _ = _run(cfg, tmp_path)
    assert summary["tokens"] == (2 + 4 + 1) * 4 * 32


def test_dynupd_needs_a_virtual_clock(tiny):
    import pytest

    from fl_geo.config import ConfigError

    with pytest.raises(ConfigError, match="dynupd needs run.clock=virtual"):
        tiny("strategy.dynupd=true")


# ---- replies that answer no job in flight (issue 26) -------------------------------------------


def _nan_reply(reply, msg):
    """The same reply with a NaN in its update: refused for another reason (the baseline)."""
    items = dict(reply.content.array_records["arrays"].items())
    key = next(iter(items))
    arr = items[key].numpy().copy()
    arr.reshape(-1)[0] = float("nan")
    items[key] = Array(arr)
    return Message(keep_declaration(reply, {"arrays": ArrayRecord(items),
                                            "metrics": reply.content.metric_records["metrics"]}), reply_to=msg)


def test_replayed_replies_are_refused_and_the_model_is_the_one_without_them(tiny, tmp_path, caplog):
    """A site answers its 2nd and 3rd jobs with its 1st reply, replayed (the issue: HALoS
    accepted 2 of 2). Each is refused for its version (the job's local-server version is not
    the one the reply trained from); the model is bit-identical to the run in which those two
    replies were refused for a NaN instead."""
    from flwr.app import MetricRecord

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny(*HALOS, f"run.scenario={_scenario(tmp_path)}")

    def replay(n, reply, msg, earlier):
        if n not in (2, 3):
            return reply
        old = earlier[0]
        return Message(keep_declaration(old, {"arrays": old.content.array_records["arrays"],
                                              "metrics": MetricRecord(dict(old.content.metric_records["metrics"]))}),
                       reply_to=msg)

    summary, final, _ = _run(cfg, tmp_path, "replayed", hook=partition_reply_hook(1, replay))
    assert summary["rejected"] == 2 and summary["outer_steps"] == 3
    assert caplog.text.count("reply says it trained from model version") == 2
    nan_summary, without, _ = _run(cfg, tmp_path, "nan", hook=partition_reply_hook(
        1, lambda n, reply, msg, earlier: _nan_reply(reply, msg) if n in (2, 3) else reply))
    assert nan_summary["rejected"] == 2
    assert torch.equal(final, without)


def test_a_reply_claiming_a_version_never_sent_is_refused(tiny, tmp_path, caplog):
    """``base_version = 12345`` (the issue: accepted): refused, model as with the NaN refusal."""
    from flwr.app import MetricRecord

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny(*HALOS, f"run.scenario={_scenario(tmp_path)}")

    def forge(n, reply, msg, earlier):
        if n != 2:
            return reply
        metrics = MetricRecord({**dict(reply.content.metric_records["metrics"]), "base_version": 12345})
        return Message(keep_declaration(reply, {"arrays": reply.content.array_records["arrays"],
                                                "metrics": metrics}), reply_to=msg)

    summary, final, _ = _run(cfg, tmp_path, "forged", hook=partition_reply_hook(1, forge))
    assert summary["rejected"] == 1 and "trained from model version 12345" in caplog.text
    _, without, _ = _run(cfg, tmp_path, "nan", hook=partition_reply_hook(
        1, lambda n, reply, msg, earlier: _nan_reply(reply, msg) if n == 2 else reply))
    assert torch.equal(final, without)
