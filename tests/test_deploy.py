"""fl-geo deploy: topology validation, Flower config writing, certificates, process ownership,
and end-to-end runs on loopback (a real SuperLink with two SuperNodes each).

The end-to-end tests are slow (each message starts a fresh ClientApp process that imports torch
and Flower, about 5 s of CPU, and an idle SuperNode polls every 3 s), so they use two sites (the
fewest that make averaging and a vanished site meaningful; the shipped three-site topology is
validated above), a 1-layer model, two outer steps and five inner steps: what they check is the
deployment path, not learning.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from fl_geo import cli
from fl_geo.deploy import (
    certificates,
    flower_config,
    launch,
    lifecycle,
    processes,
    topology,
    warm_apps,
)
from fl_geo.deploy.control import ControlUnavailable, query_nodes, query_run_status
from fl_geo.deploy.topology import DeployError, load_topology, parse_topology
from tests.conftest import down_and_assert_clean, free_ports, tiny_overrides

# SuperLink/SuperNode processes on free ports (the end-to-end runs share one federation, below): safe
# on every worker of `make test`.

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ROOT / "configs" / "deploy" / "loopback.yaml"
LOOPBACK_TLS = ROOT / "configs" / "deploy" / "loopback_tls.yaml"

# The smallest run that still exercises every message type (see tests/conftest.py TINY).
SITES = 2  # SuperNodes of the end-to-end federations (the shipped loopback topology has three)
TINY_RUN = tiny_overrides("strategy.inner_steps=5", f"run.num_clients={SITES}",
                          drop=("run.rounds", "run.backend", "run.sim_cpus", "strategy.inner_steps", "run.num_clients"))
TOKENS_PER_UPDATE = 5 * 4 * 32  # inner steps x batch x seq_len


def _base() -> dict[str, Any]:
    return yaml.safe_load(LOOPBACK.read_text(encoding="utf-8"))


def _sites(n: int = SITES) -> dict[str, Any]:
    """The shipped loopback topology cut to its first ``n`` sites (partitions 0..n-1 of n)."""
    data = _base()
    data["nodes"] = data["nodes"][:n]
    for node in data["nodes"]:
        node["node_config"]["num-partitions"] = n
    return data


def _topo(data: dict[str, Any], tmp_path: Path) -> topology.Topology:
    return parse_topology(data, tmp_path, "test.yaml")


# ---------------------------------------------------------------------------------------------
# Topology validation
# ---------------------------------------------------------------------------------------------


def test_shipped_topologies_validate():
    plain = load_topology(LOOPBACK)
    assert plain.name == "loopback" and plain.loopback
    assert not plain.security.tls and not plain.security.auth
    assert [n.node_config["partition-id"] for n in plain.nodes] == [0, 1, 2]
    assert {n.node_config["num-partitions"] for n in plain.nodes} == {3}
    assert plain.flwr_home == ROOT / ".flwr-deploy" / "loopback"  # inside the project, never ~/.flwr
    assert plain.pids_path == ROOT / ".flwr-deploy" / "loopback" / "state" / "pids.json"
    secure = load_topology(LOOPBACK_TLS)
    assert secure.security.tls and secure.security.auth
    ports = [secure.port, *(n.port for n in secure.nodes), plain.port, *(n.port for n in plain.nodes)]
    assert len(set(ports)) == len(ports)  # both can be up at once


def test_node_config_arg_quotes_strings_only(tmp_path):
    node = _topo(_base(), tmp_path).nodes[1]
    assert node.node_config_arg() == 'partition-id=1 num-partitions=3 site="dc1" region="us-east" device="cpu"'


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(superlnk={}), "superlnk"),
        (lambda d: d["security"].update(tsl=True), "tsl"),
        (lambda d: d["nodes"][0].update(prot=1), "prot"),
        (lambda d: d["nodes"][0]["node_config"].update(partition_id=0), "partition_id"),
        (lambda d: d["nodes"][1]["node_config"].pop("site"), "site"),
        (lambda d: d["nodes"][2].pop("port"), "port"),
        (lambda d: d["superlink"].pop("port"), "port"),
        (lambda d: d.pop("nodes"), "nodes"),
        (lambda d: d["nodes"][0].update(port=d["superlink"]["port"]), "used twice"),
        (lambda d: d["nodes"][1]["node_config"].update({"partition-id": 0}), "more than one node"),
        (lambda d: d["nodes"][0]["node_config"].update({"partition-id": 3}), "must be <"),
        (lambda d: d["nodes"][0]["node_config"].update(device="tpu"), "device"),
        (lambda d: d["nodes"][0]["node_config"].update(site='a"b'), "double quotes"),
        (lambda d: d["nodes"][0].update(name="dc1"), "duplicate node name"),
        (lambda d: d["security"].update(tls="yes"), "true or false"),
        (lambda d: d["security"].update(auth=True), "needs security.tls=true"),
        (lambda d: d["superlink"].update(port=70000), "1-65535"),
        (lambda d: d["superlink"].update(bind="0.0.0.0"), "superlink.bind"),  # plaintext on every interface
    ],
)
def test_topology_errors_name_the_key(tmp_path, mutate, message):
    data = _base()
    mutate(data)
    with pytest.raises(DeployError, match=message):
        _topo(data, tmp_path)


def _two_node_site(data: dict[str, Any]) -> dict[str, Any]:
    """Site dc0 as a cluster of three nodes of 2 CPU ranks: node 0's SuperNode, nodes 1 and 2 agents."""
    data["nodes"][0]["extra_node_config"] = {"devices": 2, "nodes": 3, "site-group": "unix:///tmp/dc0.sock",
                                             "site-rendezvous": "127.0.0.1:29400"}
    data["nodes"][0]["site_nodes"] = [{"devices": "cpu,cpu"}, {"devices": "cpu,cpu"}]
    return data


