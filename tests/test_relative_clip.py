"""The relative clip (docs/algorithms.md §4, "The relative clip"): φ_g,t = c · m_g,t−1, with m
the EMA of the clipped norms.

Checked against the formula by hand, and for the two properties the derivation rests on: the
clip factors do not change when every update is scaled by s > 0 (scale-free), and the clipped
norm cannot grow faster than (1 − α + α·c) per step however large the raw updates become.
"""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.core.penalty import Penalty
from fl_geo.core.relative_clip import RelativeClip
from fl_geo.core.state import ParamSpec

EPS = 1e-6


def _spec(*sizes: tuple[str, int]) -> ParamSpec:
    return ParamSpec(tuple(n for n, _ in sizes), tuple((k,) for _, k in sizes), ("float32",) * len(sizes))


TWO_MODULES = _spec(("a.w", 3), ("b.w", 2))


def _step(penalty: Penalty, update: torch.Tensor) -> torch.Tensor:
    """One outer step with one update: observe, fold, normalise, clip (in place), commit."""
    from fl_geo.core.accumulate import WeightedAccumulator

    acc = WeightedAccumulator(update.numel())
    penalty.fold_(acc, update, penalty.observe("n0", penalty.norms(update), tokens=1))
    penalty.normalise_(acc.buffer)
    factors = penalty.clip_(acc.buffer)
    update.copy_(acc.buffer)
    penalty.commit()
    return factors


def test_statistic_and_thresholds_follow_the_formula():
    clip = RelativeClip(2, ratio=2.0, alpha=0.1)
    assert clip.thresholds().tolist() == [math.inf, math.inf]  # no step yet: no clip
    clip.update(torch.tensor([4.0, 1.0]))
    assert clip.thresholds().tolist() == [8.0, 2.0]  # m = first norm
    clip.update(torch.tensor([6.0, 3.0]), stepped=torch.tensor([True, False]))  # b rolled back
    assert clip.mean.tolist() == pytest.approx([0.9 * 4 + 0.1 * 6, 1.0])
    clip.update(torch.tensor([math.nan, 2.0]))  # a non-finite norm teaches nothing
    assert clip.mean.tolist() == pytest.approx([4.2, 0.9 * 1 + 0.1 * 2])
    with pytest.raises(ValueError, match="ratio"):
        RelativeClip(1, ratio=0.0)
    with pytest.raises(ValueError, match="alpha"):
        RelativeClip(1, alpha=0.0)


def test_penalty_relative_clip_matches_hand_values_per_module():
    penalty = Penalty(TWO_MODULES, granularity="module", weighting="uniform", warmup=100, clip=10.0,
                      clip_mode="relative", clip_ratio=2.0)
    first = torch.tensor([3.0, 4.0, 0.0, 0.0, 2.0])  # norms 5, 2: first step, not clipped
    assert _step(penalty, first.clone()).tolist() == [1.0, 1.0]
    second = torch.tensor([30.0, 40.0, 0.0, 3.0, 0.0])  # norms 50 (> 2·5), 3 (< 2·2)
    out = second.clone()
    factors = _step(penalty, out)
    expected = [10.0 / (50.0 + EPS), 1.0]
    torch.testing.assert_close(factors, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([30 * expected[0], 40 * expected[0], 0.0, 3.0, 0.0]))
    # m learns the clipped norms: a: 0.9·5 + 0.1·10, b: 0.9·2 + 0.1·3
    assert penalty.relative.mean.tolist() == pytest.approx([0.9 * 5 + 0.1 * 50 * expected[0], 2.1])


def test_the_clip_is_scale_free_and_absolute_is_not():
    """Scaling every update by s leaves the relative clip's factors as they were; an absolute φ
    binds on the large-scale copy and not on the small one. (Equal up to the clip's ε.)"""
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(5, generator=g) * (1 + 3 * (i == 3)) for i in range(6)]  # a spike at step 3

    def factors(mode: str, scale: float) -> list[float]:
        penalty = Penalty(TWO_MODULES, weighting="uniform", warmup=100, clip=1.0, clip_mode=mode)
        return [float(_step(penalty, u.clone() * scale)) for u in updates]

    small, large = factors("relative", 0.1), factors("relative", 1e3)
    assert small == pytest.approx(large, rel=1e-4)  # equal but for ε = 1e-6 against norms ~0.2
    assert small[3] < 1.0 and small[:3] == [1.0, 1.0, 1.0]  # it cuts the spike, not the steady steps
    assert all(f == 1.0 for f in factors("absolute", 1e-3))
    assert all(f < 1e-2 for f in factors("absolute", 1e3))


def test_a_run_of_spikes_grows_the_step_at_most_geometrically():
    c, alpha = 2.0, 0.1
    penalty = Penalty(TWO_MODULES, weighting="uniform", warmup=100, clip=1.0, clip_mode="relative",
                      clip_ratio=c)
    _step(penalty, torch.ones(5))
    m = math.sqrt(5)
    for k in range(10):
        out = torch.ones(5) * 10.0 ** (k + 2)  # each raw update 100× the last
        _step(penalty, out)
        clipped = float(torch.linalg.vector_norm(out))
        assert clipped <= c * m * (1 + 1e-6)  # the buffer is fp32
        m_next = float(penalty.relative.mean[0])
        assert m_next <= (1 - alpha + alpha * c) * m * (1 + 1e-6)
        m = m_next


def test_state_round_trips_and_absolute_mode_is_unchanged():
    a = Penalty(TWO_MODULES, weighting="uniform", warmup=100, clip=1.0, clip_mode="relative")
    _step(a, torch.arange(5.0))
    b = Penalty(TWO_MODULES, weighting="uniform", warmup=100, clip=1.0, clip_mode="relative")
    b.load_state_dict(a.state_dict())
    x, y = torch.arange(5.0) * 7, torch.arange(5.0) * 7
    assert torch.equal(_step(a, x), _step(b, y)) and torch.equal(x, y)
    absolute = Penalty(TWO_MODULES, weighting="uniform", warmup=100, clip=1.0)
    assert absolute.clip_mode == "absolute" and absolute.relative is None
    assert "relative_clip" not in absolute.state_dict()
    with pytest.raises(ValueError, match="clip_mode"):
        Penalty(TWO_MODULES, clip=1.0, clip_mode="by_feel")
    assert Penalty(TWO_MODULES, clip=None, clip_mode="relative").clip_thresholds().tolist() == [math.inf]
