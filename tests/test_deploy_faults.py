"""Faults in a real deployment (issue 7): a SuperLink and two SuperNodes on loopback, and

- a SuperNode SIGKILLed mid-run, then started again with the same node config (same partition);
- the ServerApp SIGKILLed mid-run, then the same run submitted again with ``run.resume=true``.

A killed SuperNode cannot say goodbye: the SuperLink only notices when its heartbeats stop, which
in Flower 1.41 is after ``HEARTBEAT_PATIENCE`` (2) x the interval the node reports (30 s, a
constant with no command-line flag). The SuperNodes of these tests run through a small wrapper
that sets the interval to 10 s, the least the SuperLink accepts, so a dead node goes offline
within ~20 s instead of ~60 s. Nothing else about the processes changes.

Every process started here (and everything it spawned) is stopped at the end, even on failure.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fl_geo.deploy import launch, lifecycle, processes, topology
from fl_geo.deploy.topology import DeployError, load_topology, parse_topology
from tests.conftest import down_and_assert_clean, free_ports
from tests.test_deploy import SITES, TINY_RUN, TOKENS_PER_UPDATE, _base, _metrics, _received, _sites

# SuperLink/SuperNode processes on free ports (both tests share one federation, below): safe on every
# worker of `make test`.

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 10  # flwr.common.constant.HEARTBEAT_MIN_INTERVAL: the SuperLink refuses less

# flower-supernode with a shorter heartbeat: the interval is a module constant in Flower 1.41.
_SUPERNODE_WRAPPER = f"""
import sys
import flwr.supercore.heartbeat as hb
import flwr.supernode.fleet_http_connection as conn
hb.HEARTBEAT_DEFAULT_INTERVAL = conn.HEARTBEAT_DEFAULT_INTERVAL = {HEARTBEAT_S}
from flwr.supernode.cli.flower_supernode import flower_supernode
sys.argv[0] = "flower-supernode"
sys.exit(flower_supernode())
"""


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_family(pid: int) -> set[int]:
    """SIGKILL a process, its process group and every descendant (a site losing power)."""
    family = {pid} | processes._descendants([pid])
    for p in family:
        processes._signal(p, signal.SIGKILL, group=False)
    processes._signal(pid, signal.SIGKILL, group=True)
    for p in family:
        processes._reap(p)
    _wait_for(f"pids {sorted(family)} to die", lambda: not any(processes._alive(p) for p in family), 10)
    return family


def _run_dir(out: Path, name: str) -> Path | None:
    dirs = sorted(out.glob(f"{name}-*"))
    return dirs[-1] if dirs else None


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return [m for m in _metrics(run_dir) if m.get("step", 0) > 0]
    except (OSError, json.JSONDecodeError):
        return []


def _wait_run(topo: topology.Topology, run_id: int, run_dir: Path, timeout_s: float) -> str:
    state, details = launch.wait_for_run(topo, run_id, (run_dir / "summary.json").is_file, timeout_s=timeout_s)
    assert state != "timeout", f"run {run_id}: {details}"
    return f"{state} {details}".strip()


class FaultFederation:
    """The shared fault federation: its topology, the node config ``state-dir`` of its SuperNodes,
    and the pids a test killed by hand (teardown checks they are gone too)."""

    def __init__(self, topo: topology.Topology, node_state: Path) -> None:
        self.topo, self.node_state, self.killed = topo, node_state, set()


# Both fault tests run on one federation (a federation costs ~20 s of CPU to start): each is its own
# Flower run with its own run name, and counts messages as differences. The SuperNode test leaves a
# replacement node in place of the one it killed, with the same node config, so either order works.
# The group keeps both on the xdist worker where the module fixture lives.
SHARED = pytest.mark.xdist_group("deploy-faults")


@pytest.fixture(scope="module")
def fault_federation(tmp_path_factory):
    """A plaintext loopback topology on free ports whose SuperNodes use a 10 s heartbeat and keep
    their inner state under one node config ``state-dir``.

    Teardown (also after a failure) stops everything the topology recorded and asserts that no
    process of it, nor any process it spawned or a test killed by hand, is left alive.
    """
    tmp = tmp_path_factory.mktemp("faults")
    wrapper = tmp / "supernode_short_heartbeat.py"
    wrapper.write_text(_SUPERNODE_WRAPPER, encoding="utf-8")
    original = processes.supernode_command

    def supernode_command(topo, node, private_key=None):
        return [sys.executable, str(wrapper), *original(topo, node, private_key)[1:]]

    node_state = tmp / "node-state"
    data = _sites()
    ports = free_ports(1 + len(data["nodes"]))
    data["name"] = "faults"
    data["superlink"]["port"] = ports[0]
    for node, port in zip(data["nodes"], ports[1:], strict=True):
        node["port"] = port
        node["node_config"]["state-dir"] = str(node_state)
    data["flwr_home"] = str(tmp / "flwr")
    data["state_dir"] = str(tmp / "state")
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    topo = load_topology(path)
    federation = FaultFederation(topo, node_state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lifecycle, "supernode_command", supernode_command)  # where up() looks it up
        try:
            lifecycle.up(topo, timeout_s=180)
            yield federation
        finally:
            down_and_assert_clean(topo, also=federation.killed)


def test_node_config_state_dir_is_optional_validated_and_resolved(tmp_path):
    data = _base()
    data["nodes"][0]["node_config"]["state-dir"] = "node-state"
    data["nodes"][1]["node_config"]["state-dir"] = str(tmp_path / "abs")
    topo = parse_topology(data, tmp_path, "t.yaml")
    assert topo.nodes[0].node_config["state-dir"] == str(tmp_path.resolve() / "node-state")
    assert topo.nodes[1].node_config_arg().endswith(f'state-dir="{tmp_path / "abs"}"')
    assert "state-dir" not in topo.nodes[2].node_config
    for bad, message in ((42, "non-empty string"), ("", "non-empty string"), ('a"b', "double quotes")):
        data["nodes"][0]["node_config"]["state-dir"] = bad
        with pytest.raises(DeployError, match=message):
            parse_topology(data, tmp_path, "t.yaml")


@SHARED
@pytest.mark.slow(seconds=78)
def test_supernode_killed_mid_run_then_rejoins(fault_federation, tmp_path):
    """SIGKILL one SuperNode after the first outer step: the run neither stalls nor crashes; the
    round in flight finishes on the other once the dead node's heartbeat lapses; with
    ``run.min_live_nodes`` the next round waits for a SuperNode with the same node config
    (partition) to start again, which is profiled and trains from the server's current model."""
    t0 = time.monotonic()
    topo = fault_federation.topo
    live = _live_supernodes(topo)
    trained_before = {r.name: _received(r.log) for r in live}
    out = tmp_path / "runs"
    rounds = 3  # before the kill, the round the kill falls in, after the rejoin
    # run.min_live_nodes holds round 3 until the replacement has registered: without it the round
    # starts with the survivor alone when the replacement's start is slower than the dead node's
    # heartbeat lapse (CI once saw accepted [2, 1, 1] on a loaded machine).
    res = launch.run_experiment(topo, "configs/diloco.yaml",
                                [*TINY_RUN, f"run.rounds={rounds}", f"run.min_live_nodes={SITES}", "run.name=kill-node"],
                                out_dir=out, wait=False, echo=False)
    _wait_for("the first outer step", lambda: (d := _run_dir(out, "kill-node")) is not None and _steps(d), 300)
    run_dir = _run_dir(out, "kill-node")
    assert run_dir is not None

    victim = live[-1]
    t_kill = time.monotonic()
    fault_federation.killed.update(_kill_family(victim.pid))
    done_before_kill = len(_steps(run_dir))

    # The same site comes back (same node config, so the same partition); a fresh Runtime API
    # port avoids waiting for the dead one's socket. Flower gives it a new node id.
    spec = next(n for n in topo.nodes if victim.name.startswith(n.name))
    again = topology.NodeSpec(f"{spec.name}-again", free_ports(1)[0], dict(spec.node_config))
    _, rejoined = processes.start_process(topo, "supernode", again.name, processes.supernode_command(topo, again))

    final = _wait_run(topo, res.run_id, run_dir, 400)
    wall = time.monotonic() - t0
    assert final.startswith("finished:completed"), final
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer_steps"] == rounds and summary["rejected"] == 0
    assert math.isfinite(summary["final_val_loss"])
    steps = _steps(run_dir)
    accepted = [int(m["outer/accepted"]) for m in steps]
    assert [m["step"] for m in steps] == list(range(1, rounds + 1))
    assert accepted[0] == SITES, accepted  # before the kill: the killed node's update counted
    assert done_before_kill >= 1
    # The round in flight at the kill loses the dead node (it vanishes once its heartbeat lapses),
    # later rounds run without it or with the rejoined node; the last one has every site.
    assert SITES - 1 in accepted[done_before_kill:], accepted
    assert set(accepted) <= {SITES - 1, SITES}, accepted
    assert accepted[-1] == SITES, accepted
    assert summary["tokens"] == sum(accepted) * TOKENS_PER_UPDATE
    # Rejoined: asked for its profile once, then trained; its updates were accepted, and an update
    # is only accepted when the base_version it reports equals the server's current version.
    assert _received(rejoined.log, "query") == 1, rejoined.log
    assert _received(rejoined.log) >= 1, rejoined.log
    for rec in live[:-1]:  # the survivors trained every round
        assert _received(rec.log) - trained_before[rec.name] == rounds, rec.log
    print(f"\n[fault: supernode killed] run {wall:.1f} s "
          f"(kill at {t_kill - t0:.1f} s), accepted per step {accepted}, ServerApp {summary['wall_s']:.1f} s",
          file=sys.stderr)


