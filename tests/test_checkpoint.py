"""Server checkpoints: atomic verified files, resume after a crash, fallback past a corrupt one,
and the minimum-live-nodes pause."""

from __future__ import annotations

import logging

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.checkpoint import (
    CheckpointError,
    CheckpointStore,
    decode_checkpoint,
    encode_checkpoint,
)
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import ServerCrash, crash_hook


# ---- the store ---------------------------------------------------------------------------------
def _state(i: int) -> dict:
    return {"params": torch.full((5,), float(i)), "step": i, "history": ["{}"] * i}


def test_roundtrip_and_rotation(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for i in range(1, 5):
        store.save(i, _state(i))
    assert store.steps() == [3, 4]
    latest = store.load_latest()
    assert latest is not None and latest.step == 4
    assert torch.equal(latest.state["params"], torch.full((5,), 4.0))
    assert not list((tmp_path / "ck").glob("*.tmp"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, damage, caplog):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, _state(1))
    path = store.save(2, _state(2))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "magic":
        data[:8] = b"NOTOURS!"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        store.load(2)
    with caplog.at_level(logging.WARNING, logger="fl_geo"):
        latest = store.load_latest()
    assert latest is not None and latest.step == 1
    assert "does not verify" in caplog.text


def test_partial_write_is_never_read(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, _state(1))
    (tmp_path / "ckpt-00000002.pt.tmp").write_bytes(encode_checkpoint(_state(2))[:100])
    assert store.load_latest().step == 1
    assert store.load_latest() is not None


def test_payload_must_be_plain_data(tmp_path):
    from fractions import Fraction  # picklable, but not plain data: weights_only refuses it

    with pytest.raises(CheckpointError, match="does not load"):
        decode_checkpoint(encode_checkpoint({"x": Fraction(1, 3)}))
    assert CheckpointStore(tmp_path / "none").load_latest() is None
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep=0)


# ---- resume ------------------------------------------------------------------------------------
def _crash_on(round_no: int, nth: int):
    """Kill the server at the ``nth`` train reply of round ``round_no``."""
    return crash_hook(nth, round_no=round_no)


def _final(run_dir):
    return torch.load(run_dir / "final_model.pt")["params"]


def crash_and_resume(tiny, common: list[str], run_dir, crash_round: int = 4, every: int = 1) -> dict:
    """Run ``common`` (with ``run.checkpoint_every=every``) until the server dies at the second
    train reply of ``crash_round``, check it left the checkpoints of the rounds before (the newest
    3), then resume on the same nodes (the SuperNodes outlive the server); the resumed run's summary."""
    grid = InlineGrid(client_app, 3, seed=0)
    grid.reply_hook = _crash_on(crash_round, 2)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), run_dir)
    assert CheckpointStore(run_dir / "checkpoints").steps() == list(range(every, crash_round, every))[-3:]
    grid.reply_hook = None
    return run_server(grid, tiny(*common, "run.resume=true"), run_dir)


def crash_and_restart_with_state_dirs(tiny, common: list[str], tmp_path, run_dir, crash_round: int = 3) -> InlineGrid:
    """Deployment: the server dies in round ``crash_round`` and comes back as a new Flower run, so
    every node's context.state starts empty; nodes with node config ``state-dir`` reload their
    inner state from disk. The nodes of the resumed run (their contexts, for checks)."""
    def nodes(d):
        return [{"partition-id": i, "num-partitions": 3, "state-dir": str(d)} for i in range(3)]

    grid = InlineGrid(client_app, 3, node_configs=nodes(tmp_path / "state"), seed=0)
    grid.reply_hook = _crash_on(crash_round, 2)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), run_dir)
    assert sorted(p.name for p in (tmp_path / "state" / "run").iterdir()) == [
        "partition-0.pt", "partition-1.pt", "partition-2.pt"]
    fresh = InlineGrid(client_app, 3, node_configs=nodes(tmp_path / "state"), seed=1)  # new run: empty contexts
    run_server(fresh, tiny(*common, "run.resume=true"), run_dir)
    return fresh


