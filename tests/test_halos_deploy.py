"""HALoS in the Flower-native two-tier deployment (fl_geo/halos/apps.py, fl_geo/deploy/halos.py).

Fast tests cover the IPC (framing, validation, timeouts, a missing LPS) and the two-tier topology
file. The slow test runs the whole layout on loopback: a global SuperLink with two bridge
SuperNodes, two regional SuperLinks with two workers each, two regional ServerApps (LPS) and the
global ServerApp (GPS), with K = 2 and two global updates per region, and checks that updates
crossed both tiers and that every process started is stopped again.
"""

from __future__ import annotations

import json
import math
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fl_geo import cli
from fl_geo.core.state import ParamSpec
from fl_geo.deploy import processes
from fl_geo.deploy.halos import (
    halos_down,
    load_halos_topology,
    parse_halos_topology,
    run_halos,
)
from fl_geo.deploy.topology import DeployError
from fl_geo.deploy.warm_apps import supported as warm_apps_supported
from fl_geo.halos.apps import LpsService
from fl_geo.halos.ipc import IpcError, exchange, recv_frame, send_frame, unix_path
from fl_geo.runtime.wire import encode
from tests.conftest import free_ports, tiny_overrides

# SuperLink/SuperNode processes on free ports, each test its own: safe on both of `make test`'s workers.

ROOT = Path(__file__).resolve().parents[1]
HALOS_LOOPBACK = ROOT / "configs" / "deploy" / "halos_loopback.yaml"

TINY_RUN = tiny_overrides("strategy.inner_steps=5", "strategy.dynupd=false",
                          drop=("run.rounds", "run.num_clients", "run.backend", "run.sim_cpus", "strategy.inner_steps"))


# ---------------------------------------------------------------------------------------------
# IPC
# ---------------------------------------------------------------------------------------------


def _spec() -> ParamSpec:
    return ParamSpec.from_state_dict({"w": torch.zeros(3, 2), "b": torch.zeros(4)})


