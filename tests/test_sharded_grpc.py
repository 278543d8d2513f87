"""The sharded Di-PS over the gRPC data path: follower processes, clients push/pull shards there.

Same virtual-clock set-up as test_sharded_loop.py; here the followers are processes started by the
leader (`FollowerSupervisor`) and every update and model crosses a loopback TCP connection.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from fl_geo.strategies.sharded import ShardedDiPSLoop
from tests.conftest import ServerCrash, crash_hook, keep_declaration

VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16", "model.n_layers=3"]
DIPS = ["strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
        "penalty.clip=1.0", "penalty.warmup=2"]


def _run(cfg, run_dir):
    summary = run_server(InlineGrid(client_app, cfg.run.num_clients, seed=0), cfg, run_dir)
    return summary, torch.load(run_dir / "final_model.pt")["params"]


def _follower_pids(workdir) -> list[int]:
    """Processes writing their stdout into ``workdir``: the followers, forked from the fork
    server (whose command line they keep) or started as ``python -m fl_geo.ps.follower_main``."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out = os.readlink(f"/proc/{pid}/fd/1")
            except OSError:
                continue
            if out.startswith(str(workdir) + os.sep) and Path(out).name.startswith("follower-"):
                pids.append(int(pid))
    return pids


def assert_sites_pulled_what_was_planned(rows: list[dict]) -> None:
    """The bytes the sites say they pulled from the followers (``comm/bytes_down_pulled_total``,
    counted when a reply is read) are the bytes the leader counted when it sent their jobs
    (``comm/bytes_down_total``): in these deterministic runs each step's jobs reply by the next
    step, so the pulled total of step k is the sent total of step k - 1."""
    steps = [r for r in rows if "comm/bytes_down_pulled_total" in r]
    sent = [r["comm/bytes_down_total"] for r in steps]
    pulled = [r["comm/bytes_down_pulled_total"] for r in steps]
    assert len(steps) >= 4 and 0 < pulled[0] < sent[0]
    assert pulled[1:] == sent[:-1]


def test_grpc_followers_give_the_bits_of_in_process_followers(tiny, tmp_path):
    """Follower processes on plaintext gRPC, and on TLS with the `fl-geo deploy certs` files
    (``ps.tls_certs_dir``: followers serve TLS, clients verify them with the CA certificate the
    leader sends), end on the bits of in-process followers."""
    from fl_geo.deploy.certificates import generate_certs

    local_s, local = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=5", "ps.followers=2"), tmp_path / "local")
    grpc_s, remote = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=5", "ps.followers=2", "ps.transport=grpc",
                               "ps.checkpoint_keep=2"), tmp_path / "grpc")
    assert torch.equal(local, remote)
    assert grpc_s["outer_steps"] == local_s["outer_steps"] == 5
    certs = generate_certs(tmp_path / "certs", ["127.0.0.1", "localhost"], [])
    tls_s, secure = _run(tiny(*VIRTUAL, *DIPS, "run.rounds=5", "ps.followers=2", "ps.transport=grpc",
                              f"ps.tls_certs_dir={certs.root}"), tmp_path / "tls")
    assert tls_s["outer_steps"] == 5 and torch.equal(local, secure)
    workdir = tmp_path / "grpc" / "ps"
    for i in range(2):  # every follower checkpointed each step and kept the newest two
        ckpts = sorted(p.name for p in (workdir / f"follower-{i}").glob("ckpt-*.pt"))
        assert len(ckpts) == 2 and ckpts[-1].startswith("ckpt-00000005")
    assert not _follower_pids(workdir)  # the leader stopped its followers
    rows = read_metrics(tmp_path / "grpc")
    assert_sites_pulled_what_was_planned(rows)
    assert sum(r.get("outer/accepted", 0) for r in rows) == sum(r.get("outer/accepted", 0) for r in read_metrics(tmp_path / "local"))