def test_a_site_of_several_nodes_gets_an_agent_per_other_node(tmp_path):
    from fl_geo.deploy.processes import site_node_command

    node = _topo(_two_node_site(_base()), tmp_path).nodes[0]
    assert [(s.node_rank, s.devices) for s in node.site_nodes] == [(1, "cpu,cpu"), (2, "cpu,cpu")]
    assert 'nodes=3' in node.node_config_arg() and 'site-rendezvous="127.0.0.1:29400"' in node.node_config_arg()
    cmd = site_node_command(node, node.site_nodes[1])
    assert cmd[1:] == ["-m", "fl_geo.clients.site_node", "--rendezvous", "127.0.0.1:29400", "--node-rank", "2",
                       "--devices", "cpu,cpu"]
    for mutate, message in [
        (lambda n: n["extra_node_config"].update(nodes=2), "2 other nodes, but extra_node_config nodes is 2"),
        (lambda n: n["extra_node_config"].pop("site-rendezvous"), "needs extra_node_config site-rendezvous"),
        (lambda n: n["site_nodes"][1].update(devices="cpu"), r"site_nodes\[1\].devices: 'cpu' is not 2 devices"),
        (lambda n: n["site_nodes"][0].update(rank=1), "rank"),
        (lambda n: n.update(site_nodes=[]), "non-empty list"),
    ]:
        data = _two_node_site(_base())
        mutate(data["nodes"][0])
        with pytest.raises(DeployError, match=message):
            _topo(data, tmp_path)


def test_remote_host_defaults_to_tls_and_auth_and_refuses_plaintext(tmp_path):
    data = _base()
    data["superlink"]["host"] = "10.1.2.3"
    del data["security"]
    topo = _topo(data, tmp_path)
    assert topo.security.tls and topo.security.auth and not topo.loopback
    assert "10.1.2.3" in topo.cert_hosts()

    data["security"] = {"tls": False}
    with pytest.raises(DeployError, match="not a loopback address"):
        _topo(data, tmp_path)
    data["security"] = {"tls": False, "allow_insecure_remote": True}
    assert not _topo(data, tmp_path).security.tls