@pytest.fixture
def sock_dir():
    """A short socket folder (tmp_path can exceed the Unix socket path limit)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="flgeo-ipc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_unix_path_rejects_other_schemes():
    assert unix_path("unix:///tmp/a.sock") == "/tmp/a.sock"
    for bad in ("tcp://127.0.0.1:1", "unix://rel.sock", "/tmp/a.sock", "unix:///" + "x" * 120):
        with pytest.raises(IpcError):
            unix_path(bad)


def test_missing_lps_is_a_clear_error(sock_dir):
    t0 = time.monotonic()
    with pytest.raises(IpcError, match="not reachable within 1 s"):
        exchange(f"unix://{sock_dir}/none.sock", {"op": "exchange"}, None, connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_service_round_trip_and_validation(sock_dir, precision):
    spec = _spec()
    svc = LpsService(f"unix://{sock_dir}/r0.sock", spec, precision, reply_timeout_s=5.0)
    svc.start()
    try:
        assert oct(Path(svc.path).stat().st_mode & 0o777) == "0o600"  # only this user's bridge
        theta = torch.arange(spec.numel, dtype=torch.float32) / 7
        update = encode(-theta, spec, precision)
        svc.outbox.put((update, {"lps_version": 5, "sends": 2}, 0))
        reply, out = exchange(svc.address, {"op": "exchange", "stop": False, "global_version": 3},
                              encode(theta, spec, precision), connect_timeout_s=2, reply_timeout_s=5)
        got, stop, gv, _ = svc.inbox.get(timeout=1)
        expect = theta.to(torch.bfloat16).float() if precision == "bf16" else theta
        assert torch.equal(got, expect) and stop is False and gv == 3
        assert reply["lps_version"] == 5 and out is not None
        assert {k: bytes(a.data) for k, a in out.items()} == {k: bytes(a.data) for k, a in update.items()}

        # Invalid payloads are refused with the cause and never reach the inbox.
        bad = encode(theta, spec, "fp32" if precision == "bf16" else "bf16")
        with pytest.raises(IpcError, match="global model rejected"):
            exchange(svc.address, {"op": "exchange"}, bad, connect_timeout_s=2, reply_timeout_s=5)
        nan = theta.clone()
        nan[1] = float("nan")
        with pytest.raises(IpcError, match="non-finite|rejected"):
            exchange(svc.address, {"op": "exchange"}, encode(nan, spec, precision), connect_timeout_s=2)
        with pytest.raises(IpcError, match="stop without the global model"):
            exchange(svc.address, {"op": "exchange", "stop": True}, None, connect_timeout_s=2)
        with pytest.raises(IpcError, match="unknown op"):
            exchange(svc.address, {"op": "hello"}, None, connect_timeout_s=2)
        assert svc.inbox.empty() and svc.rejected == 4

        # No update in time: an error frame, not a hang.
        svc.reply_timeout_s = 0.5
        with pytest.raises(IpcError, match="no update within"):
            exchange(svc.address, {"op": "exchange"}, None, connect_timeout_s=2, reply_timeout_s=5)
        # A garbage connection does not kill the service.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(svc.path)
            s.sendall(b"GARBAGE-not-a-frame")
            s.shutdown(socket.SHUT_WR)
            header, _ = recv_frame(s)
            assert header["op"] == "error" and "malformed request" in header["error"]
        svc.outbox.put((update, {}, 0))
        assert exchange(svc.address, {"op": "exchange"}, None, connect_timeout_s=2)[1] is not None
    finally:
        svc.close()
    assert not Path(svc.path).exists()


def test_bridge_hears_when_the_lps_shuts_down(sock_dir):
    """A bridge waiting for an update gets an error at once when the regional run ends, not at
    its reply timeout."""
    svc = LpsService(f"unix://{sock_dir}/r1.sock", _spec(), "fp32", reply_timeout_s=60.0)
    svc.start()
    errors: list[str] = []

    def bridge() -> None:
        try:
            exchange(svc.address, {"op": "exchange"}, None, connect_timeout_s=2, reply_timeout_s=60)
        except IpcError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=bridge)
    t.start()
    deadline = time.monotonic() + 10
    while svc.exchanges == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    svc.close()
    t.join(timeout=10)
    assert time.monotonic() - t0 < 8 and errors and "shutting down" in errors[0]


def test_exchange_reply_timeout(sock_dir):
    path = sock_dir / "slow.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    conns: list[socket.socket] = []
    threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True).start()
    try:
        with pytest.raises(IpcError, match="no reply within"):
            exchange(f"unix://{path}", {"op": "exchange"}, None, connect_timeout_s=2, reply_timeout_s=0.5)
    finally:
        for c in conns:
            c.close()
        srv.close()


def test_frame_limits(sock_dir):
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, {"op": "result"}, encode(torch.ones(10), _spec(), "fp32"))
        with pytest.raises(IpcError, match="exceeds the limit"):
            recv_frame(b, max_payload_bytes=16)


# ---------------------------------------------------------------------------------------------
# Two-tier topology
# ---------------------------------------------------------------------------------------------


def _halos_base() -> dict[str, Any]:
    return yaml.safe_load(HALOS_LOOPBACK.read_text(encoding="utf-8"))


def test_shipped_halos_topology():
    topo = load_halos_topology(HALOS_LOOPBACK)
    assert [r for r, _ in topo.regions] == ["r0", "r1"] and topo.num_workers == 4
    bridges = topo.global_tier.nodes
    assert [b.node_config["region-id"] for b in bridges] == [0, 1]
    assert bridges[1].node_config["lps-address"] == topo.lps_address("r1") == "unix:///tmp/fl-geo-halos-loopback/r1.sock"
    assert 'lps-address="unix:///tmp/fl-geo-halos-loopback/r0.sock"' in bridges[0].node_config_arg()
    assert len({t.state_dir for t in topo.tiers}) == 3  # one pids.json per tier
    assert not any(t.security.tls for t in topo.tiers)
    # warm_apps: the platform's default on every tier, or the file's value on every tier
    assert {t.warm_apps for t in topo.tiers} == {warm_apps_supported()}
    cold = parse_halos_topology({**_halos_base(), "warm_apps": False}, HALOS_LOOPBACK.parent, "cold")
    assert not any(t.warm_apps for t in cold.tiers) and len(cold.tiers) == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["regions"][1].update(bridge_port=9302), "used twice"),
        (lambda d: d["regions"][1]["nodes"][0]["node_config"].update(region="r0"), "expected 'r1'"),
        (lambda d: d["regions"][1]["nodes"][0]["node_config"].update({"partition-id": 0}), "more than one worker"),
        (lambda d: d["regions"][1].update(name="r0"), "duplicate region"),
        (lambda d: d["regions"][0].pop("bridge_port"), "bridge_port"),
        (lambda d: d.update(ipc_dir="/tmp/" + "x" * 90), "too long"),
    ],
)
def test_halos_topology_errors(tmp_path, mutate, message):
    data = _halos_base()
    mutate(data)
    with pytest.raises(DeployError, match=message):
        parse_halos_topology(data, tmp_path, "h.yaml")


# ---------------------------------------------------------------------------------------------
# End to end on loopback
# ---------------------------------------------------------------------------------------------




@pytest.fixture
def halos_federation(tmp_path, sock_dir):
    """The two-tier loopback layout on free ports; always stopped, and checked that nothing survives."""
    data = _halos_base()
    ports = iter(free_ports(1 + 2 * 4))
    data["global"]["superlink"]["port"] = next(ports)
    for region in data["regions"]:
        region["superlink"]["port"] = next(ports)
        region["bridge_port"] = next(ports)
        for node in region["nodes"]:
            node["port"] = next(ports)
    data.update(name="halos-e2e", flwr_home=str(tmp_path / "flwr"), state_dir=str(tmp_path / "state"),
                ipc_dir=str(sock_dir))
    path = tmp_path / "halos.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    topo = load_halos_topology(path)
    try:
        yield topo, path
    finally:
        records = [r for t in topo.tiers for r in processes.load_records(t)]
        family = {r.pid for r in records} | processes._descendants(r.pid for r in records if r.alive())
        res = halos_down(topo, grace_s=5)
        assert not [p for r in res.values() for p in r.survivors], res
        alive = [pid for pid in family if processes._alive(pid)]
        assert not alive, f"processes left behind: {alive}"
        assert not any(t.pids_path.exists() for t in topo.tiers)
        assert not list(sock_dir.glob("*.sock"))


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow(seconds=116)
def test_e2e_halos_two_regions_two_workers(halos_federation, tmp_path, capsys):
    topo, path = halos_federation
    t0 = time.monotonic()
    assert cli.main(["deploy", "halos-up", str(path), "--timeout", "240"]) == 0
    up_s = time.monotonic() - t0
    res = run_halos(topo, "configs/halos.yaml", [*TINY_RUN, "run.rounds=4", "halos.accumulate=2",
                                                 "run.name=halos-e2e"],
                    out_dir=tmp_path / "runs", timeout_s=400, ipc_timeout_s=300, echo=False)
    g = res.summaries[topo.global_tier.name]
    print(f"\n[e2e halos] up {up_s:.1f} s, runs {res.wall_s:.1f} s (GPS {g and g['wall_s']} s, LPS "
          f"{[(res.summaries[t.name] or {}).get('wall_s') for _, t in topo.regions]} s)", file=sys.stderr)
    assert res.ok, (res.statuses, res.run_dirs)
    assert g is not None and g["role"] == "global"
    # GPS: 4 global updates, 2 from each LPS (K = 2 worker updates each)
    assert g["global_version"] == 4 and g["updates_per_region"] == {"r0": 2, "r1": 2}
    assert math.isfinite(g["final_val_loss"]) and g["final_val_loss"] < g["initial_val_loss"]
    for region, tier in topo.regions:
        s = res.summaries[tier.name]
        assert s is not None and s["role"] == "regional" and s["region"] == region, s
        assert s["workers"] == 2 and s["accumulate"] == 2
        assert s["sends"] == 2 and s["merges"] == 2, s  # both sends applied at the GPS, both replies merged
        assert s["local_updates"] >= 4 and s["lps_version"] == s["local_updates"]  # K per send, applied at the LPS
        assert s["exchanges"] == 3  # first pull, θ_g + continue, θ_g + stop
        assert math.isfinite(s["final_val_loss"])
        merges = [m for m in _metrics(res.run_dirs[tier.name]) if m.get("halos/merges", 0) > 0]
        assert [m["halos/merges"] for m in merges][:2] == [1.0, 2.0]
        assert g["lps_counters"][region]["sends"] == 2
    steps = [m for m in _metrics(res.run_dirs[topo.global_tier.name]) if m.get("halos/region") is not None]
    assert sorted(m["halos/region"] for m in steps) == [0, 0, 1, 1]
    if warm_apps_supported():  # one app server, the global tier's, forked every tier's app processes
        servers = {t.name: [r for r in processes.load_records(t) if r.role == "app-server"] for t in topo.tiers}
        assert [name for name, found in servers.items() if found] == [topo.global_tier.name], servers
        (server,) = servers[topo.global_tier.name]
        forked = Path(server.log).read_text(encoding="utf-8", errors="replace")
        assert forked.count("app server: flwr-serverapp pid ") == 3  # the global run and both regional runs
        nodes = sum(r.role == "supernode" for t in topo.tiers for r in processes.load_records(t))
        assert forked.count("app server: flower-superlink pid ") == 3  # every tier's SuperLink
        assert forked.count("app server: flower-supernode pid ") == nodes  # bridges' and workers' SuperNodes
        node_logs = [Path(r.log).read_text(encoding="utf-8", errors="replace")
                     for t in topo.tiers for r in processes.load_records(t) if r.role == "supernode"]
        received = sum(text.count("Receiving: ") for text in node_logs)
        replied = sum(text.count("Sending: ") for text in node_logs)
        # Every reply (bridges' and workers') came from a forked ClientApp, and none ran cold. A
        # message a node pulls as its run ends may never get a ClientApp (24 forks for 25
        # receptions happened once), so the receptions bound the forks only from above.
        assert "runs cold" not in forked
        assert replied <= forked.count("app server: flwr-clientapp pid ") <= received, (replied, received)


def test_a_frame_declaring_a_huge_payload_is_refused_before_reading(sock_dir):
    """Declared sizes are checked before anything that large is allocated or read: the sender
    sends only a header claiming 1 TB of arrays (no data follows), and the reader refuses it at
    once; the LPS service's limit is one fp32 model plus a .npy header per parameter."""
    from fl_geo.halos.ipc import MAGIC, payload_limit

    head = json.dumps({"op": "exchange", "arrays": [
        {"key": "w", "dtype": "float32", "shape": [3, 2], "stype": "numpy.ndarray", "nbytes": 10**12}]}).encode()
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5.0)  # without the check the reader would wait for the terabyte, then fail here
        a.sendall(MAGIC + len(head).to_bytes(4, "big") + head)
        with pytest.raises(IpcError, match="frame payload of 1000000000000 bytes exceeds the limit of 4136"):
            recv_frame(b, max_payload_bytes=payload_limit(10, 1))
    spec = _spec()
    svc = LpsService(f"unix://{sock_dir}/cap.sock", spec, "fp32", reply_timeout_s=5.0)
    assert svc.max_payload_bytes == 4 * 10 + 4096 * 2
    svc.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(svc.path)
            s.sendall(MAGIC + len(head).to_bytes(4, "big") + head)
            header, _ = recv_frame(s)
        assert header["op"] == "error" and "exceeds the limit of 8232" in header["error"]
        assert svc.inbox.empty() and svc.rejected == 1
    finally:
        svc.close()


