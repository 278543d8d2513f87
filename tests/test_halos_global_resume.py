"""The two-tier HALoS deployment's global server checkpoints and resumes (fl_geo/halos/apps.py):
the regions keep training through a restart of the global tier and resynchronise with the
restored θ_g (`LocalParameterServer.resync`; the LPS service drops an update made before it)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.halos import LocalParameterServer
from fl_geo.core.state import ParamSpec
from fl_geo.halos.apps import _config, run_global, run_regional
from fl_geo.halos.bridge import app as bridge_app
from fl_geo.halos.ipc import IpcError, exchange
from fl_geo.halos.lps_service import LpsService
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.runtime.wire import encode, payload_nbytes
from tests.conftest import ServerCrash, crash_hook

DEPLOYED = ["strategy.name=halos", "run.clock=wall", "strategy.dynupd=false", "halos.accumulate=2",
            "strategy.inner_steps=2", "run.eval_every=1"]
WATCHDOG_S = 240.0  # far above the runs' seconds: only a stall reaches it


# ---- the LPS's resync ------------------------------------------------------------------------------
def _lps(numel: int = 6, k: int = 2) -> LocalParameterServer:
    return LocalParameterServer(torch.zeros(numel), lr=0.5, momentum=0.0, buffer_size=1, accumulate=k, alpha=0.25)


@pytest.mark.parametrize("outstanding", [True, False])
def test_resync_merges_whatever_was_outstanding_and_starts_a_new_window(outstanding):
    lps = _lps()
    for _ in range(2):
        lps.apply(torch.ones(6))
    if outstanding:
        lps.make_global_update()
        lps.apply(torch.ones(6))  # applied after the send: reaches the GPS only through a merge
    else:  # a window half done (one update of K = 2)
        lps.merge(torch.zeros(6)) if lps.outstanding else None
    before = lps.params.clone()
    theta_g = torch.full((6,), 4.0)
    lps.resync(theta_g)
    expected = before + 0.25 * (theta_g - before)
    assert torch.equal(lps.params, expected) and torch.equal(lps.merged_params, expected)
    assert not lps.outstanding and lps.merged_version == lps.version
    assert not lps.ready_to_send()
    for _ in range(2):
        lps.apply(torch.ones(6))
    assert lps.ready_to_send()  # a full new window of K updates, then the next send
    update = lps.make_global_update()
    assert torch.allclose(update, lps.merged_params - lps.params)


def test_a_fresh_local_server_adopts_the_global_model_on_resync():
    lps = _lps()
    lps.apply(torch.ones(6))  # trained a little from θ_0 before the global model reached it
    theta_g = torch.linspace(-1.0, 1.0, 6)
    lps.resync(theta_g, adopt=True)
    assert torch.equal(lps.params, theta_g) and torch.equal(lps.merged_params, theta_g)
    assert not lps.outstanding and lps.merged_version == lps.version == 1


def test_resync_refuses_a_bad_global_model_and_changes_nothing():
    lps = _lps()
    lps.apply(torch.ones(6))
    lps.apply(torch.ones(6))
    lps.make_global_update()
    state = lps.snapshot()
    for bad in (torch.full((6,), float("nan")), torch.zeros(5)):
        with pytest.raises(ValueError):
            lps.resync(bad)
    after = lps.snapshot()
    assert lps.outstanding and torch.equal(after["params"], state["params"])
    assert torch.equal(after["merged_params"], state["merged_params"])


# ---- the LPS service: epochs -------------------------------------------------------------------
@pytest.fixture
def sock_dir():
    """A short socket folder (tmp_path can exceed the Unix socket path limit)."""
    d = Path(tempfile.mkdtemp(prefix="flgeo-ipc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_resync_exchange_gets_an_update_of_the_new_epoch_not_one_made_before(sock_dir):
    spec = ParamSpec.from_state_dict({"w": torch.zeros(3, 2), "b": torch.zeros(4)})
    svc = LpsService(f"unix://{sock_dir}/r.sock", spec, "fp32", reply_timeout_s=20)
    svc.start()
    try:
        stale, fresh = encode(torch.full((10,), 7.0), spec, "fp32"), encode(torch.full((10,), 1.0), spec, "fp32")
        svc.outbox.put((stale, {"sends": 1}, 0))  # made before the global server resumed
        out: dict = {}
        header = {"op": "exchange", "stop": False, "global_version": 3, "resync": True}
        t = threading.Thread(target=lambda: out.setdefault("r", exchange(
            svc.address, header, encode(torch.full((10,), 2.0), spec, "fp32"), reply_timeout_s=20)))
        t.start()
        theta, stop, version, resync = svc.inbox.get(timeout=10)  # what the loop merges
        assert resync and not stop and version == 3 and torch.equal(theta, torch.full((10,), 2.0))
        svc.outbox.put((fresh, {"sends": 2}, 1))  # the loop's first update after its resync
        t.join(20)
        reply, update = out["r"]
        assert reply["sends"] == 2 and update["w"].numpy().tolist() == [[1.0, 1.0]] * 3
        assert svc.epoch == 1 and svc.dropped == 1 and svc.dropped_bytes == payload_nbytes(stale)
        for bad, why in (({**header, "resync": "yes"}, "'resync' must be a bool"), (header, "without the global model")):
            with pytest.raises(IpcError, match=why):
                exchange(svc.address, bad, None, reply_timeout_s=5)
    finally:
        svc.close()


# ---- the global tier crashes and resumes; the regions go on ----------------------------------------
_ONE_JOB_AT_A_TIME = threading.Lock()


def _serialised(app):
    """The datacenter ClientApp, one message at a time across the regions' threads: in one
    process its workers share the cached model objects that separate SuperNodes would not."""

    def call(msg, context):
        with _ONE_JOB_AT_A_TIME:
            return app(msg, context)

    return call


def _regional(tiny, sock_dir: Path, region: int, run_dir: Path, out: dict, *extra: str, hook=None,
              seed: int = 0, ipc_timeout_s: float = 120) -> threading.Thread:
    cfg = tiny(*DEPLOYED, "run.num_clients=2", *extra)
    grid = InlineGrid(_serialised(client_app), 2, node_configs=[
        {"partition-id": 2 * region + i, "num-partitions": 4} for i in range(2)], seed=10 * seed + region + 1)
    grid.reply_hook = hook

    def main() -> None:
        try:
            out[region] = run_regional(grid, cfg, f"unix://{sock_dir}/r{region}.sock", f"r{region}",
                                       ipc_timeout_s=ipc_timeout_s, run_dir=run_dir)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            out[region] = exc

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    _SERVERS.append((grid, thread))
    return thread


def _bridges(sock_dir: Path) -> InlineGrid:
    grid = InlineGrid(bridge_app, 2, node_configs=[
        {"lps-address": f"unix://{sock_dir}/r{k}.sock", "region": f"r{k}", "region-id": k, "num-regions": 2}
        for k in range(2)], seed=9)
    _SERVERS.append((grid, None))
    return grid


_SERVERS: list[tuple[InlineGrid, threading.Thread | None]] = []  # this test's servers (a thread: in the background)


def _kill(node, msg, reply):
    raise ServerCrash("the test ended: its servers are stopped")


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():
    """A test that fails mid-run would leave its regional and global servers running in daemon
    threads. They share this process's cached ClientApp model objects with the tests that run
    next on this worker, and would train on them behind their backs; so every server a test
    started dies at its next pulled reply, and is waited for, before the next test begins."""
    yield
    servers, _SERVERS[:] = list(_SERVERS), []
    for grid, _ in servers:
        grid.reply_hook = _kill
    for _, thread in servers:
        if thread is not None:
            thread.join(WATCHDOG_S)


def crash_after_first_checkpoint(store_dir: Path):
    """A reply hook that kills the regional ServerApp at the first worker reply it pulls once its
    first checkpoint is on disk. The loop pulls a worker reply in the step right after a merge (its
    workers are always busy, and the first merge cannot carry the stop), so the crash always falls
    after the checkpoint and before the next merge, however slowly the machine runs."""

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train" and CheckpointStore(store_dir).steps():
            raise ServerCrash("regional server killed after its first checkpoint")
        return reply

    return hook


def _global(tiny, ckpt: Path, *extra: str):
    return tiny(*DEPLOYED, "run.num_clients=4", "run.rounds=6", "run.checkpoint_every=1",
                f"run.checkpoint_dir={ckpt}", *extra)


def test_the_global_server_resumes_and_every_region_resynchronises(tiny, tmp_path, sock_dir, caplog):
    """The GPS is killed as it pulls the regions' second replies (their LPSs have sent those
    updates, the GPS never applies them), after checkpoints at global updates 1 and 2. A new
    global run with run.resume=true continues from update 2: both regions, still running, merge
    its θ_g as a resync (an update made before it is dropped, never applied), reach their quota
    of 3 exchanges, and stop; the global model has 6 updates and the metrics each step once."""
    caplog.set_level("INFO", logger="fl_geo")
    ckpt = tmp_path / "gps-ckpt"
    regional: dict = {}
    threads = [_regional(tiny, sock_dir, k, tmp_path / f"r{k}", regional) for k in range(2)]
    crashed = _bridges(sock_dir)
    crashed.reply_hook = crash_hook(4)  # the region query is one; the bridges' replies come two a pull
    with pytest.raises(ServerCrash):
        run_global(crashed, _global(tiny, ckpt), 2, exchange_timeout_s=120, run_dir=tmp_path / "g1")
    last = CheckpointStore(ckpt).steps()[-1]
    assert last == 2  # one update from each region, and both had sent their next
    resumed_theta = CheckpointStore(ckpt).load(last).state["gps"]["params"]  # pruned once the resumed run writes

    summary = run_global(_bridges(sock_dir), _global(tiny, ckpt, "run.resume=true"), 2, exchange_timeout_s=120,
                         run_dir=tmp_path / "g2")
    for t in threads:
        t.join(WATCHDOG_S)
        assert not t.is_alive(), "a regional server did not stop"
    assert summary["resumed_from"] == last and summary["global_version"] == 6 and summary["rejected"] == 0
    assert summary["updates_per_region"] == {"r0": 3, "r1": 3}
    steps = [m["outer/step"] for m in read_metrics(tmp_path / "g2" / "metrics.jsonl")]
    assert steps[:7] == list(range(7)) and steps[7:] == [6]  # each update once, then the final evaluation
    # training went on after the resume: the final model is not the checkpoint's, and it is better
    final = torch.load(tmp_path / "g2" / "final_model.pt")["params"]
    assert torch.isfinite(final).all() and not torch.equal(final, resumed_theta)
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    for k in range(2):
        s = regional[k]
        assert isinstance(s, dict), s  # an exception would mean the LPS broke on the resync
        assert s["resyncs"] == 1 and s["merges"] >= 3
    # 2 updates applied before the crash and 4 after: the two sent into the crash (and any made
    # before a region's resync) were given up, never applied
    assert sum(regional[k]["sends"] for k in range(2)) >= 6 + 2
    assert caplog.text.count(f"resync with the global model (version {last}) after a restart") == 2


def test_a_global_checkpoint_that_does_not_fit_is_one_line(tiny, tmp_path, sock_dir):
    """Checkpoints of another region set, a damaged state or another method's format are each a
    ConfigError before any exchange; nothing is sent to a region."""
    ckpt = tmp_path / "ckpt"
    cfg = _global(tiny, ckpt, "run.resume=true")
    from fl_geo.run_identity import run_identity

    store = CheckpointStore(ckpt, identity=run_identity(cfg))
    grid = _bridges(sock_dir)
    good = _good_state(tiny, cfg)
    cases = [
        ({**good, "regions": {"eu": good["regions"]["r0"], "us": good["regions"]["r1"]}}, "of regions"),
        ({**good, "format": "loop/1"}, "is not 'halos-global/1'"),
        ({k: v for k, v in good.items() if k != "gps"}, "lacks"),
        ({**good, "regions": {"r0": {"sends": -1, "counters": {}}, "r1": good["regions"]["r1"]}}, "must be an int >= 0"),
        ({**good, "history": "x"}, "list of JSON lines"),
        ({**good, "history": ["[1, 2]"]}, "not a metrics record"),
        ({**good, "gps": {**good["gps"], "version": 99}}, "cannot have made global version 99"),
        ({**good, "regions": {"r0": {"sends": 60, "counters": {}}, "r1": {"sends": 39, "counters": {}}},
          "gps": {**good["gps"], "version": 99}}, "snapshot optimizer"),
    ]
    for i, (state, why) in enumerate(cases):
        for p in ckpt.glob("ckpt-*"):
            p.unlink()
        store.save(i + 1, state)
        with pytest.raises(ConfigError, match=why):
            run_global(grid, cfg, 2, exchange_timeout_s=5, run_dir=tmp_path / f"g{i}")
        # refused before any exchange: at most the region query ran (for the region-set check)
        assert [kind for _, kind in grid.executed if kind != "query"] == [], (why, grid.executed)
    assert any(kind == "query" for _, kind in grid.executed)  # the region case did ask the bridges


def _good_state(tiny, cfg) -> dict:
    """A checkpoint of this config's GPS at version 0, two regions r0, r1 (`_global_state`)."""
    from fl_geo.halos.apps import _global_server, _global_state, _model

    spec, params = _model(cfg)
    return _global_state(_global_server(cfg, params), spec, {"r0": 0, "r1": 0}, {}, 0, 0, 0, 5.0,
                         [{"outer/step": 0, "val/loss": 5.0}])


