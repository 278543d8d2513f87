"""The compressed downlink (wire.compress_down) on the sharded parameter server's data path.

Each follower keeps its shard of the public model x̂ and advances it once per step
(`FollowerShard.read_public`); a site pulls each shard naming the version and lineage it holds and
rebuilds x̂ from the deltas (`fl_geo.clients.ps_downlink`); the leader only plans bytes and the
clock (`ShardedDownPlan`). Followers here are in-process gRPC servers; the end-to-end runs start
follower processes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fl_geo.clients.downlink import PUBLIC_KEY
from fl_geo.clients.ps_downlink import SHARD_VERSIONS_KEY, pull_public_model
from fl_geo.core.compress import Compressor, CompressSettings, payload_from_arrays, payload_nbytes
from fl_geo.core.downlink import PublicModel, apply_delta, max_chain, on_grid
from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.core.state import ParamSpec
from fl_geo.errors import PayloadError
from fl_geo.ps.client import FollowerClient
from fl_geo.ps.follower import FollowerError, FollowerShard, PublicPull
from fl_geo.ps.frames import DataPathError
from fl_geo.ps.server import FollowerServer
from fl_geo.runtime.wire_settings import settings_json
from fl_geo.strategies.downlink import ShardedDownPlan

INT8 = CompressSettings(codec="int8", block=16, error_feedback=False)
# the followers' codec here: int4 keeps 2 deltas of a shard against its bf16 size (int8 keeps 1)
INT4 = CompressSettings(codec="int4", block=16, error_feedback=False)


def _plan() -> ShardPlan:
    names = ("embed.weight", "blocks.0.w", "blocks.1.w", "norm.weight")
    shapes = ((30, 10), (250,), (199,), (10,))
    return ShardPlan.build(ParamSpec(names=names, shapes=shapes, dtypes=("float32",) * 4), 2)


def _follower(plan: ShardPlan, i: int, theta: torch.Tensor, wire_down: str = "bf16") -> FollowerShard:
    s = plan.shards[i]
    return FollowerShard(plan, i, build_outer_optimizer("avg", s.numel), params=theta[s.begin:s.end].clone(),
                         wire="fp32", down_compressor=Compressor(INT4), wire_down=wire_down)


def _step(f: FollowerShard, seed: int) -> None:
    """One outer step of f with a random Δ (plain averaging: θ ← θ − Δ)."""
    f.push(f"j{seed}", torch.randn(f.numel, generator=torch.Generator().manual_seed(seed)) * 0.1)
    f.norms(f"j{seed}")
    f.fold(f"j{seed}", 1.0)
    f.mean_sq_sums(1.0)
    f.step()


def test_a_follower_keeps_its_public_model_in_step_and_answers_by_rule():
    plan = _plan()
    theta = torch.randn(plan.spec.numel, generator=torch.Generator().manual_seed(0))
    f = _follower(plan, 1, theta)
    twin = PublicModel(Compressor(INT4), f.params, "bf16", f.numel * 2)  # what the rule says x̂_s is
    first = f.read_public(None)
    assert first.version == 0 and torch.equal(first.full, on_grid(f.params, "bf16"))
    seen = [first.full]
    for k in range(3):
        _step(f, k)
        twin.advance(f.params)
        assert f.public.version == f.version == k + 1 and torch.equal(f.public.params, twin.params)
        seen.append(f.read_public(None).full)
    assert torch.equal(seen[0], first.full)  # an answer is a snapshot: later steps do not touch it
    chain = f.read_public(1, f.lineage)
    assert chain.full is None and [d.version for d in chain.deltas] == [2, 3] and chain.held_from == 1
    x = seen[1]
    for d in chain.deltas:  # a site rebuilds x̂_s bit for bit from the chain
        x = apply_delta(x, Compressor(INT4).decompress(d.payload, numel=f.numel), "bf16")
    assert torch.equal(x, f.public.params)
    assert f.read_public(0, f.lineage).full is not None  # 3 deltas: more than int4 keeps of this shard
    assert f.read_public(3, f.lineage).deltas == () and f.read_public(3, f.lineage).full is None  # up to date
    for held, lineage in ((2, "another"), (2, None), (9, f.lineage), (-1, f.lineage)):
        answer = f.read_public(held, lineage)  # another lineage, nothing, or impossible: x̂_s whole
        assert answer.deltas == () and answer.version == 3 and torch.equal(answer.full, f.public.params)
    # a chain longer than the history (its bytes would pass one whole shard) goes whole
    depth = max_chain(payload_nbytes(INT4, f.numel), f.numel * 2)
    for k in range(depth + 1):
        _step(f, 10 + k)
    assert f.read_public(3, f.lineage).full is not None
    assert len(f.read_public(f.version - depth, f.lineage).deltas) == depth
    # no public model: refused
    plain = FollowerShard(plan, 0, build_outer_optimizer("avg", plan.shards[0].numel), wire="fp32")
    with pytest.raises(FollowerError, match="keeps no public model"):
        plain.read_public(None)


def test_a_site_of_an_older_lineage_is_sent_the_shard_whole_even_at_its_own_version():
    """A leader that resumed from an older step rewinds the followers, which then reach the
    version a site holds again with other values: the site's version names another lineage, so
    it is sent x̂_s whole, never told it is up to date or sent deltas against its stale copy."""
    plan = _plan()
    theta = torch.randn(plan.spec.numel, generator=torch.Generator().manual_seed(3))
    f = _follower(plan, 0, theta)
    _step(f, 0)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in f.state_dict().items()}
    _step(f, 1)
    _step(f, 2)
    site_version, site_lineage = f.version, f.lineage  # a site pulled version 3 of this lineage
    rewound = _follower(plan, 0, torch.zeros(plan.spec.numel))
    rewound.load_state_dict(saved)  # the rewind to step 1
    _step(rewound, 101)
    _step(rewound, 102)  # version 3 again, other values
    assert rewound.version == site_version and not torch.equal(rewound.public.params, f.public.params)
    answer = rewound.read_public(site_version, site_lineage)
    assert answer.full is not None and torch.equal(answer.full, rewound.public.params)
    assert rewound.read_public(1, site_lineage).full is not None  # no chain across lineages either
    assert rewound.read_public(site_version, rewound.lineage).deltas == ()  # its own lineage: up to date


def test_a_follower_checkpoint_keeps_its_public_model_and_a_bad_one_changes_nothing():
    plan = _plan()
    theta = torch.randn(plan.spec.numel, generator=torch.Generator().manual_seed(1))
    f = _follower(plan, 0, theta)
    _step(f, 0)
    _step(f, 1)
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in f.state_dict().items()}
    back = _follower(plan, 0, torch.zeros(plan.spec.numel))
    back.load_state_dict(state)
    assert back.version == 2 and torch.equal(back.public.params, f.public.params) and back.public.version == 2
    assert back.lineage != f.lineage  # a restart: sites holding x̂_s get it whole once
    # the supervisor's first checkpoint has no public model: x̂_s = g(θ_s) at its version
    fresh = _follower(plan, 0, torch.zeros(plan.spec.numel))
    fresh.load_state_dict({k: v for k, v in state.items() if k != "public"})
    assert torch.equal(fresh.public.params, on_grid(f.params, "bf16")) and fresh.public.version == 2
    for bad in ({**state["public"], "version": 1}, {**state["public"], "params": state["public"]["params"][:5]},
                {**state["public"], "params": torch.full_like(state["public"]["params"], float("nan"))}):
        target = _follower(plan, 0, torch.zeros(plan.spec.numel))
        before = (target.params.clone(), target.public.params.clone(), target.lineage)
        with pytest.raises(FollowerError, match="public model"):
            target.load_state_dict({**state, "public": bad})
        assert torch.equal(target.params, before[0]) and torch.equal(target.public.params, before[1])
        assert target.version == 0 and target.lineage == before[2]


@pytest.fixture
def served():
    """Two followers with an int8 public model behind in-process gRPC servers (no auth)."""
    plan = _plan()
    theta = torch.randn(plan.spec.numel, generator=torch.Generator().manual_seed(2))
    fs = [_follower(plan, i, theta) for i in range(plan.num_shards)]
    servers = [FollowerServer(f).start() for f in fs]
    yield plan, fs, servers
    for srv in servers:
        srv.stop(grace=0)


def _req(plan: ShardPlan, servers) -> SimpleNamespace:
    return SimpleNamespace(wire_compress_down=settings_json(INT4), wire_down="bf16", ps_retry_s=2.0,
                           ps_tls_ca="", ps_token=None, ps_addresses=json.dumps([s.address for s in servers]),
                           ps_shards=json.dumps([[s.begin, s.end] for s in plan.shards]))


def _pull(plan: ShardPlan, servers, state: RecordDict, received: list[int] | None = None) -> tuple[int, torch.Tensor]:
    out = torch.empty(plan.spec.numel)
    bounds = [(s.begin, s.end) for s in plan.shards]
    version, nbytes = pull_public_model(_req(plan, servers), out, state, [s.address for s in servers], bounds,
                                        lambda a: FollowerClient(a, retry_s=2.0), None)
    if received is not None:
        received.append(nbytes)
    return version, out


def test_a_site_pulls_whole_then_deltas_and_holds_the_followers_public_model(served):
    plan, fs, servers = served
    state = RecordDict()
    received: list[int] = []
    version, x = _pull(plan, servers, state, received)
    assert version == 0 and torch.equal(x, torch.cat([f.public.params for f in fs]))
    for k in range(2):
        for f in fs:
            _step(f, 20 + k)
    version, x = _pull(plan, servers, state, received)  # the chain of 2 deltas per shard, rebuilt bit for bit
    assert version == 2 and torch.equal(x, torch.cat([f.public.params for f in fs]))
    kept = state.config_records[SHARD_VERSIONS_KEY]
    assert list(kept["versions"]) == [2, 2] and list(kept["lineages"]) == [f.lineage for f in fs]
    assert torch.equal(torch.from_numpy(state.array_records[PUBLIC_KEY]["params"].numpy()), x)
    assert _pull(plan, servers, state, received)[0] == 2  # up to date: nothing new, the same copy
    # the bytes the site reports: each shard whole in bf16, then 2 int4 payloads per shard, then none
    assert received == [2 * plan.spec.numel, sum(2 * payload_nbytes(INT4, f.numel) for f in fs), 0]
    # the leader's pull still gets θ_s, and a site may not ask a follower without a public model
    with FollowerClient(servers[0].address) as c:
        assert torch.equal(c.pull(0, fs[0].numel, wire="fp32")[1], fs[0].params)
        with pytest.raises(DataPathError, match="whole shard"):
            c.pull_public(5, None, None, wire="bf16", delta_nbytes=1, max_deltas=1)
        with pytest.raises(DataPathError, match="wire.down bf16"):
            c.pull_public(fs[0].numel, None, None, wire="fp16", delta_nbytes=1, max_deltas=1)


@pytest.mark.parametrize("lie", ["nan_scale", "chain_from_elsewhere", "truncated", "unasked_delta", "other_lineage"])
def test_a_lying_follower_fails_the_pull_and_the_site_keeps_its_copy(served, monkeypatch, lie):
    plan, fs, servers = served
    state = RecordDict()
    _pull(plan, servers, state)
    for f in fs:
        _step(f, 30)
    if lie == "unasked_delta":  # the site holds nothing: a delta cannot answer it
        del state[SHARD_VERSIONS_KEY]
    kept = state.array_records[PUBLIC_KEY]["params"].numpy().copy()
    kept_versions = state.config_records.get(SHARD_VERSIONS_KEY)
    kept_versions = None if kept_versions is None else list(kept_versions["versions"])
    honest = fs[1].read_public

    def lying(held, lineage=None):
        answer = honest(0, fs[1].lineage)  # the honest chain from version 0
        d = answer.deltas[0]
        arrays = {k: v.copy() for k, v in d.payload.arrays().items()}
        if lie == "nan_scale":
            arrays[next(k for k in arrays if "scale" in k)][0] = np.nan
        elif lie == "truncated":
            big = max(arrays, key=lambda k: arrays[k].size)
            arrays[big] = arrays[big][:-1]
        elif lie == "chain_from_elsewhere":  # claims version 2 with one delta: from 1, not the site's 0
            return PublicPull(answer.version + 1, answer.lineage, answer.precision, None, answer.deltas)
        elif lie == "other_lineage":  # a chain, but of another lineage than the copy the site holds
            return PublicPull(answer.version, "another", answer.precision, None, answer.deltas)
        bad = type(d)(d.version, payload_from_arrays(INT4, fs[1].numel, arrays), d.nbytes)
        return PublicPull(answer.version, answer.lineage, answer.precision, None, (bad,))

    monkeypatch.setattr(fs[1], "read_public", lying)
    with pytest.raises((PayloadError, DataPathError)) as info:
        _pull(plan, servers, state)
    assert {"nan_scale": "scale", "chain_from_elsewhere": "answers a site holding 0",
            "truncated": "announces", "unasked_delta": "to a site holding lineage None",
            "other_lineage": "of lineage 'another'"}[lie] in str(info.value)
    assert np.array_equal(state.array_records[PUBLIC_KEY]["params"].numpy(), kept)
    now = state.config_records.get(SHARD_VERSIONS_KEY)
    assert (None if now is None else list(now["versions"])) == kept_versions


def test_the_leaders_plan_follows_the_followers_rule_by_hand():
    numels = [400, 1000]
    plan = ShardedDownPlan(INT8, numels, "bf16")
    b = [payload_nbytes(INT8, n) for n in numels]  # 1 byte per value + a 4-byte scale per 16
    assert b == [400 + 4 * 25, 1000 + 4 * 63]
    assert plan.depth == [max_chain(b[0], 800), max_chain(b[1], 2000)] == [1, 1]
    assert plan.message(7, 3)[1:] == ({"wire_compress_down": settings_json(INT8), "down_version": 3}, 2800, None)
    plan.pulled(7, 3)
    assert plan.message(7, 3)[2:] == (0, 0)  # up to date
    assert plan.message(7, 4)[2:] == (b[0] + b[1], 1)  # one delta per shard
    assert plan.message(7, 5)[2:] == (2800, None)  # two: more than a shard keeps
    plan.forget(7)
    assert plan.message(7, 5)[2:] == (2800, None)
    assert plan.metrics() == {"comm/down_full": 3.0, "comm/down_delta": 1.0, "comm/down_same": 1.0}


def test_follower_processes_send_the_compressed_downlink_with_the_unsharded_bits(tiny, tmp_path):
    """ps.transport=grpc with wire.compress_down=int8: one follower process ends on the bits of the
    single-server run with the same downlink (same virtual time and paths: x̂ advances with the same
    x), with fewer bytes down than the whole model each time. Two follower processes:
    tests/test_sharded_grpc.py (a follower killed after a step)."""
    from fl_geo.runtime.metrics import read_metrics
    from tests.test_sharded_compress import VIRTUAL, _run
    from tests.test_sharded_grpc import assert_sites_pulled_what_was_planned

    down = [*VIRTUAL, "wire.compress_down=int8", "run.rounds=4", "ps.checkpoint_keep=2"]
    s1, one, _ = _run(tiny(*down, "ps.followers=1", "ps.transport=grpc"), tmp_path / "f1")
    s0, unsharded, _ = _run(tiny(*down), tmp_path / "f0")
    assert torch.equal(one, unsharded) and s1["virtual_s"] == s0["virtual_s"]
    paths = ("comm/down_full", "comm/down_delta", "comm/down_same")
    last1, last0 = read_metrics(tmp_path / "f1")[-1], read_metrics(tmp_path / "f0")[-1]
    assert [last1[k] for k in paths] == [last0[k] for k in paths] and last1["comm/down_delta"] > 0
    whole = {"fp32": 4, "bf16": 2, "fp16": 2}[tiny(*down).wire.down] * s1["num_params"]
    assert s1["bytes_down"] < 0.8 * sum(last1[k] for k in paths) * whole  # against the model whole each time
    assert_sites_pulled_what_was_planned(read_metrics(tmp_path / "f1"))  # the leader's plan is what the sites got


def test_a_resumed_leader_rewinds_the_followers_and_no_site_keeps_a_stale_public_model(tiny, tmp_path):
    """The leader dies at its 11th reply and resumes from its step-2 checkpoint: the followers,
    already past step 2, restart from their step-2 checkpoints (x̂_s included) and run steps 3..
    again with other values, while the sites keep their copies (they outlive the leader). At the
    end every site's copy of every shard equals the follower's checkpointed x̂_s of the version the
    site holds. (Here every site pulls right after the resume, when the followers are behind what
    it holds, so it is sent x̂_s whole; the lineage rule that covers a site that pulls only later
    is the next test's.)"""
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.core.checkpoint import CheckpointStore
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server
    from tests.conftest import ServerCrash, crash_hook
    from tests.test_sharded_grpc import DIPS, VIRTUAL

    run_dir = tmp_path / "grpc"
    common = [*VIRTUAL, *DIPS, "run.rounds=6", "run.checkpoint_every=2", "ps.followers=2", "ps.transport=grpc",
              "ps.checkpoint_keep=8", "wire.compress_down=int8"]
    grid = InlineGrid(client_app, 4, seed=0)  # the sites outlive the leader
    grid.reply_hook = crash_hook(11)
    with pytest.raises(ServerCrash):
        run_server(grid, tiny(*common), run_dir)
    grid.reply_hook = None
    summary = run_server(grid, tiny(*common, "run.resume=true"), run_dir)
    assert summary["outer_steps"] == 6
    plan = ShardPlan.from_json((run_dir / "ps" / "plan.json").read_text())
    checked = 0
    for ctx in grid.contexts.values():
        kept = ctx.state.config_records[SHARD_VERSIONS_KEY]
        x = torch.from_numpy(ctx.state.array_records[PUBLIC_KEY]["params"].numpy())
        for sh, version in zip(plan.shards, kept["versions"], strict=True):
            public = CheckpointStore(run_dir / "ps" / f"follower-{sh.index}").load(int(version)).state["public"]
            assert torch.equal(x[sh.begin:sh.end], public["params"]), (sh.index, version)
            checked += 1
    assert checked == 4 * plan.num_shards