def test_a_peer_trickling_bytes_cannot_hold_a_reader_or_the_service(sock_dir):
    """A socket timeout bounds one recv; a peer sending a byte every 50 ms never trips it. The
    frame's own deadline does: the reader gives up on time, and the LPS service (one connection
    at a time) answers the next bridge instead of waiting on the slow one for ever."""
    from fl_geo.halos.ipc import MAGIC

    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        data = MAGIC + (1000).to_bytes(4, "big") + b"{" * 1000
        for i in range(len(data)):
            if stop.is_set():
                return
            try:
                sock.sendall(data[i:i + 1])
            except OSError:
                return
            time.sleep(0.05)

    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.3)  # per recv: never reached while bytes keep coming
        t = threading.Thread(target=trickle, args=(a,), daemon=True)
        t.start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="frame not complete in time"):
            recv_frame(b, timeout_s=0.6)
        assert time.monotonic() - t0 < 1.5
        stop.set()
        t.join(timeout=5)

    spec = _spec()
    svc = LpsService(f"unix://{sock_dir}/slow.sock", spec, "fp32", reply_timeout_s=5.0, request_timeout_s=0.6)
    svc.start()
    stop.clear()
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        slow.connect(svc.path)
        t = threading.Thread(target=trickle, args=(slow,), daemon=True)
        t.start()
        time.sleep(0.1)  # the service is now reading the slow request
        svc.outbox.put((encode(torch.ones(spec.numel), spec, "fp32"), {}, 0))
        t0 = time.monotonic()
        reply, out = exchange(svc.address, {"op": "exchange"}, None, connect_timeout_s=2, reply_timeout_s=5)
        assert reply["op"] == "result" and out is not None
        assert time.monotonic() - t0 < 3.0  # served after the slow peer's 0.6 s, not after its 50 s
        assert svc.rejected == 1  # the slow request, answered with an error
    finally:
        stop.set()
        slow.close()
        svc.close()