def _live_supernodes(topo: topology.Topology) -> list[processes.ProcRecord]:
    """The topology's SuperNodes that are running now (a killed one is left out, its replacement in)."""
    return [r for r in processes.load_records(topo) if r.role == "supernode" and r.alive()]


def _sent(log: str, kind: str = "train") -> int:
    return Path(log).read_text(encoding="utf-8", errors="replace").count(f"Sending: {kind} message")


def _held(log: str, kind: str = "train") -> int:
    """The ``kind`` messages a SuperNode has received in full (its objects pulled), from its log: a
    node receives one message at a time, and "Received successfully" closes the last "Receiving:"
    (the SuperExec's "Start `flwr-clientapp` process" may come between them)."""
    count, pending = 0, None
    for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines():
        if "Receiving: " in line:
            pending = f"Receiving: {kind} message" in line
        elif "Received successfully" in line and pending is not None:
            count, pending = count + pending, None
    return count


def _server_apps(topo: topology.Topology) -> list[int]:
    """The topology's ServerApp processes (``flwr-serverapp``): started by the SuperLink's
    SuperExec, which is the SuperLink's child, or the app server's with ``warm_apps``."""
    records = processes.load_records(topo)
    return sorted(p for p in processes._descendants(r.pid for r in records) if "flwr-serverapp" in _cmdline(p))


