"""No silent stall: a node that stays connected but never replies (issue 26, item 3).

The node is silenced on the in-process grid (`InlineGrid.silent`: it stays in ``get_node_ids()``,
its messages wait unanswered). Each run goes through `run_server` in a watchdog thread, so a
regression that waits for the node forever fails here instead of hanging the suite. The
deadlines are shortened to fractions of a second by settings; the rule itself is the one every
run uses (`fl_geo.core.deadline`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.deadline import LateLog, ReplyDeadline
from fl_geo.runtime import interrupt
from fl_geo.runtime.dispatch import TIMED_OUT, Dispatcher
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from fl_geo.timing.clock import WallClock
from tests.test_dispatch import ScriptedGrid, _msg

# Deadline = max(0.5 s, 1 × the median reply time) once a comparable job has replied.
FAST_DEADLINE = ["strategy.reply_deadline_factor=1", "strategy.reply_deadline_floor_s=0.5",
                 "strategy.reply_deadline_first_s=30"]
VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16"]
DIPS = ["strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
        "penalty.clip=1.0", "penalty.warmup=2"]
WATCHDOG_S = 240.0  # far above a run's few seconds: only a stall reaches it


def _run(cfg, tmp_path, grid, name="run", hook=None):
    """`run_server` on ``grid`` in a watchdog thread; (summary, final model, wall seconds)."""
    grid.reply_hook = hook
    box: dict = {}

    def target() -> None:
        try:
            box["summary"] = run_server(grid, cfg, tmp_path / name)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    if thread.is_alive():  # stop the stalled run at its next poll, so it cannot run on beside later tests
        interrupt.request_stop()
        thread.join(60)
        interrupt.clear_stop()
        pytest.fail(f"the run stalled: still waiting after {WATCHDOG_S:.0f} s")
    if "error" in box:
        raise box["error"]
    final = torch.load(tmp_path / name / "final_model.pt")["params"]
    return box["summary"], final, time.monotonic() - t0


def _silence_after(grid, victim, replies: int, then=None, kind="train"):
    """A reply hook: after ``victim`` answered ``replies`` jobs of ``kind`` it goes silent (alive)."""
    seen = {"n": 0}

    def hook(node, msg, reply):
        if node == victim and msg.metadata.message_type == kind:
            seen["n"] += 1
            if seen["n"] == replies:
                (then or grid.silent.add)(victim)
        return reply

    return hook


# ---- the rule ---------------------------------------------------------------------------------
def test_deadline_is_k_times_the_median_with_a_floor_and_a_first_bound():
    d = ReplyDeadline(factor=10, floor_s=30, first_s=600)
    assert d.seconds(("train", 50)) == 600  # nothing observed yet: the first-jobs bound
    for s in (2.0, 9.0, 4.0):
        d.observe(("train", 50), s)
    assert d.median(("train", 50)) == 4.0
    assert d.seconds(("train", 50)) == 40.0  # 10 × median(2, 4, 9)
    d.observe(("train", 50), 1.0)
    assert d.seconds(("train", 50)) == 30.0  # 10 × 3.0 = 30: the floor ties; below it the floor holds
    d.observe(("train", 50), 0.1)
    assert d.median(("train", 50)) == 2.0 and d.seconds(("train", 50)) == 30.0  # 10 × 2 = 20 < the floor
    assert d.seconds(("train", 1)) == 600  # other steps: not comparable, still the first bound
    d.observe(("train", 50), math.nan)  # a clock step is ignored
    d.observe(("train", 50), -1.0)
    assert d.median(("train", 50)) == 2.0


def test_the_median_follows_a_window_of_recent_jobs():
    d = ReplyDeadline(factor=2, floor_s=0, first_s=0, window=3)
    assert d.seconds("k") == math.inf  # first_s = 0: no bound until a comparable job replied
    for s in (100.0, 100.0, 100.0, 1.0, 1.0):
        d.observe("k", s)
    assert d.seconds("k") == 2.0  # median of the last three (100, 1, 1)


def test_explicit_timeout_wins_and_factor_zero_turns_the_rule_off():
    d = ReplyDeadline(factor=10, floor_s=300, first_s=3600, explicit_s=7.5)
    d.observe("k", 1000.0)
    assert d.seconds("k") == d.seconds("other") == 7.5
    off = ReplyDeadline(factor=0, floor_s=300, first_s=3600)
    off.observe("k", 1.0)
    assert off.seconds("k") == off.seconds("other") == math.inf and not off.active
    with pytest.raises(ValueError, match="finite and >= 0"):
        ReplyDeadline(factor=-1)


def test_late_log_counts_given_up_jobs_and_late_replies_per_node():
    log = LateLog()
    log.gave_up(7, 30.0)
    log.gave_up(3, 12.0)
    log.gave_up(7, 31.5)
    log.replied_late(7)
    assert [(n.node, n.late_jobs, n.late_replies, n.waited_s) for n in log.nodes()] == \
        [(7, 2, 1, [30.0, 31.5]), (3, 1, 0, [12.0])]
    assert 3 in log and 5 not in log and len(log) == 2


@pytest.mark.parametrize(("override", "message"), [
    ("strategy.reply_deadline_factor=0.5", "strategy.reply_deadline_factor must be 0 (off) or >= 1"),
    ("strategy.reply_deadline_floor_s=-1", "strategy.reply_deadline_floor_s must be >= 0"),
    ("strategy.reply_deadline_first_s=10", "strategy.reply_deadline_first_s must be 0"),
    ("strategy.reply_deadline_factr=3", "reply_deadline_factr"),
])
def test_bad_deadline_settings_are_refused(tiny, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny(override)


def test_a_resumed_run_may_change_its_reply_deadlines(tiny):
    """They are waiting settings, like the node waits: not part of the run identity a checkpoint
    is matched against (a run whose slow site was taken for a hung one resumes with a higher floor)."""
    from fl_geo.config import run_identity

    base = run_identity(tiny())
    assert run_identity(tiny("strategy.reply_deadline_floor_s=900", "strategy.reply_deadline_factor=20",
                             "strategy.reply_deadline_first_s=7200")) == base
    assert run_identity(tiny("strategy.round_timeout_s=5")) != base


# ---- the dispatcher ---------------------------------------------------------------------------
def test_a_job_without_reply_is_given_up_at_its_deadline_and_its_late_reply_discarded(caplog):
    caplog.set_level(logging.WARNING, logger="fl_geo")
    grid = ScriptedGrid([1, 2])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.001)
    d.reply_deadline = ReplyDeadline(factor=1, floor_s=0.05, first_s=0.05)
    d.submit([_msg(1), _msg(2)])
    grid.release(1)
    assert d.next_event().ok  # node 1 replied in time: its duration is now the median
    t0 = time.monotonic()
    ev = d.next_event()  # node 2 never replies: given up once its deadline passed
    assert ev.error == TIMED_OUT and ev.job.node == 2 and ev.reply is None
    assert time.monotonic() - t0 < 5.0
    assert d.busy_nodes() == {2} and not d.in_flight()  # benched until it replies
    assert [(n.node, n.late_jobs) for n in d.late.nodes()] == [(2, 1)]
    assert "node 2 (slot 0) sent no reply to its train job within" in caplog.text
    grid.release(2)
    assert d.next_event(block=False) is None  # the late reply is discarded, never handed over
    assert d.late_replies == 1 and d.busy_nodes() == set() and d.late.nodes()[0].late_replies == 1


def test_without_a_rule_a_job_waits_and_an_explicit_timeout_bounds_its_round():
    grid = ScriptedGrid([1, 2])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.001)
    d.submit([_msg(1)])
    time.sleep(0.05)
    assert d.next_event(block=False) is None and d.in_flight()  # no rule: never given up
    grid.release(1)
    assert d.next_event().ok
    outcome = d.run_jobs([_msg(1), _msg(2)], on_replies=lambda g: None, order=[1, 2], timeout_s=0.05)
    assert outcome.timed_out == [1, 2] and outcome.replied == [] and len(d.late) == 2


# ---- whole runs ---------------------------------------------------------------------------------
def test_sync_round_with_a_silent_node_finishes_and_names_it(tiny, tmp_path, caplog):
    """DiLoCo, three nodes; one answers round 1 and then never again, while staying connected.
    Rounds 2 and 3 step on the other two at the derived deadline; the model is bit-identical to
    the run in which the node vanished after round 1 (the same updates were folded)."""
    caplog.set_level(logging.WARNING, logger="fl_geo")
    cfg = tiny("run.rounds=3", *FAST_DEADLINE)
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[1]
    summary, final, _ = _run(cfg, tmp_path, grid, hook=_silence_after(grid, victim, 1))
    assert summary["outer_steps"] == 3 and summary["failure"] is None and torch.isfinite(final).all()
    assert [r["outer/accepted"] for r in read_metrics(tmp_path / "run")[1:]] == [3, 2, 2]
    assert summary["failed_jobs"] == 1  # one job given up; round 3 sent it nothing
    (late,) = summary["late_nodes"]
    assert (late["node"], late["partition"], late["late_jobs"], late["late_replies"]) == (victim, 1, 1, 0)
    assert 0.5 <= late["deadline_s"] < 30  # derived from round 1, not the first-jobs bound
    assert [n for n, t in grid.executed if t == "train"].count(victim) == 1
    assert f"node {victim} (slot 1) sent no reply to its train job" in caplog.text
    assert f"late nodes (no reply within the deadline; given no new work until they replied): node {victim}" in caplog.text

    grid2 = InlineGrid(client_app, 3, seed=0)
    _, vanished, _ = _run(cfg, tmp_path, grid2, "vanished", hook=_silence_after(grid2, victim, 1, grid2.remove_node))
    assert torch.equal(final, vanished)


def test_a_late_node_gets_work_again_once_it_replies_and_its_late_update_is_not_applied(tiny, tmp_path):
    """The silent node's round-2 reply comes during round 3 (after its job was given up): it is
    discarded (``late_replies``), and the node trains again in round 4."""
    cfg = tiny("run.rounds=4", *FAST_DEADLINE)
    grid = InlineGrid(client_app, 3, seed=0)
    victim, other = sorted(grid.contexts)[1], sorted(grid.contexts)[0]
    trains = {"other": 0}
    silence = _silence_after(grid, victim, 1)

    def hook(node, msg, reply):
        if node == other and msg.metadata.message_type == "train":
            trains["other"] += 1
            if trains["other"] == 3:  # round 3 is under way: the victim's round-2 reply may come
                grid.silent.discard(victim)
        return silence(node, msg, reply)

    summary, final, _ = _run(cfg, tmp_path, grid, hook=hook)
    assert summary["outer_steps"] == 4 and torch.isfinite(final).all()
    assert [r["outer/accepted"] for r in read_metrics(tmp_path / "run")[1:]] == [3, 2, 2, 3]
    assert summary["late_replies"] == 1
    (late,) = summary["late_nodes"]
    assert (late["node"], late["late_jobs"], late["late_replies"]) == (victim, 1, 1)


def test_explicit_round_timeout_overrides_the_derived_deadline(tiny, tmp_path):
    """A derived bound of 1000 s would hold the run for minutes; round_timeout_s=0.5 wins."""
    cfg = tiny("run.rounds=2", "strategy.round_timeout_s=0.5", "strategy.reply_deadline_floor_s=1000",
               "strategy.reply_deadline_first_s=1000")
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[2]

    def hook(node, msg, reply):  # silent from its first train job on (it answered the profile query)
        if node == victim:
            grid.silent.add(victim)
        return reply

    summary, final, wall = _run(cfg, tmp_path, grid, hook=hook)
    assert summary["outer_steps"] == 2 and torch.isfinite(final).all()
    (late,) = summary["late_nodes"]
    assert (late["node"], late["late_jobs"], late["deadline_s"]) == (victim, 1, 0.5)
    assert wall < 900  # far below the 1000 s the derived bound would have waited


@pytest.mark.parametrize(
    ("strategy", "clock"),
    [(DIPS, VIRTUAL), (["strategy.name=fedbuff"], VIRTUAL),
     (["strategy.name=fedbuff"], ["run.num_clients=4", "wire.up=bf16"])],
    ids=["dips-virtual", "fedbuff-virtual", "fedbuff-wall"],
)
def test_async_run_with_a_silent_node_finishes_its_steps_and_drain(tiny, tmp_path, strategy, clock):
    """The node answers its first two train jobs, then never again. The run takes all its steps
    on the others, its final drain gives the node's job up at the deadline, and it writes its
    final model and a summary naming the node; nothing of the node after it fell silent is applied."""
    cfg = tiny(*clock, *strategy, "run.rounds=6", *FAST_DEADLINE)
    grid = InlineGrid(client_app, 4, seed=0)
    victim = sorted(grid.contexts)[0]
    summary, final, _ = _run(cfg, tmp_path, grid, hook=_silence_after(grid, victim, 2))
    assert summary["outer_steps"] == 6 and summary["failure"] is None and torch.isfinite(final).all()
    assert (tmp_path / "run" / "summary.json").is_file()
    (late,) = summary["late_nodes"]
    assert (late["node"], late["partition"], late["late_jobs"], late["late_replies"]) == (victim, 0, 1, 0)
    assert [n for n, t in grid.executed if t == "train"].count(victim) == 2
    if "run.clock=virtual" in clock:  # its job holds the clock order, so it is given up mid-run
        assert summary["failed_jobs"] == 1


def test_streaming_run_with_a_silent_node_finishes_and_names_it(tiny, tmp_path):
    """Streaming DiLoCo (two fragments): the node answers two tick messages, then never again;
    the run finishes every period on the others and names it."""
    cfg = tiny("run.sim_cpus=1", "model.n_layers=2", "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "run.rounds=3", *FAST_DEADLINE)
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[2]
    summary, final, _ = _run(cfg, tmp_path, grid, hook=_silence_after(grid, victim, 2, kind="train.stream"))
    assert summary["outer_steps"] > 0 and summary["failure"] is None and torch.isfinite(final).all()
    assert len(read_metrics(tmp_path / "run")) == 1 + 3  # the step-0 record and every period
    (late,) = summary["late_nodes"]
    assert (late["node"], late["partition"], late["late_jobs"]) == (victim, 2, 1)
    assert [n for n, t in grid.executed if t == "train.stream"].count(victim) == 2


def test_halos_run_with_a_silent_worker_finishes_and_names_it(tiny, tmp_path):
    """HALoS on a wall clock (its loop is the regional server's in deployment, which now gets
    the same derived deadline): a worker answers two jobs, then never again; the run finishes
    its global updates on the others and names the worker."""
    cfg = tiny("strategy.name=halos", "halos.accumulate=2", "halos.local_buffer=2", "strategy.delay_buffer=2",
               "strategy.inner_steps=2", "run.rounds=3", "run.num_clients=4", *FAST_DEADLINE)
    grid = InlineGrid(client_app, 4, seed=0)
    victim = sorted(grid.contexts)[1]
    summary, final, _ = _run(cfg, tmp_path, grid, hook=_silence_after(grid, victim, 2))
    assert summary["outer_steps"] == 3 and summary["failure"] is None and torch.isfinite(final).all()
    (late,) = summary["late_nodes"]
    assert (late["node"], late["partition"], late["late_jobs"]) == (victim, 1, 1)
    assert [n for n, t in grid.executed if t == "train"].count(victim) == 2


# ---- HALoS in deployment: the global server and a bridge that stops answering -------------------

def _fake_bridges(spec, silent_after: dict[int, int], grid_box: dict):
    """A bridge ClientApp for the in-process grid: answers the region query like
    fl_geo.halos.bridge (region index = partition id) and each exchange with a small update
    (what the co-located LPS would send), until a node in ``silent_after`` has answered that
    many exchanges: then it goes silent (alive, never answering)."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fl_geo.runtime.protocol import PROFILE_KEY, BridgeRequest
    from fl_geo.runtime.wire import encode

    app = ClientApp()
    answered: dict[int, int] = {}

    @app.query()
    def query(msg, context):
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({PROFILE_KEY: ConfigRecord({
            "partition_id": pid, "num_partitions": int(context.node_config["num-partitions"]),
            "device": "cpu", "site": f"r{pid}"})}), reply_to=msg)

    @app.train()
    def train(msg, context):
        node = msg.metadata.dst_node_id
        answered[node] = answered.get(node, 0) + 1
        pid = int(context.node_config["partition-id"])
        if pid in silent_after and answered[node] >= silent_after[pid]:
            grid_box["grid"].silent.add(node)  # this answer is its last
        content = RecordDict({"metrics": MetricRecord({"lps_version": answered[node], "sends": answered[node]})})
        if not BridgeRequest.in_message(msg).stop:  # a stop only delivers θ_g: no update comes back
            content["arrays"] = encode(torch.full((spec.numel,), 1e-3), spec, "fp32")
        return Message(content, reply_to=msg)

    return app


