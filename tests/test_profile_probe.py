"""``clients="auto"`` finds out what runs on each node without making a plain Flower ClientApp raise.

The profile probe is a ``train`` message (fl_geo.runtime.profiling): a plain ClientApp trains on
it and that reply answers its first train job; fl-geo's ClientApp answers with its profile. No
node is sent a message type it has no handler for (Flower logs a traceback on the node for one),
fl-geo clients are profiled exactly as with the ``query`` message, a forged declaration is
refused in one line, and the progress line shows a train loss only when replies carry one.
"""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fl_geo.clients.datacenter import app as fl_geo_app
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.dispatch import Dispatcher
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.profiling import probe_profiles
from fl_geo.runtime.progress import Progress
from fl_geo.runtime.protocol import (
    PROFILE_KEY,
    PROTOCOL_KEY,
    PROTOCOL_VERSION,
    REQUEST_RECORD,
    is_profile_probe,
)
from fl_geo.runtime.wire import encode
from fl_geo.strategies import DiLoCo, FedBuff
from tests import plain_flower_app as plain
from tests.conftest import fail_train_on
from tests.test_public_strategies import TINY_OPTIONS

OPTIONS = {**TINY_OPTIONS, "model.n_layers": 1}


def _plain_initial() -> ArrayRecord:
    return ArrayRecord(plain.initial_model().state_dict())


def _fl_geo_initial(strategy: DiLoCo) -> ArrayRecord:
    return ArrayRecord(make_model(strategy.config.model, 0).state_dict())


def _types(grid: InlineGrid) -> list[str]:
    return [t for _, t in grid.executed]


def test_a_plain_clientapp_under_auto_is_sent_no_query_and_nothing_is_logged(caplog):
    """Under the default ``clients="auto"``, the plain app only ever gets ``train`` messages (so
    Flower has nothing to log a traceback for), fl-geo logs no warning, and the probe's reply is
    the first round's update: no extra job, and the very model ``clients="flower"`` gives."""
    caplog.set_level(logging.DEBUG)
    grid = InlineGrid(plain.app, 3, seed=0)
    stream = io.StringIO()
    auto = DiLoCo(inner_steps=plain.STEPS, progress=Progress("auto", 2, stream=stream))
    result = auto.start(grid, _plain_initial(), num_rounds=2, train_config=ConfigRecord({"lr": 0.5}))
    assert _types(grid) == ["train"] * 6  # 3 probes that are round 1's jobs, then round 2
    assert "No query function registered" not in caplog.text and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("fl_geo")]
    assert all(not p.fl_geo_client for p in auto.loop.profiles.values())
    assert auto.stats.outer_steps == 2 and auto.stats.rejected == 0

    flower = DiLoCo(inner_steps=plain.STEPS, clients="flower")
    expected = flower.start(InlineGrid(plain.app, 3, seed=0), _plain_initial(), num_rounds=2,
                            train_config=ConfigRecord({"lr": 0.5}))
    assert torch.equal(flatten(result.arrays.to_torch_state_dict()), flatten(expected.arrays.to_torch_state_dict()))
    assert "train " in stream.getvalue()  # this app reports train_loss


def test_the_progress_line_leaves_out_the_train_loss_when_no_reply_carries_one():
    grid = InlineGrid(plain.app, 2, seed=0)

    def no_loss(node: int, msg: Message, reply: Message) -> Message:
        if reply.has_error():
            return reply
        metrics = MetricRecord({"num-examples": reply.content.metric_records["metrics"]["num-examples"]})
        return Message(RecordDict({"arrays": reply.content.array_records["arrays"], "metrics": metrics}), reply_to=msg)

    grid.reply_hook = no_loss
    stream = io.StringIO()
    strategy = DiLoCo(inner_steps=plain.STEPS, progress=Progress("quiet", 2, stream=stream))
    strategy.start(grid, _plain_initial(), num_rounds=2, evaluate_fn=plain.evaluate_fn)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all("| val " in line for line in lines)
    assert not any("nan" in line or "train" in line for line in lines), lines
    assert Progress("x", 2, enabled=False).update(1, float("nan"), float("nan")).count("nan") == 1  # val NaN stays


