"""The direction-aware rules of fl_geo.core.robust_agg against their formulas, written out by hand
on small matrices, and the loop-side judge (strategies/robust_rules.py) on a group with one
turned update."""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.core import robust_agg
from fl_geo.strategies.robust_rules import DirectionRule

X = torch.tensor([[1.0, -2.0, 0.0],
                  [3.0, 5.0, 1.0],
                  [2.0, 0.0, -4.0],
                  [10.0, 1.0, 2.0]])


def test_coordinate_median_is_the_middle_value_or_the_mean_of_the_two_middle_ones():
    # even n: columns sorted (1, 2, 3, 10), (-2, 0, 1, 5), (-4, 0, 1, 2) -> means of the middle pairs
    assert torch.equal(robust_agg.coordinate_median(X), torch.tensor([2.5, 0.5, 0.5]))
    # odd n: the middle value of each column of the first three rows
    assert torch.equal(robust_agg.coordinate_median(X[:3]), torch.tensor([2.0, 0.0, 0.0]))


def test_trimmed_mean_drops_trim_values_at_each_end_of_every_coordinate():
    assert torch.equal(robust_agg.trimmed_mean(X, 1), torch.tensor([2.5, 0.5, 0.5]))  # two left: the median
    five = torch.cat([X, torch.tensor([[0.0, 3.0, 3.0]])])
    # columns sorted (0,1,2,3,10), (-2,0,1,3,5), (-4,0,1,2,3): trim one at each end, mean of three
    assert torch.allclose(robust_agg.trimmed_mean(five, 1), torch.tensor([2.0, 4.0 / 3, 1.0]))
    assert torch.equal(robust_agg.trimmed_mean(X, 0), X.mean(dim=0))
    with pytest.raises(ValueError, match="n > 2"):
        robust_agg.trimmed_mean(X, 2)


def test_centered_clip_moves_by_the_weighted_mean_of_clipped_distances():
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0]])  # distances to 0: 5 and 1
    center = torch.zeros(2)
    # one iteration, tau 2: clip((3, 4)) = (1.2, 1.6), (0, 1) kept; weights 1 and 3
    v1 = robust_agg.centered_clip(x, center, 2.0, 1, [1.0, 3.0])
    assert torch.allclose(v1, torch.tensor([0.25 * 1.2, 0.25 * 1.6 + 0.75 * 1.0]))
    # the second iteration starts from v1
    z = x - v1
    clipped = [zi * min(1.0, 2.0 / float(zi.norm())) for zi in z]
    v2 = v1 + 0.25 * clipped[0] + 0.75 * clipped[1]
    assert torch.allclose(robust_agg.centered_clip(x, center, 2.0, 2, [1.0, 3.0]), v2)
    # the rows fold to v_L with the same weights, and each lies within tau of v_{L-1}
    rows = robust_agg.centered_clip_rows(x, center, 2.0, 2, [1.0, 3.0])
    assert torch.allclose(0.25 * rows[0] + 0.75 * rows[1], v2)
    assert all(float((r - v1).norm()) <= 2.0 + 1e-6 for r in rows)


def test_cosine_scores_against_the_median_and_the_leave_one_out_mean():
    u = torch.tensor([1.0, 2.0, 2.0])
    x = torch.stack([u, 1.1 * u, 0.9 * u, -3 * u])
    med = robust_agg.cosine_scores(x, "median")
    assert torch.allclose(med, torch.tensor([1.0, 1.0, 1.0, -1.0]))  # the median of the four is u
    # leave-one-out: row 0 against (1.1u + 0.9u - 3u)/3 = -u/3, so honest rows point away too
    loo = robust_agg.cosine_scores(x, "loo_mean")
    assert torch.allclose(loo, torch.tensor([-1.0, -1.0, -1.0, -1.0]))
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    assert math.isclose(float(robust_agg.cosine_scores(torch.stack([a, b]), "loo_mean")[0]), 1 / math.sqrt(2), rel_tol=1e-6)
    out = robust_agg.cosine_outliers(med.tolist(), 0.0)
    assert list(out) == [3] and "cosine -1.000" in out[3] and "strategy.robust=cosine" in out[3]