def test_loopback_defaults_and_relative_paths(tmp_path):
    data = _base()
    for key in ("security", "flwr_home", "state_dir"):
        data.pop(key, None)
    topo = _topo(data, tmp_path)
    assert not topo.security.tls and not topo.security.auth  # a loopback demo may be plaintext
    assert topo.flwr_home == (tmp_path / ".flwr-deploy" / "loopback").resolve()
    assert topo.state_dir == topo.flwr_home / "state"
    assert topo.security.certs_dir == topo.flwr_home / "certs"


def test_load_topology_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(DeployError, match="not found"):
        load_topology(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n", encoding="utf-8")
    with pytest.raises(DeployError, match="not valid YAML"):
        load_topology(bad)


# ---------------------------------------------------------------------------------------------
# $FLWR_HOME/config.toml and the run config
# ---------------------------------------------------------------------------------------------


def test_write_flwr_config_adds_connections_and_keeps_others(tmp_path):
    data = _base()
    data["flwr_home"] = str(tmp_path / "home")
    plain = _topo(data, tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        "options.num-supernodes = 4\noptions.backend.init-args.num-cpus = 2\n",
        encoding="utf-8",
    )
    flower_config.write_flwr_config(plain)
    secure_data = copy.deepcopy(data)
    secure_data.update(name="secure", security={"tls": True, "auth": True, "certs_dir": str(tmp_path / "c")})
    flower_config.write_flwr_config(_topo(secure_data, tmp_path))
    flower_config.write_flwr_config(plain)  # rewriting is idempotent

    conf = tomllib.loads((home / "config.toml").read_text(encoding="utf-8"))["superlink"]
    assert conf["default"] == "local"
    assert conf["local"]["options"]["backend"]["init-args"]["num-cpus"] == 2
    assert conf["loopback"] == {"address": f"127.0.0.1:{plain.port}", "insecure": True}
    assert conf["secure"] == {"address": f"127.0.0.1:{plain.port}", "root-certificates": str(tmp_path / "c" / "ca.crt")}


def test_run_config_toml_survives_quotes_through_flower_parser(tmp_path):
    """Overrides with quotes go to `flwr run --run-config FILE.toml` (its k="v" form cannot escape)."""
    import shlex

    from flwr.common.config import parse_config_args

    overrides = ["data.corpus=files", 'data.files=[a.txt, "b c.txt"]', "run.name=x\\y"]
    path = tmp_path / "rc.toml"
    path.write_text(flower_config.dumps_toml({"config": "configs/diloco.yaml", "overrides": shlex.join(overrides)}),
                    encoding="utf-8")
    parsed = parse_config_args([str(path)])
    assert parsed["config"] == "configs/diloco.yaml"
    assert shlex.split(parsed["overrides"]) == overrides


# ---------------------------------------------------------------------------------------------
# Certificates and keys
# ---------------------------------------------------------------------------------------------


def _san(cert: Path) -> str:
    return subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
                          capture_output=True, text=True, check=True).stdout