@pytest.mark.parametrize("strategy", ["diloco", "edit"])
def test_sync_resume_is_bit_identical_to_an_uninterrupted_run(tiny, tmp_path, strategy):
    common = [f"strategy.name={strategy}", "run.rounds=5", "run.clock=virtual", "run.checkpoint_every=1"]
    cfg = tiny(*common)
    full = run_server(InlineGrid(client_app, 3, seed=0), cfg, tmp_path / "full")
    resumed = crash_and_resume(tiny, common, tmp_path / "resumed")

    assert torch.equal(_final(tmp_path / "full"), _final(tmp_path / "resumed"))
    assert resumed["outer_steps"] == full["outer_steps"] == 5
    assert resumed["tokens"] == full["tokens"]
    rows_full, rows_res = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows_res] == [r["step"] for r in rows_full] == [0, 1, 2, 3, 4, 5]
    assert [r["val/loss"] for r in rows_res] == [r["val/loss"] for r in rows_full]
    assert [r["time/virtual_s"] for r in rows_res] == [r["time/virtual_s"] for r in rows_full]


@pytest.mark.parametrize("every", [2, 3])
def test_sync_resume_past_several_rounds_after_the_checkpoint_is_bit_identical(tiny, tmp_path, caplog, every):
    """With ``run.checkpoint_every`` = k the server may die up to k rounds after its newest
    checkpoint, every node having trained each round since. The resumed server sends those rounds
    again; each node goes back to the inner state it kept at that checkpoint (before, a node kept
    only the round before its last, could not rewind further and went on from a later AdamW state
    and schedule position: the study runs said "no longer bit-identical"), so the run ends on the
    bits of an uninterrupted one."""
    common = ["strategy.name=diloco", "run.rounds=5", "run.clock=virtual", f"run.checkpoint_every={every}"]
    run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    with caplog.at_level(logging.INFO, logger="fl_geo"):
        resumed = crash_and_resume(tiny, common, tmp_path / "resumed", crash_round=every + 2, every=every)
    assert resumed["outer_steps"] == 5
    assert torch.equal(_final(tmp_path / "full"), _final(tmp_path / "resumed"))
    assert [r["val/loss"] for r in read_metrics(tmp_path / "resumed")] == \
        [r["val/loss"] for r in read_metrics(tmp_path / "full")]
    # all three nodes had trained round k + 1 (and two of them k + 2): each rewound once, to step k
    assert caplog.text.count(f"server resumed from its checkpoint after step {every}): rewound") == 3
    assert "no longer bit-identical" not in caplog.text


def test_a_new_flower_run_reloads_the_state_kept_at_the_checkpoint_from_disk(tiny, tmp_path):
    """The same with the nodes' state files (a restarted ServerApp is a new Flower run): the state
    kept at the checkpoint travels in the file and the run stays bit-identical."""
    common = ["run.rounds=5", "run.clock=virtual", "run.checkpoint_every=2"]
    run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    crash_and_restart_with_state_dirs(tiny, common, tmp_path, tmp_path / "r", crash_round=4)
    assert torch.equal(_final(tmp_path / "full"), _final(tmp_path / "r"))


