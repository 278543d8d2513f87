"""Di-PS grace time (docs/algorithms.md §5): the ski-rental formula and its running estimates."""

from __future__ import annotations

import math

import pytest

from fl_geo.core.grace import GraceTimer, grace_time


@pytest.mark.parametrize(
    ("rate", "cost", "expected"),
    [
        (2.0, 3.0, math.log(6.0) / 2.0),  # 0.8959
        (0.5, 10.0, math.log(5.0) / 0.5),  # 3.2189
        (1.0, math.e, 1.0),  # ln(e)/1
        (4.0, 0.25, 0.0),  # C·λ = 1: waiting never pays
        (0.1, 5.0, 0.0),  # C·λ = 0.5 < 1
    ],
)
def test_formula(rate: float, cost: float, expected: float) -> None:
    assert grace_time(rate, cost) == pytest.approx(expected, rel=1e-12, abs=0)


def test_bounded_by_cost_over_e_and_clamped() -> None:
    for rate in (0.01, 0.3, 1.0, 7.0, 100.0):
        assert grace_time(rate, 5.0) <= 5.0 / math.e + 1e-12
    assert grace_time(math.e / 5.0, 5.0) == pytest.approx(5.0 / math.e)  # equality at C·λ = e
    assert grace_time(0.5, 10.0, tau_max=2.0) == 2.0
    assert grace_time(math.inf, 3.0) == 0.0
    with pytest.raises(ValueError):
        grace_time(0.0, 1.0)


def test_zero_before_estimates_and_fixed_override() -> None:
    timer = GraceTimer(tau_max=60.0)
    assert timer.grace() == 0.0 and timer.rate is None and timer.cost is None
    timer.observe_arrival(10.0)
    timer.observe_cost(5.0)
    assert timer.grace() == 0.0  # one arrival: no interval yet
    timer.observe_arrival(11.0)
    assert timer.rate == 1.0 and timer.grace() == pytest.approx(math.log(5.0))
    fixed = GraceTimer(tau_max=1.0, fixed=2.5)
    assert fixed.grace() == 2.5  # a configured value is returned as given
    with pytest.raises(ValueError):
        timer.observe_arrival(10.5)  # out of time order


def test_ema_estimates_from_a_synthetic_arrival_sequence() -> None:
    timer = GraceTimer(tau_max=100.0, smoothing=0.5)
    for t in (0.0, 2.0, 3.0, 7.0):  # intervals 2, 1, 4
        timer.observe_arrival(t)
    interval = 0.5 * (0.5 * 2.0 + 0.5 * 1.0) + 0.5 * 4.0  # 2 → 1.5 → 2.75
    assert timer.rate == pytest.approx(1 / interval, rel=1e-12)
    for c in (10.0, 20.0):  # 10 → 15
        timer.observe_cost(c)
    assert timer.cost == 15.0
    lam = 1 / 2.75
    assert timer.grace() == pytest.approx(math.log(15.0 * lam) / lam, rel=1e-12)
    # A steady Poisson-like stream converges to its rate.
    steady = GraceTimer(tau_max=100.0, smoothing=0.1)
    for k in range(200):
        steady.observe_arrival(0.25 * k)
    assert steady.rate == pytest.approx(4.0, rel=1e-9)


def test_state_round_trip() -> None:
    a = GraceTimer(tau_max=30.0, smoothing=0.2)
    for t in (0.0, 1.0, 1.5):
        a.observe_arrival(t)
    a.observe_cost(4.0)
    b = GraceTimer(tau_max=30.0, smoothing=0.2)
    b.load_state_dict(a.state_dict())
    for timer in (a, b):
        timer.observe_arrival(3.0)
        timer.observe_cost(6.0)
    assert a.grace() == b.grace() and a.state_dict() == b.state_dict()
    with pytest.raises(ValueError):
        b.load_state_dict({**a.state_dict(), "cost": -1.0})
