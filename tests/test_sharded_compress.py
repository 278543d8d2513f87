"""The compressed uplink (wire.compress) on the sharded parameter server's data path.

A site compresses each update shard on its own (chunks restart at every shard) with one
model-sized error-feedback residual sliced by shard, and pushes each follower its shard's payload
(`fl_geo.clients.ps_transfer`, `fl_geo.ps.payload_frames`); the follower decodes and checks it
(`FollowerShard.push_payload`). Followers here are in-process gRPC servers; one end-to-end run
starts follower processes.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fl_geo.clients.persist import EF_RESIDUAL_KEY
from fl_geo.clients.ps_transfer import push_update
from fl_geo.clients.uplink import store_residual
from fl_geo.core.compress import Compressor, CompressSettings, compress_shards, payload_nbytes
from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.core.state import ParamSpec
from fl_geo.ps.client import FollowerClient
from fl_geo.ps.follower import FollowerShard
from fl_geo.ps.frames import DataPathError
from fl_geo.ps.server import FollowerServer
from fl_geo.runtime.wire_settings import settings_json
from fl_geo.timing.cost import CostModel

SETTINGS = CompressSettings(codec="topk", chunk=64, ratio=4 / 64, values="int2", block=16, error_feedback=True)  # k = 4


def _plan() -> ShardPlan:
    names = ("embed.weight", "blocks.0.w", "blocks.1.w", "norm.weight")
    shapes = ((30, 10), (250,), (199,), (10,))
    return ShardPlan.build(ParamSpec(names=names, shapes=shapes, dtypes=("float32",) * 4), 2)


def _hand_bytes(n: int) -> int:
    """topk k=4 of chunks of 64, uint8 indices, int2 values (4 a byte), one fp32 scale per 16 kept."""
    rows = math.ceil(n / 64)
    m = (rows - 1) * 4 + min(4, n - (rows - 1) * 64)
    return m + math.ceil(m / 4) + 4 * math.ceil(m / 16)


@pytest.fixture
def followers():
    """Two compressed followers of the plan behind in-process gRPC servers (no auth)."""
    plan = _plan()
    made = []
    for s in plan.shards:
        f = FollowerShard(plan, s.index, build_outer_optimizer("avg", s.numel), wire="fp32",
                          compressor=Compressor(SETTINGS))
        made.append((f, FollowerServer(f).start()))
    yield plan, [f for f, _ in made], [srv for _, srv in made]
    for _, srv in made:
        srv.stop(grace=0)


def _req(plan: ShardPlan, servers, job: str, settings: CompressSettings = SETTINGS) -> SimpleNamespace:
    return SimpleNamespace(
        wire_compress=settings_json(settings), send="pseudo_grad", wire_up="fp32", ps_job=job,
        ps_addresses=json.dumps([s.address for s in servers]),
        ps_shards=json.dumps([[s.begin, s.end] for s in plan.shards]), ps_push_order=json.dumps([1, 0]),
        ps_chunk_bytes=64, ps_retry_s=2.0, ps_tls_ca="", ps_token=None)


def _residual(state: RecordDict) -> torch.Tensor:
    return torch.from_numpy(state.array_records[EF_RESIDUAL_KEY]["residual"].numpy())


def test_compressed_push_round_trips_per_shard_with_ef(followers):
    plan, fs, servers = followers
    comp = Compressor(SETTINGS)
    n = plan.spec.numel
    bounds = [(s.begin, s.end) for s in plan.shards]
    g = torch.Generator().manual_seed(0)
    d1, d2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    state = RecordDict()

    sent = push_update(_req(plan, servers, "j1"), d1, state)
    # bytes: each shard's payload, by hand (64-byte frames: several per shard)
    assert sent == sum(_hand_bytes(e - b) for b, e in bounds) == sum(payload_nbytes(SETTINGS, e - b) for b, e in bounds)
    hat1 = torch.cat([comp.decompress(comp.compress(d1[b:e])[0], numel=e - b) for b, e in bounds])
    for f, (b, e) in zip(fs, bounds, strict=True):  # the unsharded codec on each shard, bit for bit
        assert f.has("j1") and torch.equal(f.pending["j1"].data, hat1[b:e])
    e1 = d1 - hat1  # residual recursion, per shard: e1 = Δ1 − Δ̂1
    assert torch.equal(_residual(state), e1)
    assert int((hat1 != 0).sum()) <= sum(math.ceil((e - b) / 64) * 4 for b, e in bounds)

    push_update(_req(plan, servers, "j2"), d2, state)
    hat2 = torch.cat([comp.decompress(comp.compress(d2[b:e], e1[b:e])[0], numel=e - b) for b, e in bounds])
    for f, (b, e) in zip(fs, bounds, strict=True):
        assert torch.equal(f.pending["j2"].data, hat2[b:e])
    assert torch.allclose(_residual(state), d2 + e1 - hat2, atol=1e-6)  # e2 = Δ2 + e1 − Δ̂2 (fp32 rounding)
    # one shard covering the model is the unsharded compressor, bit for bit
    whole, r = compress_shards(comp, d1, [(0, n)])
    ref, ref_r = comp.compress(d1)
    assert torch.equal(comp.decompress(whole[0], numel=n), comp.decompress(ref, numel=n)) and torch.equal(r, ref_r)


def _break(payload_arrays: dict[str, np.ndarray], how: str) -> dict[str, np.ndarray]:
    a = {k: v.copy() for k, v in payload_arrays.items()}
    if how == "index_out_of_range":
        a["indices"][-1] = 255  # past the last chunk (64 long, or shorter)
    elif how == "duplicate_index":
        a["indices"][1] = a["indices"][0]
    elif how == "nan_scale":
        a["scales"][0] = np.nan
    elif how == "truncated_codes":
        a["codes"] = a["codes"][:-1]
    elif how == "wrong_keys":
        a["values"] = a.pop("scales")
    return a


@pytest.mark.parametrize("how", ["index_out_of_range", "duplicate_index", "nan_scale", "truncated_codes",
                                 "wrong_keys"])
def test_a_hostile_payload_is_refused_with_the_shard_unchanged(followers, how):
    plan, fs, servers = followers
    f, s = fs[1], plan.shards[1]
    comp = Compressor(SETTINGS)
    payload, _ = comp.compress(torch.randn(s.numel, generator=torch.Generator().manual_seed(1)))
    bad = _break(payload.arrays(), how)
    hostile = SimpleNamespace(arrays=lambda: bad, nbytes=sum(v.nbytes for v in bad.values()))
    theta = f.params.clone()
    with FollowerClient(servers[1].address, retry_s=1.0) as client, \
            pytest.raises(DataPathError, match="INVALID_ARGUMENT"):
        client.push_payload("evil", 1, s.numel, hostile, chunk_bytes=64)
    assert not f.pending and torch.equal(f.params, theta)


def test_a_refused_push_fails_the_job_and_keeps_the_residual(followers):
    """Follower 0 holds other settings (k=8): the site's payload for it is refused, push_update
    raises (the job fails; the leader drops what the other follower got) and the residual is
    the one the job started from. An uncompressed push to a compressed follower is refused too."""
    plan, fs, servers = followers
    fs[0].compressor = Compressor(replace(SETTINGS, ratio=8 / 64))
    state = RecordDict()
    before = torch.randn(plan.spec.numel)
    store_residual(state, before)
    with pytest.raises(DataPathError, match="INVALID_ARGUMENT"):
        push_update(_req(plan, servers, "j"), torch.randn(plan.spec.numel), state)
    assert torch.equal(_residual(state), before) and not fs[0].pending
    with FollowerClient(servers[1].address, retry_s=1.0) as client, \
            pytest.raises(DataPathError, match="uncompressed shard"):
        client.push("plain", 1, torch.zeros(plan.shards[1].numel))


def test_the_clock_charges_each_shards_payload():
    plan = _plan()
    shares = tuple(s.numel for s in plan.shards)
    cost = CostModel(plan.spec.numel, uplink=SETTINGS, up_shards=shares)
    assert cost.charged_up_bytes("fp32") == sum(_hand_bytes(n) for n in shares)
    assert CostModel(plan.spec.numel, uplink=SETTINGS).charged_up_bytes("fp32") == _hand_bytes(plan.spec.numel)


VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "model.n_layers=3",
           "strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
           "penalty.clip=1.0", "penalty.warmup=2"]
TOPK_EF = ["wire.compress=topk", "wire.compress_ratio=0.05", "wire.compress_chunk=256", "wire.compress_values=int2",
           "wire.error_feedback=true"]


def _run(cfg, run_dir):
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    grid = InlineGrid(client_app, cfg.run.num_clients, seed=0)
    summary = run_server(grid, cfg, run_dir)
    return summary, torch.load(run_dir / "final_model.pt")["params"], grid


def test_in_process_followers_give_the_unsharded_compressed_run_and_learn(tiny, tmp_path):
    """ps.transport=local: the compressed reply comes in the Flower message, the leader decodes it
    and the followers fold the fp32 Δ̂: the bits of the single-server Di-PS with the same codec."""
    s2, sharded, _ = _run(tiny(*VIRTUAL, *TOPK_EF, "run.rounds=4", "ps.followers=2"), tmp_path / "f2")
    s0, unsharded, _ = _run(tiny(*VIRTUAL, *TOPK_EF, "run.rounds=4"), tmp_path / "f0")
    assert torch.equal(sharded, unsharded) and s2["virtual_s"] == s0["virtual_s"]
    assert s2["outer_steps"] == 4 and s2["rejected"] == 0
    per_update = payload_nbytes(CompressSettings(codec="topk", ratio=0.05, chunk=256, values="int2"),
                                s2["num_params"])
    assert s2["bytes_up"] == s2["accepted_updates"] * (per_update + 3 * 128)  # + the .npy headers


def test_in_process_followers_take_the_compressed_downlink_with_the_unsharded_bits(tiny, tmp_path):
    """wire.compress_down with ps.transport=local: the train message carries x̂'s deltas as in the
    single-server loop (the leader's θ buffer is the followers' shards), so F = 2 ends on the
    single-server run's bits, with deltas sent and counted (follower processes:
    tests/test_sharded_downlink.py)."""
    from fl_geo.runtime.metrics import read_metrics

    down = [*VIRTUAL, "wire.compress_down=int8", "run.rounds=4"]
    s2, sharded, _ = _run(tiny(*down, "ps.followers=2"), tmp_path / "f2")
    s0, unsharded, _ = _run(tiny(*down), tmp_path / "f0")
    assert torch.equal(sharded, unsharded) and s2["bytes_down"] == s0["bytes_down"]
    assert s2["outer_steps"] == 4 and s2["rejected"] == 0
    last, last0 = read_metrics(tmp_path / "f2")[-1], read_metrics(tmp_path / "f0")[-1]
    paths = ("comm/down_full", "comm/down_delta", "comm/down_same")
    assert [last[k] for k in paths] == [last0[k] for k in paths]  # the same messages as one server
    assert last["comm/down_full"] == 4 and last["comm/down_delta"] >= 1  # whole once per site, then deltas


def test_follower_processes_take_compressed_shards_and_learn(tiny, tmp_path):
    """ps.transport=grpc: each shard's payload goes to its follower process, which decodes it;
    the bytes counted are the shards' payloads, by hand, and the model learns."""
    from fl_geo.runtime.metrics import read_metrics

    run_dir = tmp_path / "grpc"
    s, final, grid = _run(tiny(*VIRTUAL, *TOPK_EF, "run.rounds=4", "ps.followers=2", "ps.transport=grpc",
                               "ps.checkpoint_keep=2"), run_dir)
    assert s["outer_steps"] == 4 and s["rejected"] == 0 and s["failed_jobs"] == 0
    plan = ShardPlan.from_json((run_dir / "ps" / "plan.json").read_text())
    settings = CompressSettings(codec="topk", ratio=0.05, chunk=256, values="int2")
    per_update = 0
    for sh in plan.shards:
        rows = math.ceil(sh.numel / 256)
        m = (rows - 1) * 13 + min(13, sh.numel - (rows - 1) * 256)  # k = round(0.05 * 256) = 13
        per_update += m + math.ceil(m / 4) + 4 * math.ceil(m / 128)  # uint8 indices, int2 codes, scales
        assert payload_nbytes(settings, sh.numel) == m + math.ceil(m / 4) + 4 * math.ceil(m / 128)
    assert s["bytes_up"] == s["accepted_updates"] * per_update
    # each site keeps one model-sized residual, not all zero after a compressed job
    res = [c.state.array_records[EF_RESIDUAL_KEY]["residual"].numpy() for c in grid.contexts.values()
           if EF_RESIDUAL_KEY in c.state.array_records]
    assert res and all(r.shape == (plan.spec.numel,) and np.abs(r).sum() > 0 for r in res)
    losses = [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert losses[-1] < losses[0] and torch.isfinite(final).all()
