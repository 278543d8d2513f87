"""HALoS in one ServerApp checkpoints and resumes: both tiers (θ_g, every local server with its
merge point and residual, their public models), which partition trains for which local server,
and the transfers between the tiers still on the wire come back exactly; worker jobs in flight are
sent again, as in an asynchronous resume (strategies/halos.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from fl_geo.strategies.halos import HalosLoop
from tests.conftest import ServerCrash, crash_hook, tiny_config, tiny_scenario_dict

HALOS = ("strategy.name=halos", "halos.accumulate=2", "halos.local_buffer=2", "strategy.delay_buffer=2",
         "strategy.inner_steps=2", "run.rounds=8", "run.clock=virtual", "run.checkpoint_every=2")


def _common(tmp_path, *extra: str) -> list[str]:
    """Two regions (local server 0: node 0; local server 1: nodes 1 and 2); the modelled model is
    large enough (1 G parameters: 4-8 s between the tiers against 2 s a job) that transfers between
    the tiers are on the wire when a checkpoint is written."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_scenario_dict(model={"num_params": 1_000_000_000, "step_time_s": 1.0})))
    return [*HALOS, f"run.scenario={path}", *extra]


def _crash(tiny, common, run_dir, nth: int = 14) -> int:
    """Run until the server dies; the step of the newest checkpoint it left."""
    grid = InlineGrid(client_app, 3, seed=0)
    grid.reply_hook = crash_hook(nth)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), run_dir)
    steps = CheckpointStore(run_dir / "checkpoints").steps()
    assert steps and steps[-1] < 8
    return steps[-1]


def test_a_crashed_halos_server_resumes_with_every_global_update_it_had(tiny, tmp_path):
    common = _common(tmp_path)
    run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    kept = _crash(tiny, common, tmp_path / "run")
    (in_flight,) = CheckpointStore(tmp_path / "run" / "checkpoints").load(kept).state["loop"]["transfers"]
    assert in_flight[2] == "up"  # U_k of a local server on its way to the global one
    # a new Flower run: new node ids, each partition goes back to its local server
    summary = run_server(InlineGrid(client_app, 3, seed=1), tiny(*common, "run.resume=true"), tmp_path / "run")

    full, rows = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "run")
    assert summary["outer_steps"] == 8
    assert [r["step"] for r in rows if r["step"] <= kept] == [r["step"] for r in full if r["step"] <= kept]
    assert sorted({r["step"] for r in rows}) == list(range(9))
    # up to the checkpoint, the resumed run's records are the dead run's: the uninterrupted ones
    for key in ("val/loss", "time/virtual_s", "outer/group", "halos/bytes_to_global_total"):
        assert [r.get(key) for r in rows if r["step"] <= kept] == [r.get(key) for r in full if r["step"] <= kept], key
    # after it, the clock and the byte counts continue from the checkpoint's, and the U_k that
    # was on the wire at the checkpoint is the next global update (not lost, not sent twice)
    after = [r for r in rows if r["step"] > kept]
    before = [r for r in rows if r["step"] <= kept]
    assert after[0]["time/virtual_s"] >= max(r["time/virtual_s"] for r in before)
    assert after[0]["outer/group"] == in_flight[3]
    assert after[0]["halos/bytes_to_global_total"] == max(r.get("halos/bytes_to_global_total", 0) for r in before)
    assert rows[-1]["halos/bytes_to_global_total"] > after[0]["halos/bytes_to_global_total"]
    # the local server whose θ_g reply was owed at the checkpoint got it: both keep sending, and no
    # worker update was refused (a local server still waiting for θ_g refuses them)
    assert {r["outer/group"] for r in after} == {0, 1}
    assert sum(r.get("outer/rejected", 0) for r in rows) == 0
    final = torch.load(tmp_path / "run" / "final_model.pt")["params"]
    assert torch.isfinite(final).all() and rows[-1]["val/loss"] < rows[0]["val/loss"]