def test_fl_geo_clients_under_auto_are_profiled_as_with_the_query_and_train_the_same_model():
    """The probe reaches fl-geo's ClientApp as a ``train`` message; it answers its profile and
    trains nothing: the same profiles and the same model bits as ``clients="fl-geo"``."""
    finals, profiles = [], []
    for clients in ("auto", "fl-geo"):
        strategy = DiLoCo(inner_steps=3, clients=clients, options=OPTIONS)
        grid = InlineGrid(fl_geo_app, 3, seed=0)
        result = strategy.start(grid, _fl_geo_initial(strategy), num_rounds=2)
        finals.append(flatten(result.arrays.to_torch_state_dict()))
        profiles.append({n: (p.partition_id, p.fl_geo_client) for n, p in strategy.loop.profiles.items()})
        first = "train" if clients == "auto" else "query"
        assert _types(grid) == [first] * 3 + ["train"] * 6 and strategy.stats.rejected == 0
    assert profiles[0] == profiles[1] and sorted(p for p, _ in profiles[0].values()) == [0, 1, 2]
    assert all(fl_geo for _, fl_geo in profiles[0].values())
    assert torch.equal(finals[0], finals[1])


def _forge(kind: str):
    def hook(node: int, msg: Message, reply: Message) -> Message:
        if not is_profile_probe(msg) or node != liar[0]:
            return reply
        decl = reply.content.config_records[REQUEST_RECORD]
        profile = reply.content.config_records[PROFILE_KEY]
        if kind == "version":
            decl = ConfigRecord({**decl, PROTOCOL_KEY: PROTOCOL_VERSION + 1})
        elif kind == "payload":
            decl = ConfigRecord({**decl, "payload": "pseudo_grad"})
        elif kind == "unknown-field":
            decl = ConfigRecord({**decl, "trust_me": True})
        elif kind == "partition":
            profile = ConfigRecord({**profile, "partition_id": 7})
        records = {REQUEST_RECORD: decl} if kind == "no-profile" else {REQUEST_RECORD: decl, PROFILE_KEY: profile}
        return Message(RecordDict(records), reply_to=msg)

    liar: list[int] = []
    return hook, liar


@pytest.mark.parametrize("kind, reason", [
    ("version", f"protocol version {PROTOCOL_VERSION + 1}"),
    ("payload", "declares a 'pseudo_grad' payload"),
    ("unknown-field", r"unknown field\(s\) \['trust_me'\]"),
    ("no-profile", "has no 'profile' record"),
    ("partition", "'partition_id'=7 must be a whole number in \\[0, 2\\]"),
])
def test_a_forged_probe_declaration_is_refused_in_one_line_and_the_rest_train(kind, reason, caplog):
    caplog.set_level(logging.WARNING, logger="fl_geo")
    grid = InlineGrid(fl_geo_app, 3, seed=0)
    hook, liar = _forge(kind)
    liar.append(min(grid.get_node_ids()))
    grid.reply_hook = hook
    strategy = DiLoCo(inner_steps=3, options=OPTIONS)
    strategy.start(grid, _fl_geo_initial(strategy), num_rounds=2)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"refused node {liar[0]}:")]
    assert len(refusals) == 1 and "\n" not in refusals[0], caplog.text
    assert re.search(reason, refusals[0]), refusals[0]
    assert [t for n, t in grid.executed if n == liar[0]] == ["train"]  # the probe, then nothing
    assert strategy.stats.outer_steps == 2 and liar[0] not in strategy.loop.profiles


def test_a_node_whose_probe_fails_is_logged_in_one_line_and_taken_for_a_plain_clientapp(caplog):
    caplog.set_level(logging.WARNING, logger="fl_geo")
    grid = InlineGrid(plain.app, 3, seed=0)
    victim = min(grid.get_node_ids())
    fail_train_on(grid, victim, reason="the site's accelerator is gone")
    strategy = DiLoCo(inner_steps=plain.STEPS)
    strategy.start(grid, _plain_initial(), num_rounds=3)
    failed = [r.getMessage() for r in caplog.records if "failed the profile probe" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0] and "accelerator is gone" in failed[0]
    assert not strategy.loop.profiles[victim].fl_geo_client and strategy.stats.outer_steps == 3