def test_the_judge_stops_a_turned_update_with_each_rule():
    torch.manual_seed(0)
    u = torch.randn(64)
    honest = [u + 0.1 * torch.randn(64) for _ in range(3)]
    group = [*honest, -3 * u]
    mean = torch.stack(honest).mean(dim=0)

    def judge(rule):
        return DirectionRule(rule, 64, trim=1, iters=3, cos_min=0.0, window=16).judge(group, [1.0] * 4, None)

    assert list(judge("cosine").rejected) == [3]
    for rule in ("median", "trimmed_mean"):
        agg = judge(rule).aggregate
        assert agg is not None and float(torch.nn.functional.cosine_similarity(agg, mean, dim=0)) > 0.95
    # centered clipping from a zero center: the turned update is clipped to the median distance
    rows = judge("centered_clip").rows
    assert float(rows[3].norm()) < 1.2 * float(u.norm()) and float(torch.stack(list(rows.values())).mean(0) @ u) > 0
    # the model-norm bound and NaN are the fold's refusals, given before any rule (never clipped in)
    refused = DirectionRule("centered_clip", 64, trim=1, iters=1, cos_min=0.0, window=16).judge(
        [*group, torch.full((64,), float("nan"))], [1.0] * 5, bound=2 * float(u.norm()))
    assert "strategy.max_update_ratio" in refused.rejected[3] and 4 in refused.rejected and 3 not in refused.rows


def _running(cos_min: float = 0.0) -> DirectionRule:
    return DirectionRule("cosine", 64, trim=1, iters=1, cos_min=cos_min, window=16, consensus="running")


def test_the_running_consensus_is_seeded_by_the_first_groups_median_and_only_kept_updates_move_it():
    """Asynchronous ``cosine``: the first group's coordinate median seeds the center (two turned
    updates of five cannot move it), turned updates are refused against it, the kept ones are
    centered-clipped and become the center; a later lone update is judged against that center."""
    torch.manual_seed(1)
    u = torch.randn(64)
    honest = [u + 0.1 * torch.randn(64) for _ in range(3)]
    rule = _running()
    assert not rule.seeded
    first = rule.judge([-10 * u, -10 * u + torch.randn(64), *honest], [1.0] * 5, None)  # the fastest two are hostile
    assert rule.seeded and sorted(first.rejected) == [0, 1] and sorted(first.rows) == [2, 3, 4]
    assert "cosine -" in first.rejected[0] and "the running consensus" in first.rejected[0]
    kept = torch.stack([first.rows[i] for i in (2, 3, 4)])
    assert rule.center is not None and torch.allclose(rule.center, kept.mean(dim=0))
    center = rule.center.clone()
    lone = rule.judge([-3 * u], [1.0], None)  # a buffer of one: judged against the running center
    assert list(lone.rejected) == [0] and torch.equal(rule.center, center)  # a refused update never moves it
    again = rule.judge([u], [1.0], None)
    assert not again.rejected and float(torch.nn.functional.cosine_similarity(rule.center, u, dim=0)) > 0.95
    # a first group of fewer than three cannot outvote anyone: its mean seeds the center, nothing is refused
    small = _running()
    out = small.judge([u, -u + 0.5 * torch.randn(64)], [1.0, 1.0], None)
    assert not out.rejected and small.seeded and small.center is not None
    assert torch.allclose(small.center, (u + out.rows[1]) / 2)


def test_the_running_consensus_survives_a_checkpoint_seeded_or_not():
    fresh, seeded = _running(), _running()
    seeded.judge([torch.ones(64), torch.ones(64), 2 * torch.ones(64)], [1.0] * 3, None)
    assert seeded.seeded and not fresh.seeded  # both branches below are exercised
    for rule in (fresh, seeded):
        again = _running()
        again.load_state_dict(rule.state_dict())
        assert again.seeded == rule.seeded
        if rule.center is None:
            assert again.center is None
        else:
            assert again.center is not None and torch.equal(again.center, rule.center)
    with pytest.raises(ValueError, match="does not fit this model"):
        _running().load_state_dict({**seeded.state_dict(), "center": torch.ones(3)})
    with pytest.raises(ValueError, match="does not fit this model"):  # a group cosine rule keeps no center
        DirectionRule("cosine", 64, trim=1, iters=1, cos_min=0.0, window=16).load_state_dict(seeded.state_dict())
    with pytest.raises(ValueError, match="consensus must be"):
        DirectionRule("cosine", 64, trim=1, iters=1, cos_min=0.0, window=16, consensus="mean")