def _same(a, b, path="loop") -> None:
    """Nested checkpoint values equal: tensors bit for bit, everything else by ==."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize(("extra", "servers", "payloads"), [
    ((), 2, {("up", "Tensor"), ("down", "Tensor")}),
    # one local server per worker: which partition trains for which is the checkpoint's, not the
    # order in which the new run's nodes happen to show up
    (("halos.group_size=1",), 3, {("up", "Tensor"), ("down", "Tensor")}),
    # U_k compressed with the local servers' error feedback, and each local server's public model
    (("halos.compress=int4", "wire.compress_down=int8"), 2, {("up", "dict"), ("down", "Tensor")}),
])
def test_the_checkpoint_restores_both_tiers_exactly(tiny, tmp_path, monkeypatch, extra, servers, payloads):
    """Every checkpoint of a run (one a global update), restored and read back before the resumed
    loop does anything, equals what was written: transfers on the wire of each kind included; the
    new run's nodes then join the local servers their partitions had."""
    common = _common(tmp_path, *extra, "run.checkpoint_every=1", "run.checkpoint_keep=20")
    _crash(tiny, common, tmp_path / "run", nth=20)
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    seen: dict[str, dict] = {}

    def begin(loop):  # the restored loop, before it does anything
        seen["state"] = loop.extra_state()
        loop.idle_nodes()  # the new run's nodes are given their local servers
        seen["groups"] = sorted([loop.partition_of(n), g] for n, g in loop.node_group.items())
        raise ServerCrash("stop after the restore")

    monkeypatch.setattr(HalosLoop, "begin", begin)
    covered = set()
    for step in reversed(store.steps()):  # a resume takes the newest: drop each after its check
        written = store.load(step).state["loop"]
        assert len(written["lps"]) == servers and len(written["partition_group"]) == 3
        if "halos.compress=int4" in extra:
            assert all(lps["residual"] is not None for lps in written["lps"] if lps["sends"])
            assert all(d is not None for d in written["lps_down"])
        covered |= {(t[2], type(t[4]).__name__) for t in written["transfers"]}
        with pytest.raises(ServerCrash):
            run_server(InlineGrid(client_app, 3, seed=1), tiny(*common, "run.resume=true"), tmp_path / "run")
        _same(written, seen.pop("state"), f"checkpoint {step}")
        assert seen.pop("groups") == written["partition_group"]
        store.path_for(step).unlink()
    assert covered == payloads


@pytest.fixture(scope="module")
def halos_crash(tmp_path_factory):
    """One crashed HALoS run for every case below (each tampers with its own copy): its
    overrides, its folder and the step of its newest checkpoint."""
    base = tmp_path_factory.mktemp("halos")
    common = _common(base)
    return common, base / "run", _crash(tiny_config, common, base / "run")


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda s: s["partition_group"].append([0, 0]), "maps a partition"),
    (lambda s: s["partition_group"].__setitem__(0, [0, 5]), "maps a partition"),
    (lambda s: s["lps"].pop(), "local servers but"),
    (lambda s: s["transfers"].append([1.0, 99, "sideways", 0, torch.zeros(3)]), "malformed transfer"),
    (lambda s: s["transfers"].append([1.0, 99, "down", 0, torch.zeros(3)]), "not a finite fp32 model"),
    (lambda s: s["lps"][0].__setitem__("version", -1), "version"),
    (lambda s: s.__setitem__("local_updates", -3), "negative counters"),
    (lambda s: s["partition_group"].__setitem__(0, [None, 0]), "wrong type or shape"),
    (lambda s: s.pop("gps"), "lacks keys"),
    (lambda s: s["lps"].__setitem__(0, "a server"), "snapshot must be a mapping"),
])
def test_a_tampered_halos_checkpoint_is_refused_in_one_line(tiny, tmp_path, halos_crash, mutate, needle):
    common, crashed, kept = halos_crash
    shutil.copytree(crashed, tmp_path / "run")
    written = CheckpointStore(tmp_path / "run" / "checkpoints").load(kept)
    mutate(written.state["loop"])
    CheckpointStore(tmp_path / "run" / "checkpoints", identity=written.identity).save(kept, written.state)
    with pytest.raises(ConfigError, match=needle):
        run_server(InlineGrid(client_app, 3, seed=1), tiny(*common, "run.resume=true"), tmp_path / "run")
