"""Streaming DiLoCo and CoCoDC survive a server restart: checkpoints at period ends hold the
streaming loop's state (fragment outer optimizers, syncs in flight, schedule, WAN queue), workers
keep their state from each checkpoint's step, and a resumed server rewinds them there, so the run
ends bit-identical to one that never stopped (strategies/streaming.py, clients/stream.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from fl_geo.clients.datacenter import app as client_app
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import ServerCrash, crash_hook, tiny_config


def _crash_on(round_no: int, nth: int):
    """Kill the server at the ``nth`` train.stream reply of period ``round_no``: the worker has
    trained that tick (its state moved on), the server never sees the reply."""
    return crash_hook(nth, "train.stream", round_no)


def _scenario(tmp_path) -> str:
    """Three nodes in one region on a 1 Gbit/s link, 10 ms an inner step: a fragment's ring
    all-reduce (half of a modelled 2 M parameters in fp32: 2·(2/3)·4 MB·8 / 1e9 = 43 ms) is not
    hidden behind τ = 2 steps, so the restored WAN queue and syncs in flight move the virtual
    clock; CoCoDC's adaptive schedule syncs every H/N = 4 steps (N = max(P, ⌊0.4·8·10/43⌋) = 2)."""
    d = {"name": "one_region", "server_region": "A", "regions": ["A"], "links": {"bandwidth_gbps": [[1.0]]},
         "model": {"num_params": 2_000_000, "step_time_s": 0.01}, "nodes": [{"region": "A"}] * 3}
    path = tmp_path / "one_region.yaml"
    OmegaConf.save(OmegaConf.create(d), path)
    return str(path)


CASES = {
    # the fixed round-robin schedule with the blend merge
    "streaming_diloco": ["strategy.name=streaming_diloco", "streaming.adaptive=false"],
    # the adaptive schedule (server-side state) and the compensating merge (worker snapshots)
    "cocodc": ["strategy.name=cocodc", "streaming.adaptive=true"],
    # compressed fragments: each worker's per-fragment error-feedback residuals rewind too
    "streaming_int4_ef": ["strategy.name=streaming_diloco", "streaming.adaptive=false", "wire.compress=int4",
                          "wire.error_feedback=true"],
}


def _common(tmp_path, name: str) -> list[str]:
    return ["run.sim_cpus=1", "model.n_layers=2", *CASES[name], "strategy.inner_steps=8", "streaming.fragments=2",
            "streaming.overlap=2", "streaming.eval_workers=true", "run.rounds=5", "run.checkpoint_every=2",
            "run.clock=virtual", f"run.scenario={_scenario(tmp_path)}"]


def _final(run_dir):
    return torch.load(run_dir / "final_model.pt")["params"]


def _same_run(full_dir, resumed_dir) -> None:
    assert torch.equal(_final(full_dir), _final(resumed_dir))
    full, resumed = read_metrics(full_dir), read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == [0, 1, 2, 3, 4, 5]
    for key in ("val/loss", "val/worker_loss", "time/virtual_s", "outer/step", "train/tokens", "comm/bytes_down",
                "stream/syncs", "stream/overlap_steps"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in full], key


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_on_the_same_nodes_rewinds_them_and_is_bit_identical(tiny, tmp_path, name):
    common = _common(tmp_path, name)
    full = run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")

    grid = InlineGrid(client_app, 3, seed=0)
    grid.reply_hook = _crash_on(4, 5)  # 1.5 periods after the checkpoint of period 2
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), tmp_path / "resumed")
    assert CheckpointStore(tmp_path / "resumed" / "checkpoints").steps() == [2]
    grid.reply_hook = None  # the same nodes, their state past the checkpoint: they must rewind
    resumed = run_server(grid, tiny(*common, "run.resume=true"), tmp_path / "resumed")

    assert resumed["outer_steps"] == full["outer_steps"] and resumed["tokens"] == full["tokens"]
    _same_run(tmp_path / "full", tmp_path / "resumed")


def test_a_restarted_server_is_a_new_flower_run_and_workers_reload_their_state_from_disk(tiny, tmp_path):
    """Deployment: new node ids and empty contexts; nodes with node config ``state-dir`` reload
    their streaming state (and the state kept at the checkpoint) from disk, then rewind."""
    common = _common(tmp_path, "cocodc")
    run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")

    def nodes():
        return [{"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / "state")} for i in range(3)]

    grid = InlineGrid(client_app, 3, node_configs=nodes(), seed=0)
    grid.reply_hook = _crash_on(3, 4)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), tmp_path / "resumed")
    fresh = InlineGrid(client_app, 3, node_configs=nodes(), seed=1)  # a new Flower run
    assert set(fresh.contexts) != set(grid.contexts)
    run_server(fresh, tiny(*common, "run.resume=true"), tmp_path / "resumed")
    _same_run(tmp_path / "full", tmp_path / "resumed")


