"""The sharded parameter server's core: shard plans, per-tensor norms, follower folding and steps.

The property that matters: F followers fed the same updates, weights and clip factors hold
exactly the bits one follower (F = 1) would, and the norms the leader combines are F-independent.
"""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan, global_norm, sum_of_shard_norms, tensor_sq_sums
from fl_geo.core.state import ParamSpec
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.ps.follower import FollowerError, FollowerShard, assemble


def _spec() -> ParamSpec:
    model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, max_seq_len=16), seed=0)
    return ParamSpec.from_state_dict(dict(model.named_parameters()))


def _followers(plan: ShardPlan, theta: torch.Tensor, send: str = "pseudo_grad", wire: str = "bf16") -> list[FollowerShard]:
    out = []
    for s in plan.shards:
        opt = build_outer_optimizer("nesterov", s.numel, lr=0.7, momentum=0.8)
        out.append(FollowerShard(plan, s.index, opt, params=theta[s.begin:s.end].clone(), wire=wire, send=send))
    return out


def test_plan_is_contiguous_whole_layers_and_balanced() -> None:
    spec = _spec()
    for f in (1, 2, 3, 4, 6):
        plan = ShardPlan.build(spec, f)
        plan.validate()
        assert plan.num_shards == f
        assert plan.shards[0].begin == 0 and plan.shards[-1].end == spec.numel
        units = [u for s in plan.shards for u in s.units]
        assert len(units) == len(set(units))  # no layer split over two followers
        if f == 2:
            sizes = [s.numel for s in plan.shards]
            assert max(sizes) < 0.75 * spec.numel
    assert ShardPlan.from_json(ShardPlan.build(spec, 3).to_json()) == ShardPlan.build(spec, 3)


def test_plan_rejects_more_followers_than_layers_and_bad_json() -> None:
    spec = _spec()
    with pytest.raises(ValueError, match="only .* layers"):
        ShardPlan.build(spec, 100)
    with pytest.raises(ValueError, match=">= 1"):
        ShardPlan.build(spec, 0)
    bad = ShardPlan.build(spec, 2).to_json().replace('"shards": [[0,', '"shards": [[5,')
    with pytest.raises(ValueError):
        ShardPlan.from_json(bad)
    with pytest.raises(ValueError, match="malformed"):
        ShardPlan.from_json("{}")


def test_norms_do_not_depend_on_the_number_of_followers() -> None:
    spec = _spec()
    torch.manual_seed(0)
    delta = torch.randn(spec.numel)
    ref = None
    for f in (1, 2, 4):
        plan = ShardPlan.build(spec, f)
        per_shard = [tensor_sq_sums(delta[s.begin:s.end], plan.tensor_ranges(s.index)) for s in plan.shards]
        flat = [x for shard in per_shard for x in shard]
        if ref is None:
            ref = flat
        assert flat == ref  # bit-identical per-tensor sums
        assert global_norm(per_shard) == pytest.approx(float(delta.double().norm()), rel=1e-6)
        # Di-PS's literal G = sum of shard norms: the global norm for one follower, larger beyond
        assert sum_of_shard_norms(per_shard) >= global_norm(per_shard) * (1 - 1e-12)
        if f == 1:
            assert sum_of_shard_norms(per_shard) == global_norm(per_shard)


def _run_steps(f: int, send: str) -> torch.Tensor:
    spec = _spec()
    torch.manual_seed(1)
    theta = torch.randn(spec.numel)
    plan = ShardPlan.build(spec, f)
    fol = _followers(plan, theta, send=send)
    for step in range(3):
        weights = [(f"j{step}-{k}", 100.0 * (k + 1)) for k in range(3)]
        for job, _ in weights:
            upd = torch.randn(spec.numel).to(torch.bfloat16)
            for x in fol:
                x.push(job, upd[x.shard.begin:x.shard.end])
        for job, w in weights:
            for x in fol:
                x.norms(job)
                x.fold(job, w, rescale=0.5 if job.endswith("-2") else 1.0)
        total = sum(w for _, w in weights)
        sq = [x.mean_sq_sums(total) for x in fol]
        norm = global_norm(sq)
        factor = min(1.0, 1.0 / (norm + 1e-6))
        for x in fol:
            assert x.step(factor) == step + 1
            assert not x.pending
    return assemble(fol)