@pytest.mark.parametrize("when", ["after_step", "mid_window", "after_step_compressed_down"])
def test_a_killed_follower_is_restarted_from_its_checkpoint_and_loses_no_step(tiny, tmp_path, monkeypatch, caplog, when):
    """``after_step``: killed right after step 2 (pushes it held for step 3 are lost and redone);
    ``mid_window``: killed once step 3's window has folded an update (the window is voided);
    ``after_step_compressed_down``: the first with ``wire.compress_down=int8``: the restarted
    follower reloads its x̂_s with a new lineage, so every site is sent the model whole next."""
    caplog.set_level("WARNING", logger="fl_geo")
    seen: dict[str, object] = {}
    log_step, recover, fold = ShardedDiPSLoop._log_step, ShardedDiPSLoop._recover, ShardedDiPSLoop.fold_update

    def kill(self):
        shard = self.plan.shards[1]
        seen["before"] = self.followers[1].pull_params(shard.numel)
        seen["pid"] = self.backend.supervisor.pid(1)
        self.backend.supervisor.kill(1)
        seen["killed"] = True

    def kill_after_step_2(self, metrics):
        log_step(self, metrics)
        if when.startswith("after_step") and self.version == 2 and "killed" not in seen:
            kill(self)

    def kill_mid_window(self, ev, r, staleness):
        out = fold(self, ev, r, staleness)
        if when == "mid_window" and self.version == 2 and out is not None and "killed" not in seen:
            kill(self)
        return out

    def watch_recover(self):
        recover(self)
        seen.setdefault("after", self.followers[1].pull_params(self.plan.shards[1].numel))
        seen["new_pid"] = self.backend.supervisor.pid(1)

    monkeypatch.setattr(ShardedDiPSLoop, "_log_step", kill_after_step_2)
    monkeypatch.setattr(ShardedDiPSLoop, "_recover", watch_recover)
    monkeypatch.setattr(ShardedDiPSLoop, "fold_update", kill_mid_window)
    down = ["wire.compress_down=int8"] if when.endswith("compressed_down") else []
    cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=6", "ps.followers=2", "ps.transport=grpc", "ps.heartbeat_s=0.5", *down)
    summary, final = _run(cfg, tmp_path / "run")
    assert summary["outer_steps"] == 6 and torch.isfinite(final).all()
    assert seen["new_pid"] != seen["pid"]
    v_before, theta_before = seen["before"]
    v_after, theta_after = seen["after"]
    assert v_before == v_after == 2 and torch.equal(theta_before, theta_after)  # step 2 survived, bit for bit
    assert "restarting it from its checkpoint" in caplog.text
    rows = [r for r in read_metrics(tmp_path / "run")[1:] if r["outer/accepted"] > 0]
    assert [int(r["outer/step"]) for r in rows] == list(range(1, 7))  # every step happened once
    rows_all = read_metrics(tmp_path / "run")[1:]
    failed = sum(r["outer/failed"] for r in rows_all)
    assert failed >= 1  # what the dead follower held was lost (voided or redone), never stepped half
    assert rows_all[-1]["ps/voided_total"] == (1 if when == "mid_window" else 0)
    if down:  # 4 sites whole at the start, and each whole again at its first job after the restart
        # (at least: a failed job, or a site more versions behind than the chain keeps, is sent x-hat
        # whole too, and which jobs fail depends on when the kill lands)
        kill_row = next(r for r in rows_all if r.get("outer/step") == 2)
        at_kill = kill_row["comm/down_full"]
        assert at_kill >= 4 and rows_all[-1]["comm/down_full"] - at_kill >= 4  # all 4 again after it
        # and the cheap path came back after the restart: deltas sent after the kill's step
        assert rows_all[-1]["comm/down_delta"] > kill_row["comm/down_delta"]
    meta = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert meta["outer_steps"] == 6
    assert not _follower_pids(tmp_path / "run" / "ps")


@pytest.mark.parametrize("transport", ["grpc"])
def test_reply_with_arrays_is_refused_when_updates_go_to_the_followers(tiny, tmp_path, transport, caplog):
    """A client that ignores the data path and ships its update in the reply is rejected."""
    from flwr.app import Array, ArrayRecord, Message

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error() or hook.done:
            return reply
        hook.done = True
        content = keep_declaration(reply, {"arrays": ArrayRecord({"x": Array(torch.zeros(2).numpy())}),
                              "metrics": reply.content.metric_records["metrics"]})
        return Message(content, reply_to=msg)

    hook.done = False
    caplog.set_level("WARNING", logger="fl_geo")
    grid = InlineGrid(client_app, 4, seed=0)
    grid.reply_hook = hook
    cfg = tiny(*VIRTUAL, *DIPS, "run.rounds=3", "ps.followers=2", f"ps.transport={transport}")
    summary = run_server(grid, cfg, tmp_path / "run")
    assert summary["rejected"] == 1 and summary["outer_steps"] == 3
    assert "carries arrays" in caplog.text


