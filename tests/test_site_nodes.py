"""A site that spans nodes (issue 29; docs/multidevice.md): node 0's site-group daemon hosts the
site's TCP store, node 1's agent (fl_geo.clients.site_node) starts its ranks there, and the four
ranks (a Hugging Face model sharded with FSDP2 across both nodes) train as one process with the
whole batch; a node without a live agent, or with the wrong
number of devices, fails the job at once with a message that says what to run.

Both "nodes" are this machine (localhost rendezvous): the agent is a separate process that is
neither the daemon's child nor shares its files, so rank 0's broadcast of the state and the jobs
through the store are what the test exercises, as across machines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fl_geo.clients.site_daemon import JobFailed, _Group
from fl_geo.clients.site_group import SiteGroup, _gone
from fl_geo.clients.site_node import SiteNodeAgent
from fl_geo.deploy.processes import free_ports
from fl_geo.errors import ConfigError
from fl_geo.inner.site_store import connect

REPO = Path(__file__).resolve().parents[1]
CPU2 = [torch.device("cpu")] * 2


@pytest.mark.slow(seconds=45)
def test_two_nodes_of_two_ranks_train_like_one_process_with_the_whole_batch(tiny, tmp_path) -> None:
    """Through the real train handler, 2 rounds: node 0's node config devices=2 nodes=2 site-group
    site-rendezvous and batch 2, node 1's agent with 2 CPU ranks, against one process with batch 8.
    The model is a Hugging Face preset (its own layer list) sharded with FSDP2 over the four ranks
    of both nodes: what each rank holds comes from rank 0's broadcast, a shard of what it received."""
    from fl_geo.clients.datacenter import OPT_STATE_KEY
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    rendezvous = f"127.0.0.1:{free_ports(1)[0]}"
    address = f"unix://{tmp_path}/site.sock"
    log = tmp_path / "node1.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log, "wb") as out:  # node 1's agent, started before node 0 is up: it waits for it
        agent = subprocess.Popen([sys.executable, "-m", "fl_geo.clients.site_node", "--rendezvous", rendezvous,
                                  "--node-rank", "1", "--devices", "cpu,cpu"],
                                 cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    common = ("run.num_clients=1", "run.rounds=2", "strategy.inner_steps=2", "run.eval_every=0", "run.threads_per_client=1",
              "model.kind=hf", "model.preset=smollm-tiny", "client.parallel=fsdp")  # one process: no ranks to shard over
    node0 = {"devices": 2, "nodes": 2, "device": "cpu", "site-group": address, "site-rendezvous": rendezvous}
    runs, info = {}, None
    try:
        for name, batch, node in (("one", 8, {}), ("two-nodes", 2, node0)):
            # the server's operator allows this site's 4 ranks in its token cap (docs/multidevice.md)
            cfg = tiny(*common, f"client.batch_size={batch}", f"strategy.site_devices={4 if node else 0}")
            grid = InlineGrid(client_app, 1, seed=0, node_configs=[{"partition-id": 0, "num-partitions": 1, **node}])
            summary = run_server(grid, cfg, tmp_path / name)
            (context,) = grid.contexts.values()
            runs[name] = (summary, torch.load(tmp_path / name / "final_model.pt")["params"],
                          context.state.array_records[OPT_STATE_KEY])
        info = SiteGroup(address, {}, CPU2, "gloo").hello()
        # One daemon and one generation served both rounds: each node's ranks were started once.
        assert info is not None and info["nodes"] == 2 and info["jobs"] == 2 and info["generation"] == 1
        text = log.read_text()
        assert text.count("started global ranks 2..3 of 4") == 1, text
        (s1, final1, opt1), (s2, final2, opt2) = runs["one"], runs["two-nodes"]
        assert s2["rejected"] == 0 and s1["tokens"] == s2["tokens"] == 2 * 2 * 8 * 32  # all 4 ranks' tokens
        # 4 ranks of 2 = 1 process of 8, to fp32 rounding: summation order differs (gradients reduced
        # over 4 shards); AdamW divides by sqrt(v), so an element whose gradient is tiny moves most
        # (measured: 7 of 115,008 parameters differ by 1e-6 to 5.2e-6, the rest by less)
        torch.testing.assert_close(final2, final1, rtol=0, atol=2e-5)
        assert list(opt2.keys()) and set(opt2.keys()) == set(opt1.keys())
        for key in opt1:
            torch.testing.assert_close(torch.from_numpy(opt2[key].numpy()), torch.from_numpy(opt1[key].numpy()),
                                       rtol=0, atol=1e-7, msg=key)
    finally:
        SiteGroup(address, {}, CPU2, "gloo").stop()
        agent.terminate()
        agent.wait(timeout=15)
    assert info is not None and all(_gone(pid) for pid in [info["pid"], *info["ranks"]])
    deadline = time.monotonic() + 10  # node 1's ranks die with their agent (PR_SET_PDEATHSIG)
    while "fl-geo-site-node1" in subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "node 1's ranks outlived their agent"
        time.sleep(0.2)


def test_a_job_fails_at_once_naming_the_nodes_without_a_live_agent(tmp_path, monkeypatch) -> None:
    """No rank processes: the daemon's group object and its store, an agent played by a store client."""
    rendezvous = f"127.0.0.1:{free_ports(1)[0]}"
    group = _Group({"devices": ["cpu", "cpu"], "backend": "gloo", "threads": 1, "timeout_s": 30.0, "nodes": 3,
                    "rendezvous": rendezvous}, str(tmp_path))
    group.gen_id = "g-1"
    with pytest.raises(JobFailed, match=r"nodes node 1 \(never joined\), node 2 \(never joined\) have no live "
                                        r"agent at 127\.0\.0\.1:\d+: run `fl-geo site-node --rendezvous 127\.0\.0\.1"):
        group._check_nodes(wait_s=0.0)
    client = connect(rendezvous, timeout_s=10)
    client.add("node/1/heartbeat", 1)
    client.add("node/2/heartbeat", 1)
    group._check_nodes(wait_s=0.0)  # both alive
    # Node 2's agent has one device where node 0 runs two ranks: it says so, the job says why.
    agent = SiteNodeAgent(rendezvous, 2, ["cpu"])
    client.set("g-1/setup", '{"world": 6, "local": 2, "nodes": 3, "backend": "gloo", "timeout_s": 30, "threads": 1}')
    agent._start_ranks(client, "g-1")
    assert agent.procs == []
    with pytest.raises(JobFailed, match="node 2 of the site: node 2 has 1 devices, node 0 runs 2 ranks"):
        group._check_nodes(wait_s=0.0)
    client.delete_key("node/2/error")
    # A rank of node 1 is killed mid-job: its agent reports it, and the job's account names it
    # before node 0's rank whose collective broke.
    agent = SiteNodeAgent(rendezvous, 1, ["cpu", "cpu"])
    agent.generation = "g-1"
    agent.procs = [SimpleNamespace(is_alive=lambda: True, exitcode=None),
                   SimpleNamespace(is_alive=lambda: False, exitcode=-signal.SIGKILL)]
    agent.report_dead_ranks(client)
    agent.report_dead_ranks(client)  # once
    assert agent.reported == {1}
    account = group._account(0, {"error": "RuntimeError: [gloo] Connection closed by peer"})
    assert account.splitlines()[0] == "node 1: rank 3 died: it was killed by SIGKILL", account
    assert "rank 0 of the site group failed:\nRuntimeError: [gloo] Connection closed by peer" in account
    with pytest.raises(JobFailed, match="node 1 of the site: rank 3 died: it was killed by SIGKILL"):
        group._check_nodes(wait_s=0.0)  # a job still waiting on node 1 fails at once too
    client.delete_key("node/1/error")
    import fl_geo.inner.site_store as site_store

    monkeypatch.setattr(site_store, "STALE_S", 0.0)  # every heartbeat is now too old: counters that stopped
    with pytest.raises(JobFailed, match=r"node 1 \(silent for 0 s\), node 2 \(silent for 0 s\)"):
        group._check_nodes(wait_s=0.0)


def test_several_nodes_need_a_rendezvous_address(tmp_path) -> None:
    for bad in ("", "node0", "node0:http", "node0:70000"):
        with pytest.raises(ConfigError, match="site of 2 nodes needs node config site-rendezvous"):
            SiteGroup(f"unix://{tmp_path}/s.sock", {}, CPU2, "gloo", nodes=2, rendezvous=bad)
    with pytest.raises(ValueError, match="--node-rank must be >= 1"):
        SiteNodeAgent("127.0.0.1:29400", 0, ["cpu"])