def test_a_probe_reply_trained_from_another_model_than_the_first_job_is_dropped(caplog):
    """One node per round: the nodes not sampled in round 1 get their first job with a newer
    model, so their probe replies are dropped (logged), never folded against the wrong base."""
    caplog.set_level(logging.INFO, logger="fl_geo")
    grid = InlineGrid(plain.app, 3, seed=0)
    strategy = DiLoCo(inner_steps=plain.STEPS, clients_per_round=1)
    strategy.start(grid, _plain_initial(), num_rounds=4, evaluate_fn=plain.evaluate_fn)
    dropped = caplog.text.count("trained from another model than its first job carries; dropped")
    assert dropped >= 1 and strategy.stats.rejected == 0 and strategy.stats.outer_steps == 4
    # each round's job ran on its node, but for the one answered by its probe reply
    assert len(grid.executed) == 3 + 4 - 1


def test_a_plain_node_joining_an_asynchronous_run_is_probed_not_queried():
    grid = InlineGrid(plain.app, 2, seed=0)
    joined: dict[str, int] = {}

    def hook(node: int, msg: Message, reply: Message) -> Message:
        if msg.metadata.message_type == "train" and "id" not in joined and len(grid.executed) >= 4:
            joined["id"] = grid.add_node({"partition-id": 2, "num-partitions": 3})
        return reply

    grid.reply_hook = hook
    strategy = FedBuff(inner_steps=plain.STEPS)
    strategy.start(grid, _plain_initial(), num_rounds=6)
    assert "id" in joined and set(_types(grid)) == {"train"}
    assert not strategy.loop.profiles[joined["id"]].fl_geo_client
    assert [t for n, t in grid.executed if n == joined["id"]].count("train") >= 2  # the probe, then its jobs
    assert strategy.stats.rejected == 0 and strategy.stats.outer_steps == 6


def test_replies_that_come_during_a_probe_are_kept_for_the_loop():
    """A node joining an asynchronous run is probed while other jobs are in flight: their
    replies, pulled meanwhile, are handed over afterwards (they were dropped before)."""
    grid = InlineGrid(plain.app, 2, seed=0)
    first, second = sorted(grid.get_node_ids())
    dispatcher = Dispatcher(grid)
    model = ArrayRecord(plain.initial_model().state_dict())
    job = Message(RecordDict({"arrays": model, "config": ConfigRecord()}), dst_node_id=first,
                  message_type=MessageType.TRAIN)
    dispatcher.submit([job])
    outcome = probe_profiles(dispatcher, [second], model, None, timeout_s=0)
    assert outcome.plain == [second] and first in dispatcher.busy_nodes() and dispatcher.in_flight()
    ev = dispatcher.next_event(block=False)
    assert ev is not None and ev.ok and ev.job.node == first
    assert first not in dispatcher.busy_nodes() and not dispatcher.in_flight()


def test_the_held_reply_answers_only_a_job_with_the_probes_model_and_config():
    grid = InlineGrid(plain.app, 1, seed=0)
    (node,) = grid.get_node_ids()
    dispatcher = Dispatcher(grid)
    params = flatten(plain.initial_model().state_dict())
    spec = ParamSpec.from_state_dict(plain.initial_model().state_dict())
    probe_profiles(dispatcher, [node], encode(params, spec, "fp32"), ConfigRecord({"lr": 0.5}), timeout_s=0)

    def job(config: dict) -> Message:
        return Message(RecordDict({"arrays": encode(params, spec, "fp32"), "config": ConfigRecord(config)}),
                       dst_node_id=node, message_type=MessageType.TRAIN)

    assert len(dispatcher.held) == 1
    assert dispatcher.held.take(Message(RecordDict(), dst_node_id=node, message_type=MessageType.EVALUATE)) is None
    assert len(dispatcher.held) == 1  # an evaluate message leaves it held
    assert dispatcher.held.take(job({"lr": 0.1})) is None and len(dispatcher.held) == 0  # another config drops it
    probe_profiles(dispatcher, [node], encode(params, spec, "fp32"), ConfigRecord({"lr": 0.5}), timeout_s=0)
    reply = dispatcher.held.take(job({"lr": 0.5}))
    assert reply is not None and "arrays" in reply.content.array_records
    assert reply.content.config_records.get(REQUEST_RECORD) is None  # undeclared: a Flower-convention reply