def test_the_halos_global_server_drops_a_silent_region_and_finishes(tiny, tmp_path, caplog):
    """The deployment GPS (fl_geo.halos.apps.run_global) with two bridges; the bridge of region
    r1 answers its first exchange, then stays connected and silent. The GPS gives its next
    exchange up at the derived deadline, finishes region r0's quota, writes its results and
    names the late node. (Before: it waited for the silent bridge for ever.)"""
    from fl_geo.core.state import ParamSpec
    from fl_geo.halos.apps import run_global
    from fl_geo.runtime.builders import make_model

    cfg = tiny("strategy.name=halos", "run.clock=wall", "run.rounds=4", "run.eval_every=0", *FAST_DEADLINE)
    spec = ParamSpec.from_state_dict(make_model(cfg.model, cfg.run.seed).state_dict())
    box: dict = {}
    grid = InlineGrid(_fake_bridges(spec, {1: 1}, box), 2, seed=0)
    box["grid"] = grid
    caplog.set_level("WARNING", logger="fl_geo")
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("s", run_global(grid, cfg, 2, run_dir=tmp_path / "g")),
                              daemon=True)
    thread.start()
    thread.join(WATCHDOG_S)
    if thread.is_alive():
        interrupt.request_stop()
        thread.join(60)
        interrupt.clear_stop()
        pytest.fail("the global server stalled on the silent bridge")
    s = out["s"]
    assert s["updates_per_region"] == {"r0": 2, "r1": 1}  # r0 did its quota of 2; r1 stopped after 1
    assert s["global_version"] == 3 and math.isfinite(s["final_val_loss"])
    (late,) = s["late_nodes"]
    assert late["site"] == "r1" and late["late_jobs"] == 1
    assert "did not answer within its deadline" in caplog.text
    assert (tmp_path / "g" / "summary.json").is_file() and (tmp_path / "g" / "final_model.pt").is_file()