def test_generate_certs_verifies_and_is_idempotent(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_ssh_private_key,
        load_ssh_public_key,
    )

    out = tmp_path / "certs"
    paths = certificates.generate_certs(out, ["127.0.0.1", "localhost", "link.example.org"], ["dc0", "dc1"])
    for f in (paths.ca_cert, paths.ca_key, paths.server_cert, paths.server_key, paths.public_keys):
        assert f.is_file(), f
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(paths.ca_cert), str(paths.server_cert)],
                            capture_output=True, text=True, check=False)
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stderr
    san = _san(paths.server_cert)
    assert "IP Address:127.0.0.1" in san and "DNS:localhost" in san and "DNS:link.example.org" in san
    assert oct(paths.server_key.stat().st_mode & 0o777) == "0o600"

    # The key format Flower 1.41 loads: OpenSSH, EC on a NIST curve (P-384).
    for node in ("dc0", "dc1"):
        key = load_ssh_private_key(paths.node_private_key(node).read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
        pub = load_ssh_public_key(paths.node_public_key(node).read_bytes())
        assert pub.public_numbers() == key.public_key().public_numbers()
    assert len(paths.public_keys.read_text().splitlines()) == 2

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    certificates.generate_certs(out, ["127.0.0.1", "localhost", "link.example.org"], ["dc0", "dc1"])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing re-issued

    # New hosts: a new server certificate from the same CA; node keys kept; a new node added.
    certificates.generate_certs(out, ["127.0.0.1", "10.0.0.5"], ["dc0", "dc1", "dc2"])
    assert paths.ca_cert.read_bytes() == before[paths.ca_cert]
    assert paths.node_private_key("dc0").read_bytes() == before[paths.node_private_key("dc0")]
    assert paths.server_cert.read_bytes() != before[paths.server_cert]
    assert "IP Address:10.0.0.5" in _san(paths.server_cert) and "localhost" not in _san(paths.server_cert)
    assert len(paths.public_keys.read_text().splitlines()) == 3


def test_missing_openssl_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("OPENSSL", raising=False)
    with pytest.raises(DeployError, match="openssl not found"):
        certificates.generate_certs(tmp_path / "c")


def test_cli_certs_and_errors(tmp_path, capsys):
    assert cli.main(["deploy", "certs", "--out", str(tmp_path / "c"), "--nodes", "a,b"]) == 0
    assert (tmp_path / "c" / "supernodes" / "b.key").is_file()
    bad = tmp_path / "t.yaml"
    bad.write_text(yaml.safe_dump({**_base(), "colour": "red"}), encoding="utf-8")
    assert cli.main(["deploy", "up", str(bad)]) == 1
    assert "colour" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Process ownership (no Flower involved: fast)
# ---------------------------------------------------------------------------------------------

# A parent that starts a child in a *new session* (as flower-superlink starts flower-superexec)
# and a grandchild that ignores SIGTERM: down() must still stop all three. The grandchild touches
# a file once its handler is set, so the test cannot signal it before.
_SPAWNER = """
import subprocess, sys, time
ready = sys.argv[1]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c",
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1] + '-' + str(os.getpid()), 'w').close(); time.sleep(120)", ready])
time.sleep(120)
"""


def test_down_stops_groups_and_detached_descendants_and_is_idempotent(tmp_path):
    data = _base()
    data.update(flwr_home=str(tmp_path / "home"))
    topo = _topo(data, tmp_path)
    procs = [processes.start_process(topo, "supernode", f"n{i}", [sys.executable, "-c", _SPAWNER, str(tmp_path / f"ready{i}")])[0]
             for i in range(2)]
    deadline = time.monotonic() + 30
    while (len(processes._descendants(p.pid for p in procs)) < 4 or len(list(tmp_path.glob("ready*"))) < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    family = {p.pid for p in procs} | processes._descendants(p.pid for p in procs)
    assert len(family) == 6
    assert [r.name for r in processes.load_records(topo)] == ["n0", "n1"]

    res = lifecycle.down(topo, grace_s=1.0)
    assert set(res.signalled) == family and not res.survivors
    assert res.killed  # the SIGTERM-ignoring grandchildren needed SIGKILL
    assert not any(processes._alive(pid) for pid in family)
    assert not topo.pids_path.exists()
    assert lifecycle.down(topo).signalled == []  # twice is fine


class _FakeFlower:
    """Stands in for `flwr ls`: counts the status checks and reports the run finished after ``after_s``."""

    def __init__(self, monkeypatch, after_s: float, state: str = "finished:completed"):
        self.calls: list[float] = []
        self.t0 = time.monotonic()
        self.after_s, self.state = after_s, state
        monkeypatch.setattr(launch, "run_status", self)

    def __call__(self, topo, run_id):
        self.calls.append(time.monotonic() - self.t0)
        return (self.state, "") if self.calls[-1] >= self.after_s else ("running", "")


def test_wait_for_run_asks_flower_rarely_and_at_once_when_the_summary_appears(tmp_path, monkeypatch):
    """Each status check is a `flwr ls` process (~1.5 s of CPU): without a sign from the run it is
    asked every status_every_s; once the hint is true, every second until it reports the end."""
    topo = _topo(_base(), tmp_path)
    flower = _FakeFlower(monkeypatch, after_s=1.2)
    state, _ = launch.wait_for_run(topo, 7, timeout_s=10, status_every_s=0.5, tick_s=0.05)
    assert state == "finished:completed" and 2 <= len(flower.calls) <= 3, flower.calls  # ~0.5, 1.0, 1.5 s
    assert all(b - a >= 0.45 for a, b in zip([0.0, *flower.calls], flower.calls, strict=False)), flower.calls

    flower = _FakeFlower(monkeypatch, after_s=1.5)
    hint_at = time.monotonic() + 0.3
    state, _ = launch.wait_for_run(topo, 7, lambda: time.monotonic() >= hint_at, timeout_s=10,
                                   status_every_s=60, tick_s=0.05)
    assert state == "finished:completed"
    assert 0.95 < flower.calls[0] < 1.5 and len(flower.calls) == 2, flower.calls  # hinted: each second
    assert flower.calls[1] - flower.calls[0] >= 0.95, flower.calls

    flower = _FakeFlower(monkeypatch, after_s=99)
    t0 = time.monotonic()
    state, details = launch.wait_for_run(topo, 7, timeout_s=0.3, status_every_s=60, tick_s=0.05)
    assert state == "timeout" and "0 s" in details and flower.calls == [] and time.monotonic() - t0 < 1.0


def test_summary_written_sees_only_a_new_run_directory_with_a_summary(tmp_path):
    old = tmp_path / "e2e-1"
    (old).mkdir()
    (old / "summary.json").write_text("{}")
    check = launch.summary_written(tmp_path, "e2e", {old.resolve()})
    assert not check()  # the summary of an earlier run does not count
    new = tmp_path / "e2e-2"
    new.mkdir()
    assert not check()
    (new / "summary.json").write_text("{}")
    assert check()
    assert not launch.summary_written(tmp_path, "other", set())()


def test_up_reads_activation_only_from_the_nodes_latest_start(tmp_path):
    """`up` asks the SuperLink for its node list once every SuperNode has logged its activation
    since it was (re)started: a line from an earlier start in the same log does not count."""
    log = tmp_path / "supernode-dc0.log"
    assert not lifecycle._logged_since_start(log, lifecycle.NODE_ACTIVATED)  # no log yet
    log.write_text(f"\n==== 10:00 flower-supernode\nINFO: {lifecycle.NODE_ACTIVATED} 42\n"
                   "\n==== 10:05 flower-supernode\nINFO: Starting Flower SuperNode\n")
    assert not lifecycle._logged_since_start(log, lifecycle.NODE_ACTIVATED)
    log.write_text(log.read_text() + f"INFO: {lifecycle.NODE_ACTIVATED} 43\n")
    assert lifecycle._logged_since_start(log, lifecycle.NODE_ACTIVATED)


def test_down_ignores_a_recorded_pid_that_was_reused(tmp_path):
    data = _base()
    data.update(flwr_home=str(tmp_path / "home"))
    topo = _topo(data, tmp_path)
    me = os.getpid()
    rec = processes.ProcRecord("superlink", "x", me, me, (processes._start_ticks(me) or 0) + 1, "log")
    processes._save_records(topo, [rec])
    assert not rec.alive()
    assert lifecycle.down(topo).signalled == []  # never signals a process it did not start
    assert not topo.pids_path.exists()


# ---------------------------------------------------------------------------------------------
# End to end on loopback
# ---------------------------------------------------------------------------------------------




def _start_federation(tmp: Path, tls: bool, started: list[topology.Topology],
                      via_cli: bool = False) -> tuple[topology.Topology, Path]:
    """Start a loopback topology (plain or TLS + auth, two sites) on free ports in ``tmp``; the
    topology goes into ``started`` before anything starts, so a failed start is stopped too."""
    data = _sites()
    ports = free_ports(1 + len(data["nodes"]))
    data["name"] = "e2e-tls" if tls else "e2e"
    data["superlink"]["port"] = ports[0]
    for node, port in zip(data["nodes"], ports[1:], strict=True):
        node["port"] = port
    data["flwr_home"] = str(tmp / "flwr")
    data["state_dir"] = str(tmp / "state")
    data["security"] = {"tls": tls, "auth": tls, "certs_dir": str(tmp / "certs")}
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    topo = load_topology(path)
    started.append(topo)
    if via_cli:
        assert cli.main(["deploy", "up", str(path), "--timeout", "180"]) == 0
    else:
        lifecycle.up(topo, timeout_s=180)
    return topo, path


# The end-to-end runs share one TLS + SuperNode-auth federation, started through `fl-geo deploy up`
# (each federation costs ~20 s of CPU to start: a SuperLink, two SuperNodes, three SuperExecs). Runs
# on one SuperLink are independent Flower runs with their own run ids, so no test sees another's;
# message counts are read as differences. The group keeps the tests on one xdist worker, where the
# module fixture lives. Plaintext SuperNodes run end to end in tests/test_deploy_faults.py.
SHARED = pytest.mark.xdist_group("e2e-shared")


@pytest.fixture(scope="module")
def shared_federation(tmp_path_factory):
    """The shared TLS + auth two-site federation; stopped (and checked clean) after the module,
    also when a test failed: no recorded process, nor anything it spawned, may survive."""
    started: list[topology.Topology] = []
    try:
        yield _start_federation(tmp_path_factory.mktemp("e2e-shared"), True, started, via_cli=True)
    finally:
        for topo in started:
            down_and_assert_clean(topo)


def _received(log: str, kind: str = "train") -> int:
    return Path(log).read_text(encoding="utf-8", errors="replace").count(f"Receiving: {kind} message")


def _forked(topo: topology.Topology) -> dict[str, int]:
    """How many processes of each Flower app command the topology's app server has forked so far."""
    (rec,) = [r for r in processes.load_records(topo) if r.role == "app-server"]
    text = Path(rec.log).read_text(encoding="utf-8", errors="replace")
    return {c: text.count(f"app server: {c} pid ") for c in warm_apps.APP_COMMANDS}


def _replied(topo: topology.Topology) -> int:
    """The replies the topology's SuperNodes have sent so far (every one came from a ClientApp)."""
    return sum(Path(r.log).read_text(encoding="utf-8", errors="replace").count("Sending: ")
               for r in processes.load_records(topo) if r.role == "supernode")


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _received_by_node(topo: topology.Topology) -> dict[str, tuple[int, int]]:
    """(train, query) messages each SuperNode of ``topo`` has logged so far."""
    return {r.name: (_received(r.log), _received(r.log, "query"))
            for r in processes.load_records(topo) if r.role == "supernode"}


@SHARED
@pytest.mark.slow(seconds=144)
def test_e2e_sharded_dips_data_path_beside_flower(shared_federation, tmp_path, capsys):
    """Di-PS with two follower processes (ps.transport=grpc) across a SuperLink and two
    SuperNodes, all through the fl-geo CLI (`deploy status`, `deploy run`): the ServerApp leads,
    clients pull and push shards on the data path (plaintext loopback beside Flower's TLS)."""
    topo, path = shared_federation
    assert cli.main(["deploy", "status", str(path)]) == 0
    shown = capsys.readouterr().out
    # the app server, the SuperLink and the SuperNodes
    assert shown.count("alive") == 2 + SITES and shown.count(": online") == SITES and "app-server" in shown
    before = _received_by_node(topo)  # the shared federation may have run the other test's run
    out = tmp_path / "runs"
    rc = cli.main(["deploy", "run", str(path), "configs/dips_sharded.yaml", *TINY_RUN, "run.rounds=2", "run.clock=wall",
                   "strategy.grace_s=2", "run.name=e2e-sharded", "--out", str(out), "--timeout", "300"])
    assert rc == 0, capsys.readouterr().err
    (run_dir,) = out.glob("e2e-sharded-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "dips" and summary["outer_steps"] == 2 and summary["rejected"] == 0
    assert math.isfinite(summary["final_val_loss"])
    steps = [m for m in _metrics(run_dir) if m.get("step", 0) > 0]
    assert sum(m["outer/accepted"] for m in steps) >= 2
    for i in range(2):  # each follower checkpointed its shard after both steps, then was stopped
        assert (run_dir / "ps" / f"follower-{i}" / "ckpt-00000002.pt").is_file()
        assert "launching follower" in (run_dir / "ps" / f"follower-{i}.log").read_text()
    after = _received_by_node(topo)
    for name, (train, query) in after.items():  # every site was profiled once and trained
        assert train > before[name][0] and query - before[name][1] == 1, (name, before, after)


@SHARED
@pytest.mark.slow(seconds=97)
def test_e2e_fedbuff_with_tls_and_supernode_auth(shared_federation, tmp_path):
    """Asynchronous FedBuff with TLS and SuperNode authentication; an unregistered node is refused."""
    topo, _ = shared_federation
    conf = tomllib.loads((topo.flwr_home / "config.toml").read_text())["superlink"][topo.name]
    assert "insecure" not in conf and conf["root-certificates"] == str(topo.certs.ca_cert)
    (link,) = [r for r in processes.load_records(topo) if r.role == "superlink"]
    assert "--enable-supernode-auth" in link.cmd and "--insecure" not in link.cmd
    plaintext = dataclasses.replace(topo, security=dataclasses.replace(topo.security, tls=False, auth=False))
    assert not processes.health_ok(plaintext)  # no plaintext on this port

    # An intruder with a valid TLS trust root but an unregistered key is refused at activation.
    key, pub = tmp_path / "intruder.key", tmp_path / "intruder.pub"
    certificates.generate_node_key(certificates._openssl(), key, pub, "intruder")
    intruder = topology.NodeSpec("intruder", free_ports(1)[0], dict(topo.nodes[0].node_config))
    # recorded apart (its own state folder), so the shared federation's records stay its own
    apart = dataclasses.replace(topo, state_dir=tmp_path / "intruder-state")
    proc, rec = processes.start_process(apart, "supernode", "intruder", processes.supernode_command(topo, intruder, key))
    assert proc.wait(timeout=60) != 0
    assert "Failed to activate SuperNode" in Path(rec.log).read_text()
    assert len([n for n in processes.list_nodes(topo) if n.get("status") == "online"]) == SITES

    before, forked_before, replied_before = _received_by_node(topo), _forked(topo), _replied(topo)
    res = launch.run_experiment(topo, "configs/fedbuff.yaml", [*TINY_RUN, "run.rounds=2", "run.name=e2e-fedbuff"],
                                out_dir=tmp_path / "runs", timeout_s=300, echo=False)
    assert res.ok, (res.status, res.details)
    assert res.run_dir is not None and res.run_dir.parent == tmp_path / "runs"
    s = res.summary
    assert s is not None and s["strategy"] == "fedbuff" and s["outer_steps"] == 2
    assert s["tokens"] == 2 * 2 * TOKENS_PER_UPDATE  # buffer_size 2 per outer step
    assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] > 0
    after = _received_by_node(topo)
    assert len(after) == SITES
    for name, (train, query) in after.items():  # the asynchronous loop profiled and dispatched to every site
        assert train > before[name][0] and query - before[name][1] == 1, (name, before, after)
    # Every message of the run ran in an app process forked by the topology's app server (warm_apps):
    # one ServerApp, and a ClientApp for every reply a SuperNode sent (a message a node pulls as
    # the run ends may get none, so its receptions bound the forks only from above: the HALoS e2e
    # once forked 24 ClientApps for 25); the SuperLink, the SuperNodes and their SuperExecs (one
    # per SuperNode and the SuperLink's) were forked by it when the federation came up (the
    # intruder above was started cold, by its own command).
    forked = {k: v - forked_before[k] for k, v in _forked(topo).items()}
    messages = sum(t + q - before[name][0] - before[name][1] for name, (t, q) in after.items())
    replied = _replied(topo) - replied_before
    assert replied >= SITES + 4  # a profile query per site and the 4 updates the 2 steps folded
    assert forked["flwr-serverapp"] == 1 and replied <= forked["flwr-clientapp"] <= messages, (forked, replied, messages)
    assert forked["flwr"] >= 1  # the submission, at least
    since_up = _forked(topo)
    assert (since_up["flower-superexec"], since_up["flower-superlink"], since_up["flower-supernode"]) == (1 + SITES, 1, SITES)
    # The launcher asked Flower's Control API in-process (fl_geo.deploy.control): over TLS its
    # answers are the CLI's, word for word.
    shown = processes._json_out(processes.flwr_cli(topo, ["ls", topo.name, "--run-id", str(res.run_id),
                                                          "--format", "json"]))["runs"][0]
    assert query_run_status(topo, res.run_id) == (shown["status"], shown["status-details"]) == ("finished:completed",
                                                                                                shown["status-details"])
    listed = processes._json_out(processes.flwr_cli(topo, ["supernode", "ls", topo.name, "--format", "json"]))
    assert query_nodes(topo) == [{k: n[k] for k in ("node-id", "owner-name", "status")} for n in listed["nodes"]]
    print(f"\n[e2e fedbuff tls+auth] run {res.wall_s:.1f} s, ServerApp {s['wall_s']:.1f} s", file=sys.stderr)


def test_the_cli_answers_when_the_control_api_cannot_be_asked_here(tmp_path, monkeypatch):
    """Without an in-process answer (another Flower, a refused call) the run status and the
    node table come from the ``flwr`` CLI, as before: nothing is lost, only CPU."""
    import fl_geo.deploy.control as control

    def unavailable(topo):
        raise ControlUnavailable("no client here")

    asked: list[list[str]] = []

    def cli(topo, args, timeout_s=60.0):
        asked.append(list(args))
        out = ('{"success": true, "runs": [{"status": "finished:failed", "status-details": "boom"}]}' if args[0] == "ls"
               else '{"success": true, "nodes": [{"node-id": "7", "owner-name": "none", "status": "online"}]}')
        return subprocess.CompletedProcess(["flwr", *args], 0, stdout="banner\n" + out, stderr="")

    from flwr.proto.control_pb2 import ListNodesRequest

    data = _base()
    data["superlink"]["port"] = free_ports(1)[0]  # nothing listens there
    topo = _topo(data, tmp_path)
    with pytest.raises(ControlUnavailable, match="Control API ListNodes failed"):
        control._call(topo, "ListNodes", ListNodesRequest())  # refused: an answer for the CLI, not a raw error
    monkeypatch.setattr(control, "_client", unavailable)
    monkeypatch.setattr(launch, "flwr_cli", cli)
    monkeypatch.setattr(processes, "flwr_cli", cli)
    assert launch.run_status(topo, 7) == ("finished:failed", "boom")
    assert processes.list_nodes(topo) == [{"node-id": "7", "owner-name": "none", "status": "online"}]
    assert [a[:2] for a in asked] == [["ls", topo.name], ["supernode", "ls"]]


def test_a_status_query_that_times_out_is_unknown_not_fatal(tmp_path, monkeypatch):
    """A loaded host once took over 60 s to answer ``flwr ls``; the launcher asks again later
    instead of abandoning the run with a raw TimeoutExpired."""
    def slow(topo, args, timeout_s=60.0):
        raise subprocess.TimeoutExpired(["flwr", *args], timeout_s)

    monkeypatch.setattr(launch, "flwr_cli", slow)
    state, why = launch.run_status(_topo(_base(), tmp_path), 7)
    assert state == "unknown" and "did not answer within 60 s" in why
