"""Pseudo-gradient penalty (docs/algorithms.md §4) against hand-computed values of its formulas."""

from __future__ import annotations

import io
import math

import pytest
import torch

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.groups import clip_, group_norms, module_group_name, module_groups, restrict
from fl_geo.core.penalty import Penalty
from fl_geo.core.state import CHUNK_ELEMS, ParamSpec
from fl_geo.core.statistics import EmaStats, OutlierTest
from fl_geo.core.weights import StreamingWeights, compute_weights
from fl_geo.inner.model import ModelConfig, build_model


def _spec(*sizes: tuple[str, int]) -> ParamSpec:
    return ParamSpec(tuple(n for n, _ in sizes), tuple((k,) for _, k in sizes),
                     ("float32",) * len(sizes))


# A toy model with the real naming scheme: groups embed, blocks.0, blocks.1, norm.
TOY = _spec(("embed.weight", 6), ("blocks.0.w", 4), ("blocks.0.b", 2), ("blocks.1.w", 5),
            ("norm.weight", 3))


def _warm(penalty: Penalty, node: str, steps: int, base: float = 1.0, seed: int = 0) -> None:
    """Commit ``steps`` ordinary updates of ``node`` (norms base·(1 ± 5 %)) one step each."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        norms = base * (1 + 0.05 * (2 * torch.rand(penalty.num_groups, generator=gen,
                                                   dtype=torch.float64) - 1))
        v = penalty.observe(node, norms, tokens=100)
        assert bool(v.accepted.all())
        penalty.commit()


# ---------------------------------------------------------------------------------------------
# Groups and norms


def test_module_groups_of_the_real_model() -> None:
    model = build_model(ModelConfig(n_layers=2), 0)
    spec = ParamSpec.from_state_dict(model.state_dict())
    groups = module_groups(spec, "module")
    assert [name for name, _ in groups] == ["embed", "blocks.0", "blocks.1", "norm"]
    # One contiguous range each, tiling the buffer in order.
    ranges = [r for _, rs in groups for r in rs]
    assert all(len(rs) == 1 for _, rs in groups)
    assert ranges[0][0] == 0 and ranges[-1][1] == spec.numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert module_groups(spec, "global") == [("model", [(0, spec.numel)])]


def test_module_group_name_rule() -> None:
    assert module_group_name("blocks.3.attn.wq.weight") == "blocks.3"
    assert module_group_name("layers.12.mlp.w1") == "layers.12"
    assert module_group_name("h.0.ln_1.bias") == "h.0"
    assert module_group_name("embed.weight") == "embed"
    assert module_group_name("blocks.attn.weight") == "blocks"  # no index: first component
    assert module_group_name("bias") == "bias"
    # Interleaved prefixes give several ranges, contiguous ones merge.
    spec = _spec(("a.x", 2), ("b.x", 3), ("a.y", 1), ("a.z", 4))
    assert module_groups(spec, "module") == [("a", [(0, 2), (5, 10)]), ("b", [(2, 5)])]
    with pytest.raises(ValueError, match="granularity"):
        module_groups(spec, "layer")


def test_group_norms_flat_pieces_and_bf16_agree_with_hand_values() -> None:
    groups = module_groups(TOY, "module")
    flat = torch.arange(1.0, TOY.numel + 1)  # 1..20
    # embed 1..6, blocks.0 7..12, blocks.1 13..17, norm 18..20
    expected = torch.tensor([sum(i * i for i in r) ** 0.5 for r in
                             (range(1, 7), range(7, 13), range(13, 18), range(18, 21))],
                            dtype=torch.float64)
    torch.testing.assert_close(group_norms(flat, groups), expected, rtol=1e-12, atol=0)
    pieces = [(o, flat[o:o + n].to(torch.bfloat16)) for o, n in
              zip(TOY.offsets, TOY.numels, strict=True)][::-1]  # any order, small ints exact
    torch.testing.assert_close(group_norms(pieces, groups), expected, rtol=1e-12, atol=0)


def test_group_norms_across_chunks_and_non_finite() -> None:
    n = CHUNK_ELEMS + 1000
    spec = _spec(("embed.weight", n), ("norm.weight", 10))
    groups = module_groups(spec, "module")
    flat = torch.full((spec.numel,), 0.5)
    got = group_norms(flat.to(torch.bfloat16), groups)
    torch.testing.assert_close(got, torch.tensor([0.5 * n ** 0.5, 0.5 * 10 ** 0.5],
                                                 dtype=torch.float64), rtol=1e-6, atol=0)
    flat[n + 3] = math.inf
    got = group_norms(flat, groups)
    assert math.isfinite(got[0]) and got[1] == math.inf
    flat[5] = math.nan
    assert math.isnan(group_norms(flat, groups)[0])


def test_restrict_cuts_pieces_to_ranges() -> None:
    flat = torch.arange(20.0)
    pieces = [(0, flat[:7]), (7, flat[7:20])]
    out = restrict(pieces, [(5, 9), (15, 17)])
    assert [(o, t.tolist()) for o, t in out] == [(5, [5.0, 6.0]), (7, [7.0, 8.0]),
                                                 (15, [15.0, 16.0])]


# ---------------------------------------------------------------------------------------------
# EMA statistics


def test_ema_recursion_matches_hand_values() -> None:
    stats = EmaStats(1, alpha=0.5, warmup=3)
    for g in (1.0, 2.0, 4.0):
        stats.update("a", [g], [True])
    # μ: 1 → 0.5·2 + 0.5·1 = 1.5 → 0.5·4 + 0.5·1.5 = 2.75
    # σ: 0 → sqrt(0.5·0 + 0.5·(2 − 1.5)²) = sqrt(0.125) → sqrt(0.5·0.125 + 0.5·(4 − 2.75)²)
    assert stats.mean("a").item() == pytest.approx(2.75, abs=1e-15)
    assert stats.std("a").item() == pytest.approx(math.sqrt(0.84375), abs=1e-15)
    assert stats.observations("a").tolist() == [3]
    assert stats.zscores("a", [5.0]).item() == pytest.approx(2.25 / math.sqrt(0.84375))


def test_ema_default_alpha_first_observation_and_masking() -> None:
    stats = EmaStats(2, warmup=0)
    stats.update("a", [3.0, 7.0], [True, False])
    assert stats.mean("a").tolist() == [3.0, 0.0] and stats.std("a").tolist() == [0.0, 0.0]
    assert stats.observations("a").tolist() == [1, 0]
    stats.update("a", [5.0, math.inf], [True, True])  # a non-finite norm never enters
    mu = 0.02 * 5 + 0.98 * 3
    assert stats.mean("a")[0].item() == pytest.approx(mu, abs=1e-15)
    assert stats.std("a")[0].item() == pytest.approx(math.sqrt(0.02 * (5 - mu) ** 2), abs=1e-15)
    assert stats.observations("a").tolist() == [2, 0]


def test_zscore_is_zero_during_warmup_and_while_sigma_is_zero() -> None:
    stats = EmaStats(1, alpha=0.5, warmup=4)
    for g in (1.0, 1.0, 2.0):
        stats.update("a", [g], [True])
    assert stats.zscores("a", [1e6]).item() == 0.0  # 3 < 4 observations
    stats.update("a", [1.0], [True])
    assert stats.zscores("a", [1e6]).item() > 0.0
    flat = EmaStats(1, alpha=0.5, warmup=1)
    for _ in range(5):
        flat.update("a", [2.0], [True])  # σ stays 0: no spread, no score
    assert flat.zscores("a", [1e6]).item() == 0.0
    assert stats.zscores("new", [1e6]).item() == 0.0  # a new key starts its own warm-up
    assert math.isnan(stats.zscores("a", [math.nan]).item())


# ---------------------------------------------------------------------------------------------
# Outlier tests


def test_zscore_rejects_a_scaled_update_after_warmup_and_accepts_normal_ones() -> None:
    penalty = Penalty(TOY, warmup=10)
    _warm(penalty, "a", 12)
    normal = penalty.observe("a", torch.full((1,), 1.01), tokens=100)
    spike = penalty.observe("a", torch.full((1,), 100.0), tokens=100)
    assert bool(normal.accepted.all()) and abs(normal.z.item()) < 3
    assert not bool(spike.accepted.any()) and spike.z.item() > 3
    assert spike.weights.item() == 0.0
    report = penalty.commit()
    assert [(r.node, r.groups) for r in report.rejections] == [("a", ("model",))]
    assert report.rejections[0].z[0] == pytest.approx(spike.z.item())


def test_relative_max_empty_history_floor_and_bound() -> None:
    test = OutlierTest(1, rule="relative_max", threshold=3.0, window=3)
    assert test.accept("k", torch.tensor([1e9])).item()  # E empty: accept
    test.update("k", torch.tensor([0.2]), torch.tensor([True]))
    # max(E) = 0.2 < 1: the floor makes the bound 3·1, not 0.6.
    assert test.bounds("k").item() == 3.0
    assert test.accept("k", torch.tensor([2.9])).item()
    assert not test.accept("k", torch.tensor([3.1])).item()
    test.update("k", torch.tensor([1.5]), torch.tensor([True]))
    test.update("k", torch.tensor([-4.0]), torch.tensor([True]))
    assert test.bounds("k").item() == 4.5  # 3·max(0.2, 1.5, −4)
    assert test.accept("k", torch.tensor([4.4])).item()
    assert not test.accept("k", torch.tensor([4.6])).item()
    test.update("k", torch.tensor([9.0]), torch.tensor([False]))  # not accepted: not pushed
    test.update("k", torch.tensor([0.5]), torch.tensor([True]))  # window 3: 0.2 drops out
    assert test.scores().tolist() == [[1.5, -4.0, 0.5]]
    assert not test.accept("k", torch.tensor([math.nan])).item()


def test_adaptive_threshold_uses_std_of_recent_zscores() -> None:
    test = OutlierTest(1, rule="zscore", threshold=3.0, adaptive_threshold=True, history=4)
    assert test.bounds("k").item() == 3.0
    for z in (1.0, 1.2):  # std 0.14 < 1: the factor stays 1
        test.update("k", torch.tensor([z]), torch.tensor([True]))
    assert test.bounds("k").item() == 3.0
    test = OutlierTest(1, rule="zscore", threshold=3.0, adaptive_threshold=True, history=4)
    for z in (9.0, 0.0, 2.0, 4.0, 6.0):  # window of 4: 9 drops out
        test.update("k", torch.tensor([z]), torch.tensor([True]))
    std = math.sqrt((9 + 1 + 1 + 9) / 3)  # sample std of 0, 2, 4, 6
    assert test.bounds("k").item() == pytest.approx(3 * std)
    assert test.accept("k", torch.tensor([7.7])).item()
    assert not test.accept("k", torch.tensor([7.8])).item()
    assert test.bounds("other").item() == 3.0  # windows are per key
    with pytest.raises(ValueError, match="zscore"):
        OutlierTest(1, rule="relative_max", adaptive_threshold=True)


def test_relative_max_penalty_accepts_first_scored_then_bounds() -> None:
    penalty = Penalty(TOY, rule="relative_max", warmup=5, weighting="uniform")
    _warm(penalty, "a", 5)  # exactly the warm-up: every score so far was z := 0, E is empty
    assert penalty.test.scores().isnan().all()
    first = penalty.observe("a", [50.0])
    assert first.scored.item() and first.accepted.item()  # E was empty
    penalty.commit()
    assert penalty.test.scores()[0, -1].item() == pytest.approx(first.z.item())


# ---------------------------------------------------------------------------------------------
# Weights


def test_token_and_staleness_weights_and_their_product() -> None:
    acc = torch.tensor([[True], [True], [True], [False]])
    norms = torch.tensor([[1.0], [2.0], [3.0], [99.0]], dtype=torch.float64)
    w = compute_weights(norms, acc, "tokens", tokens=[1000, 3000, 6000, 5000])
    torch.testing.assert_close(w.flatten(), torch.tensor([0.1, 0.3, 0.6, 0.0],
                                                         dtype=torch.float64))
    w = compute_weights(norms, acc, "staleness", staleness=[0, 3, 8, 0])  # 1, 1/2, 1/3
    torch.testing.assert_close(w.flatten(), torch.tensor([6 / 11, 3 / 11, 2 / 11, 0.0],
                                                         dtype=torch.float64))
    w = compute_weights(norms, acc, ["tokens", "staleness"], tokens=[1, 2, 3, 4],
                        staleness=[0, 3, 8, 0])  # 1·1, 2·1/2, 3·1/3: uniform after renorm
    torch.testing.assert_close(w.flatten(), torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0],
                                                         dtype=torch.float64))
    w = compute_weights(norms, acc, "uniform")
    torch.testing.assert_close(w.flatten(), torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0],
                                                         dtype=torch.float64))


def test_norm_softmax_is_log_space_stable() -> None:
    acc = torch.ones(3, 1, dtype=torch.bool)
    e = torch.tensor([math.exp(-1), math.exp(-2), math.exp(-3)], dtype=torch.float64)
    expected = e / e.sum()
    w = compute_weights(torch.tensor([[1.0], [2.0], [3.0]]), acc, "norm_softmax")
    torch.testing.assert_close(w.flatten(), expected)
    # Norms of 1e4 at T = 1: exp underflows to 0/0 naively; the log-sum-exp gives the same
    # weights as the shifted norms 1, 2, 3.
    big = torch.tensor([[1e4 + 1], [1e4 + 2], [1e4 + 3]], dtype=torch.float64)
    torch.testing.assert_close(compute_weights(big, acc, "norm_softmax").flatten(), expected)
    # T = 10 and 'auto' (T = mean accepted norm = 2).
    w = compute_weights(torch.tensor([[1.0], [2.0], [3.0]]), acc, "norm_softmax",
                        temperature=10.0)
    e10 = torch.exp(-torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    torch.testing.assert_close(w.flatten(), e10 / e10.sum())
    w = compute_weights(torch.tensor([[1.0], [2.0], [3.0]]), acc, "norm_softmax",
                        temperature="auto")
    e2 = torch.exp(-torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64))
    torch.testing.assert_close(w.flatten(), e2 / e2.sum())
    none = compute_weights(big, torch.zeros(3, 1, dtype=torch.bool), "norm_softmax")
    assert none.abs().sum().item() == 0.0  # all rejected: zeros, not NaN


def test_streaming_weights_rebase_and_equal_batch_weights() -> None:
    norms = [1e4, 1e4 - 50, 1e4 + 5, 1e4 - 49, 1e4 + 200]
    sw = StreamingWeights(1, ["norm_softmax"], temperature=1.0)
    folded = []  # the running sum of weights as a caller would hold it
    for g in norms:
        w, r = sw.push([g], torch.tensor([True]))
        folded = [x * r.item() for x in folded] + [w.item()]
        assert 0.0 <= w.item() <= math.exp(30)
    assert sum(folded) == pytest.approx(sw.total.item(), rel=1e-12)
    streamed = torch.tensor(folded, dtype=torch.float64) / sw.total
    batch = compute_weights(torch.tensor(norms, dtype=torch.float64)[:, None],
                            torch.ones(5, 1, dtype=torch.bool), "norm_softmax").flatten()
    torch.testing.assert_close(streamed, batch, rtol=1e-12, atol=1e-30)  # exp(-250) -> 0
    assert folded[0] < 1e-20 and folded[-1] == 0.0  # exp(−50) after the rebase; negligible


def test_streaming_fold_equals_the_weighted_mean() -> None:
    """observe → fold_ → normalise_ gives Σ w_i·Δ_i / Σ w_i per module (module granularity)."""
    gen = torch.Generator().manual_seed(3)
    penalty = Penalty(TOY, granularity="module", weighting=["tokens", "norm_softmax"],
                      temperature=0.5)
    updates = [torch.randn(TOY.numel, generator=gen) * s for s in (1.0, 3.0, 0.3)]
    tokens = [100, 300, 50]
    acc = WeightedAccumulator(TOY.numel)
    norms = []
    for i, (u, t) in enumerate(zip(updates, tokens, strict=True)):
        pieces = [(o, u[o:o + n]) for o, n in zip(TOY.offsets, TOY.numels, strict=True)]
        g = penalty.norms(pieces)
        norms.append(g)
        v = penalty.observe(f"n{i}", g, tokens=t)
        penalty.fold_(acc, pieces, v)
    penalty.normalise_(acc.buffer)
    w = penalty.finalize_weights()  # [3, 4]
    expected = torch.empty(TOY.numel)
    for gi, (_, ranges) in enumerate(penalty.groups):
        logits = torch.stack([math.log(t) - n[gi] / 0.5 for t, n in
                              zip(tokens, norms, strict=True)])
        torch.testing.assert_close(w[:, gi], torch.softmax(logits, 0))
        for b, e in ranges:
            expected[b:e] = sum(float(w[i, gi]) * updates[i][b:e] for i in range(3))
    torch.testing.assert_close(acc.buffer, expected, rtol=1e-5, atol=1e-6)


def test_streaming_fold_with_a_rescale_of_the_running_sum() -> None:
    """Global norm_softmax at a small T: the second update's factor is e^(~90) relative to the
    first, so the reference moves and the running sum is rescaled once (never overflowing)."""
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(TOY.numel, generator=gen), torch.randn(TOY.numel, generator=gen)
    x, y = 10 * x / x.norm(), y / y.norm()  # norms 10 and 1
    penalty = Penalty(TOY, weighting="norm_softmax", temperature=0.1)
    acc = WeightedAccumulator(TOY.numel)
    for node, u in (("a", x), ("b", y)):
        v = penalty.observe(node, penalty.norms(u))
        penalty.fold_(acc, u, v)
    assert v.rescale.item() < 1e-30 and v.weights.item() == 1.0
    penalty.normalise_(acc.buffer)
    w = torch.softmax(torch.tensor([-100.0, -10.0], dtype=torch.float64), 0)
    torch.testing.assert_close(acc.buffer, (w[0] * x.double() + w[1] * y.double()).float())


def test_auto_temperature_uses_previous_step_mean_and_first_norm_at_start() -> None:
    penalty = Penalty(TOY, weighting="norm_softmax", temperature="auto")
    penalty.observe("a", [4.0])
    penalty.observe("b", [8.0])
    report = penalty.commit()
    assert report.temperature.tolist() == [4.0]  # first step: the first accepted norm
    penalty.observe("a", [1.0])
    penalty.observe("b", [2.0])
    torch.testing.assert_close(penalty.finalize_weights().flatten(),
                               torch.softmax(torch.tensor([-1 / 6, -2 / 6],
                                                          dtype=torch.float64), 0))
    assert penalty.commit().temperature.tolist() == [6.0]  # mean of step 1


# ---------------------------------------------------------------------------------------------
# Clip and rollback


def test_clip_global_and_per_module() -> None:
    u = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    f = clip_(u, [("model", [(0, 4)])], phi=1.0, eps=1e-6)
    assert f.item() == pytest.approx(1 / (5 + 1e-6), rel=1e-12)
    torch.testing.assert_close(u, torch.tensor([3.0, 4.0, 0.0, 0.0]) / (5 + 1e-6))
    small = torch.tensor([0.3, 0.4, 0.0, 0.0])
    before = small.clone()
    assert clip_(small, [("model", [(0, 4)])], phi=1.0).item() == 1.0
    assert torch.equal(small, before)  # not clipped: untouched bit for bit
    penalty = Penalty(_spec(("a.w", 2), ("b.w", 2)), granularity="module", clip=10.0)
    v = torch.tensor([30.0, 40.0, 3.0, 4.0])  # a: norm 50 → ×10/50; b: norm 5 → kept
    factors = penalty.clip_(v)
    torch.testing.assert_close(factors, torch.tensor([10 / (50 + 1e-6), 1.0],
                                                     dtype=torch.float64))
    torch.testing.assert_close(v, torch.tensor([30 * 10 / (50 + 1e-6), 40 * 10 / (50 + 1e-6),
                                                3.0, 4.0]))
    assert Penalty(TOY).clip_(torch.ones(TOY.numel)).tolist() == [1.0]  # clip off


def test_rollback_when_every_update_of_a_module_is_rejected() -> None:
    penalty = Penalty(TOY, granularity="module", warmup=5, weighting="uniform")
    for step in range(7):
        for node in ("a", "b"):
            penalty.observe(node, torch.full((4,), 1.0 + 0.01 * ((step + len(node)) % 3)))
        penalty.commit()
    spiked = torch.tensor([1.0, 100.0, 1.0, 1.0])  # blocks.0 explodes on both nodes
    acc = WeightedAccumulator(TOY.numel)
    for node in ("a", "b"):
        v = penalty.observe(node, spiked)
        assert v.accepted.tolist() == [True, False, True, True]
        penalty.fold_(acc, torch.ones(TOY.numel), v)
    assert penalty.rolled_back == ["blocks.0"]
    assert penalty.ranges(penalty.rolled_back) == [(6, 12)]
    penalty.normalise_(acc.buffer)
    assert acc.buffer[6:12].abs().sum().item() == 0.0  # never folded
    assert acc.buffer[:6].tolist() == [1.0] * 6
    before = penalty.stats.state_dict()
    report = penalty.commit()
    assert report.rolled_back == ["blocks.0"] and report.accepted.tolist() == [2, 0, 2, 2]
    after = penalty.stats.state_dict()
    # The rejected module's statistics did not move; the accepted ones did.
    assert torch.equal(after["mean"][:, 1], before["mean"][:, 1])
    assert torch.equal(after["count"][:, 1], before["count"][:, 1])
    assert not torch.equal(after["count"][:, 0], before["count"][:, 0])


def test_rejected_updates_do_not_change_the_statistics() -> None:
    penalty = Penalty(TOY, warmup=5, rule="relative_max")
    _warm(penalty, "a", 8)
    penalty.observe("a", [1.0], tokens=100)
    penalty.commit()  # E gets a score
    state = penalty.state_dict()
    v = penalty.observe("a", [1e4], tokens=1)
    assert not v.accepted.item()
    penalty.commit()
    after = penalty.state_dict()
    for part in ("stats", "test"):
        for key, value in state[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.nan_to_num(-1), after[part][key].nan_to_num(-1)), key
            else:
                assert value == after[part][key]


# ---------------------------------------------------------------------------------------------
# Keying, frozen statistics, state


def test_pooled_versus_per_node_keying() -> None:
    per_node = Penalty(TOY, warmup=5, keying="node")
    pooled = Penalty(TOY, warmup=5, keying="pooled")
    for p in (per_node, pooled):
        _warm(p, "a", 8)
    # A new node under per-node keying is in its own warm-up: z = 0, accepted however large.
    v = per_node.observe("b", [50.0], tokens=1)
    assert v.z.item() == 0.0 and v.accepted.item() and not v.scored.item()
    # Pooled: b is scored against everyone's statistics.
    v = pooled.observe("b", [50.0], tokens=1)
    assert v.z.item() > 3 and not v.accepted.item()
    assert pooled.stats.keys() == ["*"] and per_node.stats.keys() == ["a"]
    per_node.commit()
    assert per_node.stats.keys() == ["a", "b"]


def test_scores_within_a_step_use_frozen_statistics() -> None:
    penalty = Penalty(TOY, warmup=3, keying="pooled")
    _warm(penalty, "a", 5)
    v1 = penalty.observe("a", [1.04], tokens=10)
    v2 = penalty.observe("b", [1.04], tokens=10)
    assert v1.z.item() == v2.z.item()
    assert penalty.score("c", [1.04])[1].item() == v1.z.item()  # score() is side-effect free


def test_state_dict_round_trip_continues_identically() -> None:
    kwargs = dict(granularity="module", warmup=4, weighting=["tokens", "norm_softmax"],
                  temperature="auto", adaptive_threshold=True)
    a = Penalty(TOY, **kwargs)
    for step in range(6):
        for node in ("x", "y"):
            a.observe(node, torch.full((4,), 1.0 + 0.1 * ((step * 3 + len(node)) % 4)),
                      tokens=10 + step)
        a.commit()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = Penalty(TOY, **kwargs)
    b.load_state_dict(torch.load(buf, weights_only=True))
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        for node in ("x", "y", "z"):
            norms = 1.0 + torch.rand(4, generator=gen, dtype=torch.float64) * 3
            va, vb = a.observe(node, norms, tokens=20), b.observe(node, norms, tokens=20)
            assert torch.equal(va.z, vb.z) and torch.equal(va.accepted, vb.accepted)
            assert torch.equal(va.weights, vb.weights)
        ra, rb = a.commit(), b.commit()
        assert ra.rejections == rb.rejections
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["stats"]["mean"], sb["stats"]["mean"])
    assert torch.equal(sa["test"]["z_history"].nan_to_num(-1),
                       sb["test"]["z_history"].nan_to_num(-1))
    with pytest.raises(ValueError, match="groups"):
        Penalty(TOY).load_state_dict(sa)


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="weighting"):
        Penalty(TOY, weighting="softmax")
    with pytest.raises(ValueError, match="temperature"):
        Penalty(TOY, temperature=0.0)
    penalty = Penalty(TOY)
    with pytest.raises(ValueError, match="token count"):
        penalty.observe("a", [1.0])
    with pytest.raises(ValueError, match="one norm per group"):
        penalty.observe("a", [1.0, 2.0], tokens=3)
    assert penalty.finalize_weights().shape == (0, 1)  # nothing entered the step
    v = penalty.observe("a", [math.inf], tokens=3)
    assert not v.accepted.item()  # non-finite: rejected even in warm-up