def test_a_resumed_run_reports_the_whole_runs_goodput_and_wall_time(tiny, tmp_path):
    """Goodput's buckets travel with the checkpoint, so a resumed run's ratio covers the whole run
    (before, it counted only the work after the resume against the whole run's provisioned time:
    0.11 where the uninterrupted run had 0.68); its wall clock goes on from the checkpoint's."""
    import json

    from tests.conftest import tiny_scenario_dict

    scenario = tmp_path / "tiny.json"
    scenario.write_text(json.dumps(tiny_scenario_dict()))
    common = ["strategy.name=diloco", "run.rounds=5", "run.clock=virtual", f"run.scenario={scenario}",
              "run.checkpoint_every=1"]
    full = run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    resumed = crash_and_resume(tiny, common, tmp_path / "resumed")
    assert torch.equal(_final(tmp_path / "full"), _final(tmp_path / "resumed"))
    assert full["goodput"] is not None and 0 < full["goodput"] < 1
    assert resumed["goodput"] == pytest.approx(full["goodput"], rel=1e-9)
    for bucket, seconds in full["goodput_s"].items():
        assert resumed["goodput_s"][bucket] == pytest.approx(seconds, rel=1e-9, abs=1e-9), bucket
    rows = read_metrics(tmp_path / "resumed")
    walls = [r["time/wall_s"] for r in rows]
    assert walls == sorted(walls), walls  # no drop back to 0 at the resume
    checkpointed = [json.loads(h) for h in CheckpointStore(tmp_path / "resumed" / "checkpoints").load(3).state["history"]]
    assert resumed["wall_s"] >= checkpointed[-1]["time/wall_s"] > 0


def test_goodput_state_round_trips_and_a_malformed_one_changes_nothing():
    from fl_geo.runtime.goodput import GoodputMeter, JobCost

    meter = GoodputMeter(lambda t: 4 * t)
    meter.resolved(1, JobCost(3.0, 2.0), ok=True)
    meter.settle()
    meter.resolved(2, JobCost(5.0, 4.0), ok=True)  # held for a verdict when the checkpoint is taken
    meter.resolved(3, JobCost(1.5, 1.0), ok=False)
    state = meter.state_dict(in_flight_s=2.5)
    assert state["seconds"] == {"useful": 2.0, "comm": 1.0, "lost": 1.5 + 2.5, "rejected": 0.0, "stale": 0.0}
    restored = GoodputMeter(lambda t: 4 * t)
    restored.prepare_load(state)()
    restored.settle()
    assert restored.seconds == {"useful": 6.0, "comm": 2.0, "lost": 4.0, "rejected": 0.0, "stale": 0.0}
    assert restored.metrics(10.0, 0.0)["goodput/ratio"] == pytest.approx(6.0 / 40.0)
    bad = [
        None, {"seconds": state["seconds"]},
        {**state, "seconds": {**state["seconds"], "useful": -1.0}},
        {**state, "seconds": {**state["seconds"], "useful": float("nan")}},
        {**state, "seconds": {**state["seconds"], "useful": True}},
        {**state, "seconds": {k: v for k, v in state["seconds"].items() if k != "stale"}},
        {**state, "held": {"x": [[1.0, 0.5]]}},
        {**state, "held": {"2": [[1.0, 2.0]]}},
        {**state, "held": {"2": [[1.0]]}},
        {**state, "held": [[1.0, 0.5]]},
    ]
    for b in bad:
        with pytest.raises(ValueError):
            restored.prepare_load(b)
    assert restored.seconds["useful"] == 6.0 and not restored.held