def test_the_launcher_asks_flower_about_the_regions_a_third_as_often(tmp_path, monkeypatch):
    """Each status question is a `flwr ls` process; a failed region also fails the global run,
    so while all three run the regions are asked every 3 x status_every_s, the global run every
    status_every_s."""
    from types import SimpleNamespace

    from fl_geo.deploy import halos as launcher

    asked: dict[str, list[float]] = {"r0": [], "r1": [], "global": []}
    t0 = time.monotonic()
    finish_at = t0 + 1.3

    def status(tier, run_id):
        asked[tier.name].append(time.monotonic() - t0)
        return ("finished:completed", "") if time.monotonic() >= finish_at else ("running", "")

    monkeypatch.setattr(launcher, "run_status", status)
    plans = [(SimpleNamespace(name=n), tmp_path, rc, f"x-{n}")
             for n, rc in (("r0", {"region": "r0"}), ("r1", {"region": "r1"}), ("global", {"regions": 2}))]
    statuses = launcher._wait_for_runs(plans, {"r0": 1, "r1": 2, "global": 3}, tmp_path, set(), t0,
                                       timeout_s=30, status_every_s=0.2)
    assert statuses == dict.fromkeys(asked, "finished:completed")
    assert len(asked["global"]) >= 5, asked  # ~every 0.2 s until 1.3 s
    assert all(len(asked[r]) <= 3 for r in ("r0", "r1")), asked  # ~every 0.6 s
