"""Di-PS with a sharded parameter server (strategies/sharded.py) end to end on the virtual clock.

In-process followers (``ps.transport=local``); the gRPC transport is tested in test_sharded_grpc.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import keep_declaration

VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16", "model.n_layers=3"]
DIPS = ["strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
        "penalty.clip=1.0", "penalty.warmup=2"]


def _run(cfg, tmp_path, name="run", hook=None):
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=0)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"]


@pytest.mark.parametrize("base", ["dispatch", "current"])
def test_one_two_four_followers_end_bit_identical(tiny, tmp_path, base):
    finals, summaries = {}, {}
    for f in (1, 2, 4):
        cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=4", f"ps.followers={f}", f"strategy.pseudo_grad_base={base}")
        summaries[f], finals[f] = _run(cfg, tmp_path, f"f{f}")
    assert torch.equal(finals[1], finals[2]) and torch.equal(finals[1], finals[4])
    assert {s["outer_steps"] for s in summaries.values()} == {4}
    assert len({s["virtual_s"] for s in summaries.values()}) == 1
    steps = [[r.get("outer/accepted") for r in read_metrics(tmp_path / f"f{f}")] for f in (1, 2, 4)]
    assert steps[0] == steps[1] == steps[2]
    # the single-server Di-PS (the whole model in the ServerApp) is the one-follower case, bit for bit
    s0, unsharded = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=4", f"strategy.pseudo_grad_base={base}"), tmp_path, "f0")
    assert s0["outer_steps"] == 4
    assert torch.equal(unsharded, finals[1])


def test_sum_of_shard_norms_rule_runs(tiny, tmp_path):
    summary, final = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=3", "ps.followers=2", "ps.norm=sum_of_shards"), tmp_path)
    assert summary["outer_steps"] == 3 and torch.isfinite(final).all()


def _nan_once(node, msg, reply):
    if msg.metadata.message_type != "train" or reply.has_error() or _nan_once.done:
        return reply
    _nan_once.done = True
    items = dict(reply.content.array_records["arrays"].items())
    key = list(items)[-1]  # a tensor of the last shard
    arr = items[key].numpy().copy()
    arr.reshape(-1)[0] = np.int16(0x7FC0)  # a bf16 NaN
    items[key] = Array(arr)
    return Message(keep_declaration(reply, {"arrays": ArrayRecord(items), "metrics": reply.content.metric_records["metrics"]}), reply_to=msg)


def test_nan_update_is_rejected_and_leaves_nothing_on_the_followers(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    _nan_once.done = False
    summary, final = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=4", "ps.followers=2"), tmp_path, hook=_nan_once)
    assert summary["rejected"] == 1 and summary["outer_steps"] == 4 and torch.isfinite(final).all()
    assert "NaN or Inf" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "match"),
    [(["strategy.name=fedbuff", "ps.followers=2"], "strategy dips"),
     ([*DIPS, "ps.followers=2", "penalty.granularity=module"], "granularity=global"),
     ([*DIPS, "ps.followers=2", "ps.transport=grpc", "run.checkpoint_every=3"], "must exceed run.checkpoint_every"),
     ([*DIPS, "ps.transport=tcp"], "local or grpc"),
     ([*DIPS, "ps.norm=max"], "global or sum_of_shards")],
)
def test_config_errors(tiny, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny(*overrides)


def test_more_followers_than_layers_is_a_config_error(tiny, tmp_path):
    with pytest.raises(ConfigError, match="only 5 layers"):
        _run(tiny(*VIRTUAL, *DIPS, "run.rounds=1", "ps.followers=9"), tmp_path)


# ---- the gRPC transport's train reply: metrics only, checked like every other reply -------------

GOOD_CONTROL = {"tokens": 384, "steps": 3, "train_loss": 2.5, "step_time_s": 0.1, "partition_id": 0,
                "base_version": 4, "ps_version": 5, "ps_pushed_bytes": 1000, "ps_pulled_bytes": 4000}


@pytest.mark.parametrize("lie, reason", [
    ({"tokens": float("nan")}, "metric 'tokens' is nan"),
    ({"tokens": 10**12}, "is more than 3 steps can produce"),
    ({"steps": 99}, "steps=99, must be a whole number [1, 3]"),
    ({"ps_version": 7}, "pulled model version 7, the followers hold 6"),
    ({"ps_version": 3}, "pulled model version 3, older than the 4"),
    ({"ps_version": float("inf")}, "metric 'ps_version' is inf"),
    ({"ps_pushed_bytes": -1}, "ps_pushed_bytes=-1"),
    ({"ps_pulled_bytes": 10**9}, "ps_pulled_bytes=1000000000, must be a whole number [0, 32000]"),
    ({"ps_pulled_bytes": 0.5}, "ps_pulled_bytes=0.5"),
    ({"base_version": 5}, "trained from model version 5, the job sent version 4"),
], ids=["tokens-nan", "tokens-beyond-job", "steps-beyond-job", "version-from-the-future", "version-older",
        "version-inf", "pushed-negative", "pulled-beyond-any-pull", "pulled-fractional", "base-version"])
def test_a_lying_control_reply_is_a_reply_error(lie, reason, monkeypatch):
    """``read_control_reply`` (ps.transport=grpc) refuses every lying scalar with a ReplyError the
    loop counts; before, ``int(nan)`` raised out of the loop and a future ``ps_version`` made the
    staleness negative."""
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fl_geo.clients.api import declared
    from fl_geo.runtime.dispatch import Event, Job
    from fl_geo.strategies.replies import ReplyError
    from fl_geo.strategies.sharded import read_control_reply

    for attr in ("_task_id", "_run_id", "_node_id"):  # a Message needs a run to belong to
        monkeypatch.setattr(TaskIdentity, attr, 1)

    def event(metrics):
        reply = Message(RecordDict(declared({"metrics": MetricRecord(metrics)}, "control", "fp32")),
                        dst_node_id=1, message_type="train")
        return Event(Job("j", 1, "train", 0, 0.0), reply, None, 0.0)

    r, pulled, received = read_control_reply(event(GOOD_CONTROL), 4, 6, max_steps=3, step_tokens=128,
                                             most_pulled=32000)
    assert (r.tokens, r.steps, r.nbytes, pulled, received) == (384, 3, 1000, 5, 4000)
    without = {k: v for k, v in GOOD_CONTROL.items() if k != "ps_pulled_bytes"}  # a client that does not say
    assert read_control_reply(event(without), 4, 6, max_steps=3, step_tokens=128, most_pulled=32000)[2] is None
    with pytest.raises(ReplyError) as err:
        read_control_reply(event({**GOOD_CONTROL, **lie}), 4, 6, max_steps=3, step_tokens=128, most_pulled=32000)
    assert reason in str(err.value)