@pytest.mark.parametrize("send", ["pseudo_grad", "params"])
def test_one_two_four_followers_end_bit_identical(send: str) -> None:
    ref = _run_steps(1, send)
    for f in (2, 4):
        assert torch.equal(_run_steps(f, send), ref)


def test_fold_matches_the_formula() -> None:
    spec = _spec()
    plan = ShardPlan.build(spec, 1)
    theta = torch.randn(spec.numel)
    (x,) = _followers(plan, theta, send="params", wire="fp32")
    a, b = torch.randn(spec.numel), torch.randn(spec.numel)
    x.push("a", a)
    x.push("b", b)
    x.fold("a", 2.0)
    x.fold("b", 3.0, rescale=0.5)
    x.mean_sq_sums(4.0)
    expected = (0.5 * 2.0 * (theta - a) + 3.0 * (theta - b)) / 4.0
    assert torch.allclose(x._acc, expected, atol=1e-6)


def test_bad_requests_change_nothing() -> None:
    spec = _spec()
    plan = ShardPlan.build(spec, 2)
    theta = torch.randn(spec.numel)
    x = _followers(plan, theta)[0]
    before = x.params.clone()
    with pytest.raises(FollowerError, match="no push"):
        x.fold("nope", 1.0)
    buf = x.open_push("short")
    buf.write(0, torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(FollowerError, match="expected 10"):
        buf.write(20, torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(FollowerError, match="dtype"):
        buf.write(10, torch.zeros(10))
    with pytest.raises(FollowerError, match="overruns"):
        buf.write(10, torch.zeros(x.numel, dtype=torch.bfloat16))
    with pytest.raises(FollowerError, match="ended after 10"):
        x.close_push("short")
    assert not x.pending
    with pytest.raises(FollowerError, match="incomplete|no push"):
        x.norms("short")
    x.push("nan", torch.full((x.numel,), math.nan))
    assert all(math.isnan(s) for s in x.norms("nan"))  # the leader rejects; the follower keeps nothing
    x.drop("nan")
    with pytest.raises(FollowerError, match="finite"):
        x.fold("nan", math.inf)
    with pytest.raises(FollowerError, match="without a normalised sum"):
        x.step()
    assert torch.equal(x.params, before) and x.version == 0


def test_state_round_trip_and_validation(tmp_path) -> None:
    spec = _spec()
    plan = ShardPlan.build(spec, 2)
    theta = torch.randn(spec.numel)
    a, b = _followers(plan, theta)
    a.push("j", torch.randn(a.numel))
    a.fold("j", 1.0)
    a.mean_sq_sums(1.0)
    a.step()
    state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()}
    state["optimizer"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict()["optimizer"].items()}
    fresh = _followers(plan, theta)[0]
    fresh.load_state_dict(state)
    assert torch.equal(fresh.params, a.params) and fresh.version == 1
    assert torch.equal(fresh.optimizer.state_dict()["momentum_buffer"], a.optimizer.state_dict()["momentum_buffer"])
    with pytest.raises(FollowerError, match="shard 0"):
        b.load_state_dict(state)
    state["params"] = torch.full_like(state["params"], math.nan)
    with pytest.raises(FollowerError, match="NaN"):
        fresh.load_state_dict(state)
    assert fresh.version == 1


def test_penalty_norms_equal_the_sharded_norms_bit_for_bit() -> None:
    """`Penalty` cuts its groups at tensor starts, so the single-server norm (whole buffer, or
    per-tensor wire pieces) and the leader's combination of follower sums are the same bits."""
    from fl_geo.core.penalty import Penalty

    spec = _spec()
    torch.manual_seed(3)
    delta = torch.randn(spec.numel).to(torch.bfloat16)
    pen = Penalty(spec, granularity="global")
    whole = float(pen.norms(delta)[0])
    pieces = [(o, delta[o:o + n]) for o, n in zip(spec.offsets, spec.numels, strict=True)]
    assert float(pen.norms(list(reversed(pieces)))[0]) == whole  # any piece order
    for f in (1, 2, 4):
        plan = ShardPlan.build(spec, f)
        sums = [tensor_sq_sums(delta[s.begin:s.end], plan.tensor_ranges(s.index)) for s in plan.shards]
        assert global_norm(sums) == whole