def test_each_tier_keeps_its_checkpoints_in_its_own_folder():
    """Both tiers read one config: a fixed run.checkpoint_dir becomes <dir>/global and
    <dir>/<region>, so no tier's store meets another's files (which it would refuse)."""
    deployed = "run.clock=wall strategy.dynupd=false"
    rc = {"config": "configs/halos.yaml", "overrides": f"{deployed} run.checkpoint_every=2 run.checkpoint_dir=/x/ck"}
    assert _config(rc, "global").run.checkpoint_dir == "/x/ck/global"
    assert _config(rc, "eu").run.checkpoint_dir == "/x/ck/eu"
    assert _config({**rc, "overrides": deployed}, "eu").run.checkpoint_dir == ""  # the run's own folder
    with pytest.raises(ValueError, match="needs run config 'region'"):
        _config(rc, "")


@pytest.mark.parametrize(("resume", "app", "suffix"), [("global", "halos-global", "-global"),
                                                        ("r1", "halos-regional", "-r1")])
def test_halos_run_resume_submits_that_tier_only_resumed(tmp_path, monkeypatch, resume, app, suffix):
    """`fl-geo deploy halos-run ... --resume-global` / `--resume-region r1`: one run, that tier's
    ServerApp, with the interrupted command's overrides and run.resume=true; refused without a
    fixed run.checkpoint_dir (a deployed run writes a new run folder each time) and for a region
    the topology does not have."""
    from dataclasses import replace

    from fl_geo.deploy import halos as launcher
    from fl_geo.deploy.topology import DeployError

    topo = launcher.load_halos_topology(Path(__file__).resolve().parents[1] / "configs/deploy/halos_loopback.yaml")
    topo = replace(topo, ipc_dir=tmp_path / "ipc")
    submitted: list = []

    def submit_all(plans, say):
        submitted.extend(plans)
        raise RuntimeError("submitted")  # stop before waiting on Flower

    monkeypatch.setattr(launcher, "_submit_all", submit_all)
    ov = ["run.checkpoint_every=2", f"run.checkpoint_dir={tmp_path / 'ck'}", "strategy.dynupd=false"]
    with pytest.raises(RuntimeError, match="submitted"):
        launcher.run_halos(topo, "configs/halos.yaml", ov, out_dir=tmp_path, echo=False, resume=resume)
    ((tier, app_dir, rc, run_name),) = submitted
    assert app_dir.name == app and run_name.endswith(suffix)
    assert rc["overrides"].endswith("run.resume=true") and "run.checkpoint_every=2" in rc["overrides"]
    with pytest.raises(DeployError, match="fixed run.checkpoint_dir"):
        launcher.run_halos(topo, "configs/halos.yaml", [ov[0], ov[2]], out_dir=tmp_path, echo=False, resume=resume)
    with pytest.raises(DeployError, match="regions are"):
        launcher.run_halos(topo, "configs/halos.yaml", ov, out_dir=tmp_path, echo=False, resume="mars")