def test_a_tls_follower_answers_a_client_that_trusts_its_ca_and_refuses_a_plaintext_one(tmp_path):
    """The follower side of ``ps.tls_certs_dir`` (a whole run over TLS, bit for bit, is in
    test_grpc_followers_give_the_bits_of_in_process_followers)."""
    from fl_geo.deploy.certificates import generate_certs

    certs = generate_certs(tmp_path / "certs", ["127.0.0.1", "localhost"], [])
    from fl_geo.core.shards import ShardPlan
    from fl_geo.core.state import ParamSpec
    from fl_geo.ps.channel import TlsFiles
    from fl_geo.ps.client import FollowerClient
    from fl_geo.ps.frames import DataPathError
    from fl_geo.ps.supervisor import FollowerSupervisor

    spec = ParamSpec(("blocks.0.w",), ((64,),), ("float32",))
    tls = TlsFiles(certs.ca_cert, certs.server_cert, certs.server_key)
    with FollowerSupervisor(ShardPlan.build(spec, 1), workdir=tmp_path / "sup", tls=tls, keep=1) as sup:
        sup.start(torch.zeros(64))
        with sup.client(0) as ok:
            assert ok.health()["index"] == 0
        with FollowerClient(sup.addresses[0], retry_s=1.0) as plaintext, pytest.raises(DataPathError):
            plaintext.health()


def _crash_and_resume(tiny, run_dir, *overrides, between=None):
    common = [*VIRTUAL, *DIPS, "run.rounds=6", *overrides]
    grid = InlineGrid(client_app, 4, seed=0)  # the sites outlive the leader
    grid.reply_hook = crash_hook(11)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), run_dir)
    if between is not None:
        between()
    grid.reply_hook = None
    summary = run_server(grid, tiny(*common, "run.resume=true"), run_dir)
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(7))  # every step once, the ones before the crash from the checkpoint
    return summary, torch.load(run_dir / "final_model.pt")["params"]


def test_a_restarted_leader_resumes_in_process_followers_bit_identically(tiny, tmp_path):
    """In process, the leader's checkpoint holds the shards' θ and outer state: a resumed leader
    gives the bits of the single-server Di-PS resumed at the same point."""
    _, single = _crash_and_resume(tiny, tmp_path / "f0", "run.checkpoint_every=1")
    _, local = _crash_and_resume(tiny, tmp_path / "local", "run.checkpoint_every=1", "ps.followers=2")
    assert torch.equal(single, local)


def test_a_restarted_leader_rewinds_follower_processes_to_its_step(tiny, tmp_path, caplog):
    """With follower processes the leader saves only metadata (every 2 steps here) and the
    followers their shards (every step): a resumed leader restarts them from their checkpoint of
    its own last step, dropping the newer ones, and the run completes."""
    from fl_geo.core.checkpoint import CheckpointStore

    caplog.set_level("WARNING", logger="fl_geo")
    run_dir = tmp_path / "grpc"
    # the uninterrupted in-process run gives the state every follower must resume from
    reference = [*VIRTUAL, *DIPS, "run.rounds=6", "ps.followers=2", "run.checkpoint_every=2"]
    _run(tiny(*reference), tmp_path / "ref")
    at_step_2 = CheckpointStore(tmp_path / "ref" / "checkpoints").load(2).state["params"]
    seen = {}

    def check_followers():
        leader = CheckpointStore(run_dir / "checkpoints").load_latest()
        seen["leader_step"] = leader.step
        seen["leader_bytes"] = (run_dir / "checkpoints" / leader.path.name).stat().st_size
        shards = [CheckpointStore(run_dir / "ps" / f"follower-{i}").load(leader.step).state["params"] for i in range(2)]
        seen["equal"] = torch.equal(torch.cat(shards), at_step_2)
        seen["ahead"] = max(CheckpointStore(run_dir / "ps" / "follower-0").steps())

    summary, final = _crash_and_resume(tiny, run_dir, "run.checkpoint_every=2", "ps.followers=2", "ps.transport=grpc",
                                       "ps.checkpoint_keep=3", between=check_followers)
    assert seen["leader_step"] == 2 and seen["ahead"] > 2 and seen["equal"]
    assert seen["leader_bytes"] < 200_000  # metadata only: the model lives in the followers' checkpoints
    assert "newer than the leader's step 2" in caplog.text
    assert summary["outer_steps"] == 6 and torch.isfinite(final).all()
    assert not _follower_pids(run_dir / "ps")