def test_resume_past_a_corrupt_checkpoint_continues_from_the_previous(tiny, tmp_path, caplog):
    cfg = tiny("run.rounds=4", "run.checkpoint_every=1", "run.checkpoint_keep=2")
    grid = InlineGrid(client_app, 3, seed=0)
    grid.reply_hook = _crash_on(4, 1)
    with pytest.raises(ServerCrash):
        run_server(grid, cfg, tmp_path / "r")
    store = CheckpointStore(tmp_path / "r" / "checkpoints")
    assert store.steps() == [2, 3]
    newest = store.path_for(3)
    newest.write_bytes(newest.read_bytes()[:-7])  # a torn write
    ckpt2 = store.load(2).state["params"].clone()
    grid.reply_hook = None
    with caplog.at_level(logging.INFO, logger="fl_geo"):
        summary = run_server(grid, tiny("run.rounds=4", "run.checkpoint_every=1", "run.checkpoint_keep=2", "run.resume=true"), tmp_path / "r")
    assert "skipping checkpoint that does not verify" in caplog.text
    assert "resumed from" in caplog.text and "ckpt-00000002" in caplog.text
    assert summary["outer_steps"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [0, 1, 2, 3, 4]
    # the clients kept their state at checkpoint 3, not 2: they go on from their later state and say so
    assert "but this node kept its state at the checkpoint after step 3" in caplog.text
    assert "no longer bit-identical" in caplog.text
    assert not torch.equal(ckpt2, _final(tmp_path / "r"))


def test_async_resume_keeps_every_accepted_step(tiny, tmp_path):
    common = ["strategy.name=fedbuff", "strategy.buffer_size=2", "run.rounds=5", "run.clock=virtual",
              "run.checkpoint_every=1", "strategy.robust=median_norm"]
    grid = InlineGrid(client_app, 3, seed=0)
    calls = {"n": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train":
            calls["n"] += 1
            if calls["n"] == 7:
                raise ServerCrash("server killed")
        return reply

    grid.reply_hook = hook
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), tmp_path / "a")
    store = CheckpointStore(tmp_path / "a" / "checkpoints")
    saved = store.load_latest()
    assert saved is not None and saved.state["counters"]["version"] >= 2
    # the norm window median_norm judges against travels with the checkpoint (one norm per update)
    assert len(saved.state["loop"]["norm_window"]) == saved.state["counters"]["total_accepted"] > 0
    grid.reply_hook = None
    summary = run_server(grid, tiny(*common, "run.resume=true"), tmp_path / "a")
    assert summary["outer_steps"] == 5
    assert summary["tokens"] > saved.state["counters"]["total_tokens"]
    steps = [r["step"] for r in read_metrics(tmp_path / "a")]
    assert steps == sorted(steps) and steps[-1] == 5 and len(steps) == len(set(steps))


def _files(root) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what "nothing on disk changed" is checked against."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_refuses_another_strategy_or_model(tiny, tmp_path):
    run_server(InlineGrid(client_app, 3, seed=0), tiny("run.checkpoint_every=1"), tmp_path / "r")
    before = _files(tmp_path / "r")
    with pytest.raises(ConfigError, match="another run configuration .*strategy.name: 'diloco' in the checkpoint, "
                                          "'fedavg' now"):
        run_server(InlineGrid(client_app, 3, seed=0), tiny("strategy.name=fedavg", "run.resume=true"), tmp_path / "r")
    with pytest.raises(ConfigError, match="model.d_model: 32 in the checkpoint, 16 now"):
        run_server(InlineGrid(client_app, 3, seed=0), tiny("model.d_model=16", "run.resume=true"), tmp_path / "r")
    # a hyperparameter the strategy check never saw is named too; nothing on disk changed
    with pytest.raises(ConfigError, match="client.lr: 0.003 in the checkpoint, 0.002 now"):
        run_server(InlineGrid(client_app, 3, seed=0), tiny("client.lr=0.002", "run.resume=true"), tmp_path / "r")
    assert _files(tmp_path / "r") == before