@pytest.mark.parametrize(("failing", "keep", "left"), [({"global"}, True, True), ({"r0"}, True, True),
                                                       ({"global", "r0"}, True, False), ({"global"}, False, False)])
def test_a_failed_tier_leaves_the_others_to_a_resume_only_with_checkpoints(tmp_path, monkeypatch, failing, keep,
                                                                            left):
    """The launcher stops every other tier when one fails, except that with checkpoints a failure
    of one tier alone leaves the others going, for `--resume-global` / `--resume-region`."""
    from types import SimpleNamespace

    from fl_geo.deploy import halos as launcher

    stopped: list[str] = []
    monkeypatch.setattr(launcher, "run_status", lambda tier, rid: (
        "finished:failed" if tier.name in failing else "running", ""))
    monkeypatch.setattr(launcher, "flwr_cli", lambda tier, args, **kw: stopped.append(tier.name))
    plans = [(SimpleNamespace(name=n), tmp_path, rc, f"x-{n}")
             for n, rc in (("r0", {"region": "r0"}), ("r1", {"region": "r1"}), ("global", {"regions": 2}))]
    statuses = launcher._wait_for_runs(plans, {"r0": 1, "r1": 2, "global": 3}, tmp_path, set(), time.monotonic(),
                                       timeout_s=30, status_every_s=0.01, keep_regions=keep)
    running = sorted({"r0", "r1", "global"} - failing)
    assert all(statuses[t] == "finished:failed" for t in failing)
    if left:
        assert stopped == [] and all(statuses[t] == launcher.LEFT_FOR_RESUME for t in running)
    else:
        assert sorted(stopped) == running and all(statuses[t] == "stopped:after-failure" for t in running)