def test_a_worker_whose_state_is_lost_is_initialised_again_and_the_run_finishes(tiny, tmp_path, caplog):
    """A resumed server sends no model to the partitions that held state; a node that lost it
    (no state-dir, a new Flower run) answers with an error, is sent the model whole next tick, and
    the run ends with every period trained. The first resumed tick ends with fragment 0's sync
    start and no worker's update: that one outer step is skipped (logged), the model unchanged."""
    common = _common(tmp_path, "streaming_diloco")
    grid = InlineGrid(client_app, 3, seed=0)
    grid.reply_hook = _crash_on(3, 2)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), tmp_path / "run")
    checkpoint = CheckpointStore(tmp_path / "run" / "checkpoints").load_latest()
    assert checkpoint is not None and checkpoint.step == 2
    summary = run_server(InlineGrid(client_app, 3, seed=1), tiny(*common, "run.resume=true"), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5] and summary["outer_steps"] == 2 * 5 - 1
    final = _final(tmp_path / "run")
    # the re-initialised workers train on: the model moved past the checkpoint's, to a lower loss
    assert torch.isfinite(final).all() and not torch.equal(final, checkpoint.state["params"])
    assert rows[-1]["val/loss"] < rows[2]["val/loss"]
    assert [r["outer/failed"] for r in rows[3:]] == [3, 0, 0]  # each worker's first resumed tick, once
    assert [r["stream/skipped_syncs"] for r in rows[1:]] == [0, 0, 1, 0, 0]
    assert "holds no streaming state" in caplog.text and "its outer step is skipped" in caplog.text


@pytest.fixture(scope="module")
def cocodc_checkpoint(tmp_path_factory):
    """A two-period CoCoDC run with a checkpoint after each period (one run for every case below,
    each of which tampers with its own copy): its overrides and its folder."""
    base = tmp_path_factory.mktemp("cocodc")
    common = [*_common(base, "cocodc"), "run.rounds=2", "run.checkpoint_every=1"]
    run_server(InlineGrid(client_app, 3, seed=0), tiny_config(*common), base / "run")
    return common, base / "run"


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("in_flight", [[7, 16, 18, 0.0, 1.0]], "malformed sync in flight"),  # no fragment 7 (P = 2)
    ("in_flight", [[0, 20, 18, 0.0, 1.0]], "malformed sync in flight"),  # started after the checkpoint
    ("in_flight", [[0, 14, 16, float("nan"), 1.0]], "malformed sync in flight"),
    ("step", -8, "has step"),
    ("schedule", None, "fragment schedule is not this run's"),
    ("outer", {"name": "nesterov", "num_fragments": 3, "fragments": []}, "fragment states"),
    ("step_times", {"history": [[0, [-1.0]]]}, "reported times are malformed"),
    ("in_flight", [[None, 14, 16, 0.0, 1.0]], "wrong type or shape"),
    ("in_flight", [[0, 14]], "malformed sync in flight"),
    ("interval", "often", "invalid literal"),
    ("interval", 0, "has interval 0"),
])
def test_a_tampered_streaming_checkpoint_is_refused_in_one_line(tiny, tmp_path, cocodc_checkpoint, field, value,
                                                                needle):
    """A checkpoint whose streaming part does not fit the run is a one-line ConfigError before
    anything runs."""
    from fl_geo.config import ConfigError

    common, written_run = cocodc_checkpoint
    shutil.copytree(written_run, tmp_path / "run")
    written = CheckpointStore(tmp_path / "run" / "checkpoints").load_latest()
    assert written is not None and written.step == 2
    state = written.state
    assert state["loop"]["in_flight"] and state["loop"]["schedule"] is not None  # a sync in flight at the end
    state["loop"][field] = value
    CheckpointStore(tmp_path / "run" / "checkpoints", identity=written.identity).save(2, state)
    with pytest.raises(ConfigError, match=needle):
        run_server(InlineGrid(client_app, 3, seed=0), tiny(*common, "run.rounds=3", "run.resume=true"),
                   tmp_path / "run")
