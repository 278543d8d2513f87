"""run.ray_address / client_cpus / client_gpus: validation, the TCP preflight, Flower's backend
config, and one tiny run attached to a real local `ray start --head` (skipped without the CLI).

The cluster is started with its own --temp-dir so that its address file does not make other Ray
users on this machine (a plain ``ray.init()`` reads /tmp/ray/ray_current_cluster) join it, and it is
stopped by ending the process group the test started (``ray stop`` would stop every Ray of the user).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fl_geo.config import ConfigError, load_config
from fl_geo.deploy.processes import free_ports
from fl_geo.ray_cluster import backend_config, check_reachable, parse_host_port, resolve_auto
from fl_geo.simulation import preflight, run_simulation
from tests.conftest import tiny_config

# Starts Ray (and checks that none of its processes outlive a run): one at a time across `make test`'s workers.
pytestmark = pytest.mark.xdist_group("ray")


@pytest.mark.parametrize("address, expected", [("10.0.0.5:6379", ("10.0.0.5", 6379)),
                                               ("head.example:1", ("head.example", 1)),
                                               ("[::1]:6380", ("::1", 6380))])
def test_parse_host_port(address, expected):
    assert parse_host_port(address) == expected


@pytest.mark.parametrize("bad", ["head", "head:", ":6379", "head:0", "head:70000", "head:63a9",
                                 "ray://head:10001"])
def test_bad_address_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError, match="run.ray_address"):
        tiny_config("run.backend=ray", f"run.ray_address={bad}")


@pytest.mark.parametrize("override, field", [("run.client_cpus=0", "run.client_cpus"),
                                             ("run.client_gpus=-1", "run.client_gpus"),
                                             ("run.client_cpus=3", "run.client_cpus")])
def test_bad_resources_are_config_errors(override, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config("run.backend=ray", "run.sim_cpus=2", override)


def test_address_needs_the_ray_backend():
    with pytest.raises(ConfigError, match="run.backend=ray"):
        tiny_config("run.backend=inline", "run.ray_address=auto")


def test_backend_config_local_and_cluster():
    local = tiny_config("run.backend=ray", "run.sim_cpus=3", "run.client_cpus=1.5", "run.client_gpus=0.25")
    assert backend_config(local.run) == {
        "init_args": {"include_dashboard": False, "address": "local", "num_cpus": 3},
        "client_resources": {"num_cpus": 1.5, "num_gpus": 0.25},
    }
    cluster = tiny_config("run.backend=ray", "run.ray_address=10.1.2.3:6379", "run.client_cpus=4")
    cfg = backend_config(cluster.run)
    # ray.init refuses sizing arguments when it joins a running cluster: only the address goes
    assert cfg["init_args"] == {"include_dashboard": False, "address": "10.1.2.3:6379"}
    assert cfg["client_resources"] == {"num_cpus": 4, "num_gpus": 0.0}
    assert isinstance(cfg["client_resources"]["num_cpus"], int)
    # the defaults are what fl-geo always used: one CPU per actor, no GPU, sim_cpus local CPUs
    default = load_config(None, [])
    assert backend_config(default.run) == {
        "init_args": {"include_dashboard": False, "address": "local", "num_cpus": default.run.sim_cpus},
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    }


def test_probe_refused_port_is_one_line_before_flower():
    port = free_ports(1)[0]  # nothing listens there
    cfg = tiny_config("run.backend=ray", f"run.ray_address=127.0.0.1:{port}")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=f"run.ray_address=127.0.0.1:{port}: no Ray head answers"):
        preflight(cfg)
    assert time.perf_counter() - started < 5


def test_probe_silent_host_times_out(monkeypatch):
    def silent(addr, timeout):
        assert timeout == 0.2
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(ConfigError, match="timed out"):
        check_reachable("10.255.255.1:6379", timeout_s=0.2)


def test_probe_accepts_a_listening_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
    check_reachable("")  # a local Ray needs no probe


def test_auto_reads_env_then_the_address_file(monkeypatch, tmp_path):
    import fl_geo.ray_cluster as rc

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(rc, "RAY_CURRENT_CLUSTER", tmp_path / "ray_current_cluster")
    with pytest.raises(ConfigError, match="run.ray_address=auto: this machine has joined no Ray cluster"):
        resolve_auto()
    (tmp_path / "ray_current_cluster").write_text("10.0.0.9:6379\n")
    assert resolve_auto() == "10.0.0.9:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6380")
    assert resolve_auto() == "10.0.0.7:6380"


def test_local_client_gpus_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="run.client_gpus"):
        preflight(tiny_config("run.backend=ray", "run.client_gpus=0.5"))


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the Ray head did not open its port in time")


@pytest.fixture
def ray_head():
    """A 1-CPU Ray head (one actor: each costs ~11 CPU-s to start) on a free port, in its own
    process group and temp dir; ended in teardown."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray_cli is None:
        pytest.skip("the ray CLI is not installed")
    port, client_port, agent_port, agent_grpc, env_agent, metrics = free_ports(6)
    temp_dir = tempfile.mkdtemp(prefix="flgeo-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    proc = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--num-cpus", "1", "--num-gpus", "0",
         "--port", str(port), "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir,
         "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
         "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
         "--metrics-export-port", str(metrics), "--include-dashboard", "false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_ADDRESS": ""},
    )
    try:
        _wait_listening(port, proc, 60)
        yield f"127.0.0.1:{port}"
    finally:
        # everything `ray start --block` started shares its process group: end that group only
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=15)
                time.sleep(1)  # its children get the group signal too; give them a moment
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow(seconds=24)
def test_tiny_run_on_a_local_ray_cluster(ray_head, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = tiny_config("run.backend=ray", f"run.ray_address={ray_head}", "run.num_clients=2", "run.rounds=1",
                      "run.client_cpus=1", f"run.out_dir={tmp_path}")
    run_simulation(cfg, tmp_path / "run")
    metrics = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    last = json.loads(metrics[-1])
    assert last["step"] == 1 and last["outer/accepted"] == 2.0  # both clients ran on the cluster's actor