@pytest.mark.parametrize("crash", ["after-checkpoint", "before-checkpoint"])
def test_a_regional_server_resumes_and_the_global_server_resends_it_the_model(tiny, tmp_path, sock_dir, caplog,
                                                                              crash):
    """Region r0's ServerApp is killed at the first worker reply after its checkpoint at its first
    merge (or at its 2nd worker reply: one update applied of the K = 2 a send needs, so before
    any merge and any checkpoint). Its bridge's exchange fails; the GPS (keeping
    checkpoints, so it retries) sends r0 θ_g again as a resync until a new regional run of r0 on
    new worker nodes takes it: resumed from its checkpoint it merges θ_g, started afresh it adopts
    it. The run ends with all 6 global updates, 3 per region; r1 never noticed."""
    caplog.set_level("INFO", logger="fl_geo")
    ck = ["run.checkpoint_every=1", f"run.checkpoint_dir={tmp_path / 'r0-ckpt'}"]
    regional: dict = {}
    kill = crash_after_first_checkpoint(tmp_path / "r0-ckpt") if crash == "after-checkpoint" else crash_hook(2)
    first = _regional(tiny, sock_dir, 0, tmp_path / "r0a", regional, *ck, hook=kill)
    other = _regional(tiny, sock_dir, 1, tmp_path / "r1", regional)
    out: dict = {}
    gps = threading.Thread(target=lambda: out.setdefault("s", run_global(
        _bridges(sock_dir), _global(tiny, tmp_path / "gps-ckpt"), 2, exchange_timeout_s=120, connect_timeout_s=60,
        run_dir=tmp_path / "g")), daemon=True)
    gps.start()
    first.join(WATCHDOG_S)
    assert isinstance(regional.pop(0), ServerCrash)  # r0's ServerApp died
    assert CheckpointStore(tmp_path / "r0-ckpt").steps() == ([1] if crash == "after-checkpoint" else [])
    resumed = _regional(tiny, sock_dir, 0, tmp_path / "r0b", regional, *ck, "run.resume=true", seed=1)
    for t in (gps, resumed, other):
        t.join(WATCHDOG_S)
        assert not t.is_alive(), "a server did not finish"
    s = out["s"]
    assert s["global_version"] == 6 and s["updates_per_region"] == {"r0": 3, "r1": 3} and s["rejected"] == 0
    r0, r1 = regional[0], regional[1]
    assert isinstance(r0, dict) and isinstance(r1, dict), (r0, r1)
    # each retry the resumed region took is one resync there (none failed: it came back at once);
    # a bounded count: the global server did not spin on the dead region
    assert 1 <= s["exchange_retries"] == r0["resyncs"] <= 3 and r1["resyncs"] == 0
    assert "sending it θ_g again as a resync" in caplog.text
    if crash == "after-checkpoint":
        assert "resumed at merge" in caplog.text and "after a restart; merged it" in caplog.text
    else:
        assert "holds no checkpoint: starting a new run" in caplog.text and "after a restart; adopted it" in caplog.text


def test_without_checkpoints_a_failed_region_still_ends_the_global_run(tiny, tmp_path, sock_dir):
    """No run.checkpoint_every: nothing could resume the region, so its failed exchange ends the
    global run at once (no retries), as before."""
    regional: dict = {}
    first = _regional(tiny, sock_dir, 0, tmp_path / "r0", regional, hook=crash_hook(6))
    other = _regional(tiny, sock_dir, 1, tmp_path / "r1", regional, ipc_timeout_s=8)
    cfg = tiny(*DEPLOYED, "run.num_clients=4", "run.rounds=6")
    with pytest.raises(RuntimeError, match="bridge of region r0"):
        run_global(_bridges(sock_dir), cfg, 2, exchange_timeout_s=30, connect_timeout_s=5, run_dir=tmp_path / "g")
    first.join(WATCHDOG_S)
    assert isinstance(regional[0], ServerCrash)
    other.join(WATCHDOG_S)  # r1 hears nothing more from the global server: it gives up after its ipc timeout
    assert isinstance(regional[1], TimeoutError)