@SHARED
@pytest.mark.slow(seconds=104)
def test_serverapp_killed_mid_run_then_resumed(fault_federation, tmp_path):
    """SIGKILL the ServerApp after checkpoint 1, submit the same run with ``run.resume=true``: it
    resumes from the checkpoint (a new Flower run: the nodes reload their inner state from their
    node config ``state-dir``), finishes every round with each step once, and its final model is
    bit-identical to an uninterrupted run of the same config."""
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.config import load_config
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    t0 = time.monotonic()
    topo, node_state = fault_federation.topo, fault_federation.node_state
    logs = [r.log for r in _live_supernodes(topo)]
    sent_before = {log: _sent(log) for log in logs}
    held_before = {log: _held(log) for log in logs}
    out, ckpts = tmp_path / "runs", tmp_path / "checkpoints"
    rounds = 2  # the kill falls in the last round: the resumed run folds it once, from checkpoint 1
    common = [*TINY_RUN, f"run.rounds={rounds}", "run.name=kill-server", "run.checkpoint_every=1",
              f"run.checkpoint_dir={ckpts}"]
    first = launch.run_experiment(topo, "configs/diloco.yaml", common, out_dir=out, wait=False, echo=False)
    _wait_for("checkpoint 1", lambda: (ckpts / "ckpt-00000001.pt").exists(), 300, poll_s=0.05)
    apps = _wait_for("the ServerApp process", lambda: _server_apps(topo), 10)
    assert len(apps) == 1, [_cmdline(p) for p in apps]
    # Kill in the middle of round 2: as soon as one site has sent its round-2 update (the others
    # are usually still training, so the server never folds that round; the nodes that already
    # trained it must rewind when the resumed server sends it again) and every site holds its
    # round-2 message. A message still queued when the run is stopped below meets a Flower 1.42
    # SuperNode bug: pulled after the stop, it is "ignored" (RunNotRunningException while its
    # objects are pulled) but its task is left in place, so a ClientApp trains it anyway and the
    # node sends that stray reply in place of the next one. The next one, the resumed run's
    # profile query, then waits in the node until the node pulls another message, which never comes:
    # the resumed run went on without that site after its first-jobs bound (~2 min) and ended on
    # other bits (seen once in a fresh clone's `make test`).
    def sent(log: str) -> int:  # this run's train replies
        return _sent(log) - sent_before[log]

    def held(log: str) -> int:  # this run's train messages received in full
        return _held(log) - held_before[log]

    _wait_for("a round-2 reply, every site holding its round-2 message",
              lambda: any(sent(log) >= rounds for log in logs) and all(held(log) >= rounds for log in logs),
              240, poll_s=0.05)
    fault_federation.killed.update(_kill_family(apps[0]))
    t_kill = time.monotonic()
    folded = (ckpts / f"ckpt-{rounds:08d}.pt").exists()  # every site was quicker than the kill: rare
    trained_last = sum(sent(log) >= rounds for log in logs)
    (cut_dir,) = out.glob("kill-server-*")
    assert not (cut_dir / "final_model.pt").exists()
    # What an operator does next: stop the dead run. Otherwise the SuperLink keeps it RUNNING
    # until the ServerApp's heartbeat lapses (~60 s, "No heartbeat received from the task") and
    # each SuperNode sits on its queued message of the dead run until then.
    stop = processes.flwr_cli(topo, ["stop", str(first.run_id), topo.name])
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert launch.run_status(topo, first.run_id)[0] == "finished:stopped"

    resumed = launch.run_experiment(topo, "configs/diloco.yaml", [*common, "run.resume=true"], out_dir=out,
                                    timeout_s=400, echo=False)
    wall = time.monotonic() - t0
    assert resumed.ok, (resumed.status, resumed.details)
    assert resumed.run_dir is not None and resumed.run_dir != cut_dir
    logs = processes.flwr_cli(topo, ["log", str(resumed.run_id), topo.name]).stdout
    assert "resumed from" in logs, logs[-3000:]
    s = resumed.summary
    assert s is not None and s["outer_steps"] == rounds and s["rejected"] == 0
    steps = [m["step"] for m in _metrics(resumed.run_dir)]
    assert steps == list(range(rounds + 1)), steps  # each step once, in order
    assert sorted(p.name for p in (node_state / "kill-server").iterdir()) == [
        f"partition-{i}.pt" for i in range(SITES)]

    # The uninterrupted run, in-process on the same code path (InlineGrid): synchronous DiLoCo
    # folds in rank order and every client trains single-threaded, so the bits must agree.
    t_ref = time.monotonic()
    cfg = load_config(ROOT / "configs" / "diloco.yaml", [*TINY_RUN, f"run.rounds={rounds}", "run.name=kill-server",
                                                          "run.checkpoint_every=1"])
    run_server(InlineGrid(client_app, SITES, seed=0), cfg, tmp_path / "reference")
    ref = torch.load(tmp_path / "reference" / "final_model.pt")["params"]
    got = torch.load(resumed.run_dir / "final_model.pt")["params"]
    assert torch.equal(ref, got), f"max |diff| {float((ref - got).abs().max())}"
    print(f"\n[fault: ServerApp killed] killed at {t_kill - t0:.1f} s, resumed run "
          f"{resumed.wall_s:.1f} s (ServerApp {s['wall_s']:.1f} s), deployment total {wall:.1f} s, reference "
          f"{time.monotonic() - t_ref:.1f} s; {trained_last} node(s) had trained round {rounds} before the kill, "
          f"round {rounds} {'already' if folded else 'not'} folded", file=sys.stderr)