def test_resume_without_a_checkpoint_starts_fresh(tiny, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fl_geo"):
        summary = run_server(InlineGrid(client_app, 3, seed=0), tiny("run.resume=true"), tmp_path / "fresh")
    assert summary["outer_steps"] == 2
    assert "holds no checkpoint: starting a new run" in caplog.text
    # an empty checkpoint directory is the same: nothing to lose, a new run
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    summary = run_server(InlineGrid(client_app, 3, seed=0), tiny("run.resume=true"), tmp_path / "empty")
    assert summary["outer_steps"] == 2


def test_resume_without_a_checkpoint_keeps_earlier_results(tiny, tmp_path):
    """A finished run without checkpoints, then run.resume=true into its directory: a fresh start
    would delete its metrics, summary and model. Refused; every file stays byte-identical."""
    run_server(InlineGrid(client_app, 3, seed=0), tiny(), tmp_path / "r")
    before = _files(tmp_path / "r")
    assert "final_model.pt" in before and "metrics.jsonl" in before
    with pytest.raises(ConfigError, match=r"holds no checkpoint, and .* holds results of an earlier run "
                                          r"\(metrics.jsonl, summary.json, meta.json, final_model.pt"):
        run_server(InlineGrid(client_app, 3, seed=0), tiny("run.resume=true"), tmp_path / "r")
    assert _files(tmp_path / "r") == before


def test_resume_with_only_damaged_checkpoints_is_an_error_not_a_fresh_start(tiny, tmp_path, caplog):
    cfg = tiny("run.checkpoint_every=1")
    run_server(InlineGrid(client_app, 3, seed=0), cfg, tmp_path / "r")
    store = CheckpointStore(tmp_path / "r" / "checkpoints")
    assert store.steps() == [1, 2]
    for step in store.steps():
        path = store.path_for(step)
        path.write_bytes(path.read_bytes()[:-3])  # every checkpoint torn
    before = _files(tmp_path / "r")
    with caplog.at_level(logging.WARNING, logger="fl_geo"), \
            pytest.raises(ConfigError, match="none of the 2 checkpoint file.* verifies"):
        run_server(InlineGrid(client_app, 3, seed=0), tiny("run.checkpoint_every=1", "run.resume=true"), tmp_path / "r")
    assert caplog.text.count("skipping checkpoint that does not verify") == 2
    assert _files(tmp_path / "r") == before


def test_new_run_refuses_a_directory_with_earlier_checkpoints(tiny, tmp_path):
    """A new run (no run.resume) into a directory holding checkpoints (of this config or another)
    refuses before anything changes: its own checkpoints would otherwise sit beside the old run's,
    and a later resume or the pruning could take theirs for ours."""
    run_server(InlineGrid(client_app, 3, seed=0), tiny("run.checkpoint_every=1", "run.rounds=3"), tmp_path / "r")
    before = _files(tmp_path / "r")
    for extra in ([], ["strategy.outer_lr=0.5"]):
        with pytest.raises(ConfigError, match="already holds 3 checkpoint file.*newest ckpt-00000003.pt"):
            run_server(InlineGrid(client_app, 3, seed=0), tiny("run.checkpoint_every=1", *extra), tmp_path / "r")
    assert _files(tmp_path / "r") == before


def test_a_checkpoint_names_its_run_and_pruning_spares_other_runs(tmp_path):
    """Two stores (two run identities) in one directory: each prunes only its own files, never
    replaces the other's, and a damaged identity is a checksum failure, not another owner."""
    ours = CheckpointStore(tmp_path, keep=2, identity={"strategy.name": "diloco"})
    theirs = CheckpointStore(tmp_path, keep=2, identity={"strategy.name": "edit"})
    theirs.save(0, _state(0))
    theirs.save(9, _state(9))  # newer than anything ours will write
    foreign = {s: theirs.path_for(s).read_bytes() for s in (0, 9)}
    for i in range(1, 6):
        ours.save(i, _state(i))
    assert ours.own_steps() == [4, 5] and ours.foreign_steps() == [0, 9]
    assert ours.steps() == [0, 4, 5, 9]
    assert {s: theirs.path_for(s).read_bytes() for s in (0, 9)} == foreign
    latest = ours.load_latest()  # the newest file is theirs, and says so
    assert latest is not None and latest.step == 9 and latest.identity == {"strategy.name": "edit"}
    with pytest.raises(CheckpointError, match="not written by this run"):
        ours.save(9, _state(1))
    assert theirs.path_for(9).read_bytes() == foreign[9]
    # their stale .tmp is theirs too; ours is removed at our next save
    (tmp_path / "ckpt-00000010.pt.tmp").write_bytes(encode_checkpoint(_state(10), {"strategy.name": "edit"})[:200])
    (tmp_path / "ckpt-00000006.pt.tmp").write_bytes(encode_checkpoint(_state(6), {"strategy.name": "diloco"})[:200])
    ours.save(7, _state(7))
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == ["ckpt-00000010.pt.tmp"]
    # a flipped bit in the identity fails the checksum (the previous checkpoint is used), it does
    # not turn the file into another run's
    path = ours.path_for(7)
    data = bytearray(path.read_bytes())
    data[84 + 3] ^= 0x01  # inside the identity JSON, which follows the 84-byte fixed header
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        ours.load(7)


def test_a_header_whose_run_id_was_rewritten_is_refused(tmp_path):
    """The header's run id decides what a store may prune or overwrite (read alone, unverified,
    by `owner_of`); a file whose id was changed to another run's does not load as verified."""
    from fl_geo.core.checkpoint import identity_bytes, run_id_of

    data = bytearray(encode_checkpoint(_state(3), {"strategy.name": "diloco"}))
    other = run_id_of(identity_bytes({"strategy.name": "edit"}))
    assert bytes(data[8:40]) != other
    data[8:40] = other  # magic (8 bytes), then the 32-byte run id
    with pytest.raises(CheckpointError, match="header's run id"):
        decode_checkpoint(bytes(data))


def test_every_method_checkpoints(tiny):
    """(The two-tier HALoS deployment's global tier too: tests/test_halos_global_resume.py.)"""
    from fl_geo.registry import METHODS

    needs = {"a_edit": ["strategy.time_budget_s=1.0"],  # what a method needs besides the tiny config
             "cocodc": ["model.n_layers=2", "strategy.inner_steps=4", "streaming.overlap=1"],
             "ddp": ["strategy.inner_steps=1"],
             "streaming_diloco": ["model.n_layers=2", "strategy.inner_steps=4", "streaming.overlap=1"]}
    for name in METHODS:  # a ConfigError here names a method whose loop a checkpoint does not hold
        cfg = tiny(f"strategy.name={name}", "run.clock=virtual", *needs.get(name, []), "run.checkpoint_every=1")
        assert cfg.run.checkpoint_every == 1 and cfg.strategy.name == name


# ---- minimum live nodes --------------------------------------------------------------------------
def test_too_few_live_nodes_pause_then_resume(tiny, tmp_path, monkeypatch, caplog):
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[2]
    state = {"removed": False, "slept": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train" and node == victim and not state["removed"]:
            state["removed"] = True
            grid.remove_node(victim)
        return reply

    def fake_sleep(_s):  # the wait loop sleeps; a replacement node joins meanwhile
        state["slept"] += 1
        if state["slept"] == 2:
            grid.add_node({"partition-id": 2, "num-partitions": 3})

    import fl_geo.strategies.base as base

    monkeypatch.setattr(base.time, "sleep", fake_sleep)
    grid.reply_hook = hook
    with caplog.at_level(logging.INFO, logger="fl_geo"):
        summary = run_server(grid, tiny("run.rounds=3", "run.min_live_nodes=3", "run.min_live_wait_s=60"), tmp_path / "q")
    assert "outer steps paused" in caplog.text and "outer steps resume" in caplog.text
    assert summary["outer_steps"] == 3
    # the victim's round-1 reply had arrived; round 2 waited for the replacement instead of running on 2
    assert [r["outer/accepted"] for r in read_metrics(tmp_path / "q")[1:]] == [3, 3, 3]


def test_too_few_live_nodes_for_too_long_is_a_clear_error(tiny, tmp_path, monkeypatch):
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[0]

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train" and victim in grid.contexts:
            grid.remove_node(victim)
        return reply

    import fl_geo.strategies.base as base

    monkeypatch.setattr(base.time, "sleep", lambda s: None)
    grid.reply_hook = hook
    cfg = tiny("run.rounds=3", "run.min_live_nodes=3", "run.min_live_wait_s=0", "run.checkpoint_every=1")
    with pytest.raises(TimeoutError, match="run.min_live_nodes=3"):
        run_server(grid, cfg, tmp_path / "t")
    # the step before the pause is safe on disk: the run can resume from it when nodes are back
    assert CheckpointStore(tmp_path / "t" / "checkpoints").steps() == [1]


def test_restart_as_a_new_flower_run_reloads_the_inner_state_from_disk(tiny, tmp_path):
    """Deployment: a restarted ServerApp is a new Flower run, so context.state starts empty; nodes
    with node config ``state-dir`` reload their inner state and the run stays bit-identical."""
    common = ["run.rounds=4", "run.clock=virtual", "run.checkpoint_every=1"]
    run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    crash_and_restart_with_state_dirs(tiny, common, tmp_path, tmp_path / "r")
    assert torch.equal(_final(tmp_path / "full"), _final(tmp_path / "r"))

    # without the state files the resumed run still finishes, from fresh inner optimizers
    other = InlineGrid(client_app, 3, seed=2)
    summary = run_server(other, tiny("run.rounds=5", "run.clock=virtual", "run.checkpoint_every=1", "run.resume=true"), tmp_path / "r")
    assert summary["outer_steps"] == 5


def test_damaged_inner_state_file_means_a_fresh_optimizer_not_a_crash(tiny, tmp_path, caplog):
    common = ["run.rounds=3", "run.checkpoint_every=1"]
    nodes = [{"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / "s")} for i in range(3)]
    grid = InlineGrid(client_app, 3, node_configs=nodes, seed=0)
    grid.reply_hook = _crash_on(3, 1)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), tmp_path / "r")
    damaged = tmp_path / "s" / "run" / "partition-0.pt"
    damaged.write_bytes(damaged.read_bytes()[:50])
    with caplog.at_level(logging.INFO, logger="fl_geo"):
        summary = run_server(InlineGrid(client_app, 3, node_configs=nodes, seed=1), tiny(*common, "run.resume=true"), tmp_path / "r")
    assert summary["outer_steps"] == 3
    assert "is unusable" in caplog.text and "restored the inner state" in caplog.text


@pytest.mark.slow(seconds=79)
def test_kill_minus_9_then_the_same_command_resumes_bit_identically(tmp_path):
    """A real process kill: `fl-geo run` is SIGKILLed mid-run, the same command with
    run.resume=true finishes it, and the model equals an uninterrupted run's bit for bit
    (the simulated clients' inner state survives on disk in <run dir>/client_state). The
    uninterrupted run is this test process's own (one torch thread, as the command's; a third
    process of ~8 CPU-s would prove nothing more: `fl-geo run` calls `run_simulation`)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fl_geo.config import load_config
    from fl_geo.simulation import run_simulation
    from tests.conftest import TINY

    args = [*TINY, "run.rounds=6", "run.clock=virtual", "run.checkpoint_every=1", "run.name=k"]
    cmd = [sys.executable, "-m", "fl_geo.cli", "run", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_simulation(load_config(None, args), tmp_path / "full" / "k")

    proc = subprocess.Popen([*cmd, "--out", str(tmp_path / "cut")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpts = tmp_path / "cut" / "k" / "checkpoints"
    deadline = time.monotonic() + 240
    try:
        while not (ckpts / "ckpt-00000003.pt").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint 3 within 240 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (tmp_path / "cut" / "k" / "final_model.pt").exists()
    resumed = subprocess.run([*cmd, "run.resume=true", "--out", str(tmp_path / "cut")], check=True, env=env,
                             capture_output=True, text=True, timeout=300)
    assert "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    full = torch.load(tmp_path / "full" / "k" / "final_model.pt")["params"]
    cut = torch.load(tmp_path / "cut" / "k" / "final_model.pt")["params"]
    assert torch.equal(full, cut)
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "k")]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
