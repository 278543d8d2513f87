"""Di-PS grace time (docs/algorithms.md §5; Di-PS §4.1): how long to wait for more pushes.

After a push arrives, the asynchronous server waits τ_grace for further pushes before it steps.
Di-PS treats this as ski rental: waiting τ costs τ; stepping without a push that would have
arrived costs C_m (the update + pull it forces to happen again). With pushes arriving as a
Poisson process of rate λ, the expected cost τ + C_m·e^(−λτ) is minimised at

    τ* = ln(C_m·λ) / λ    when C_m·λ > 1,    else 0 (waiting never pays),

clamped to [0, τ_max]. Note τ* ≤ C_m/e always (ln x / x ≤ 1/e), so it stays within the cost of
one extra round. λ and C_m are running estimates from what the server measures; times are in
whatever clock the caller uses (virtual or wall seconds), as long as it is one clock.
Framework-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["GraceTimer", "grace_time"]


def grace_time(rate: float, cost: float, tau_max: float = math.inf) -> float:
    """τ* = ln(C_m·λ)/λ for C_m·λ > 1, else 0, clamped to [0, tau_max].

    ``rate`` λ > 0 in pushes per time unit (+Inf: pushes are simultaneous, τ* → 0), ``cost``
    C_m ≥ 0 in time units.
    """
    if not rate > 0 or math.isnan(rate):
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    if not (cost >= 0 and math.isfinite(cost)):
        raise ValueError(f"cost must be finite and >= 0, got {cost}")
    if math.isinf(rate):
        return 0.0
    x = cost * rate
    if x <= 1.0:
        return 0.0
    return min(max(math.log(x) / rate, 0.0), tau_max)


def _check_time(name: str, value: float) -> float:
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


class GraceTimer:
    """Running estimates of λ and C_m, and the grace time they imply.

    - λ: from the inter-arrival times of pushes (every push the server receives, all workers
      together, rejected ones included, in arrival order). We keep an EMA of the *interval*
      (weight ``smoothing`` on the newest) and use λ = 1/interval: for a Poisson process the
      mean interval is the natural estimate of 1/λ, while an EMA of instantaneous rates 1/Δt
      would be dominated by near-simultaneous arrivals. The first interval seeds the EMA.
    - C_m: EMA of measured "outer step + reply" durations (`observe_cost`), seeded by the first.

    Until both estimates exist (fewer than two arrivals, or no cost yet) `grace` returns 0: the
    server steps as soon as its first reply is in, which is plain FedBuff-style behaviour and
    costs nothing to learn from. ``fixed`` (≥ 0) overrides the estimate entirely and is returned
    as given (a configured grace time, not clamped by ``tau_max``).
    """

    def __init__(self, tau_max: float, smoothing: float = 0.1, fixed: float | None = None
                 ) -> None:
        tau_max = float(tau_max)
        if not tau_max >= 0:  # also rejects NaN; +Inf means "no clamp"
            raise ValueError(f"tau_max must be >= 0, got {tau_max}")
        self.tau_max = tau_max
        smoothing = float(smoothing)
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.fixed = None if fixed is None else _check_time("fixed grace time", fixed)
        self._last_arrival: float | None = None
        self._interval: float | None = None  # EMA of inter-arrival times
        self._cost: float | None = None  # EMA of update + pull durations
        self.arrivals = 0
        self.costs = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new

    def observe_arrival(self, t: float) -> None:
        """Record a push that arrived at time ``t`` (non-decreasing across calls)."""
        t = float(t)
        if not math.isfinite(t):
            raise ValueError(f"arrival time must be finite, got {t}")
        if self._last_arrival is not None:
            if t < self._last_arrival:
                raise ValueError(f"arrival at {t} precedes the previous one at "
                                 f"{self._last_arrival}; arrivals must be in time order")
            self._interval = self._ema(self._interval, t - self._last_arrival)
        self._last_arrival = t
        self.arrivals += 1

    def observe_cost(self, seconds: float) -> None:
        """Record the measured duration of one outer step plus its reply (the pull)."""
        self._cost = self._ema(self._cost, _check_time("cost", seconds))
        self.costs += 1

    @property
    def rate(self) -> float | None:
        """Estimated λ (pushes per time unit), None before two arrivals; +Inf if every
        observed interval was 0."""
        if self._interval is None:
            return None
        return math.inf if self._interval == 0 else 1.0 / self._interval

    @property
    def cost(self) -> float | None:
        """Estimated C_m, None before the first `observe_cost`."""
        return self._cost

    def grace(self) -> float:
        """The grace time to wait after a push: ``fixed`` if set, else τ* from the estimates
        (0 while either is missing)."""
        if self.fixed is not None:
            return self.fixed
        rate, cost = self.rate, self._cost
        if rate is None or cost is None:
            return 0.0
        return grace_time(rate, cost, self.tau_max)

    def state_dict(self) -> dict[str, Any]:
        """Estimates and counters (plain floats/ints/None)."""
        return {
            "last_arrival": self._last_arrival,
            "interval": self._interval,
            "cost": self._cost,
            "arrivals": self.arrivals,
            "costs": self.costs,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict` output (validated first; settings stay the constructor's)."""
        def opt(name: str, non_negative: bool) -> float | None:
            value = state[name]
            if value is None:
                return None
            value = float(value)
            if not math.isfinite(value) or (non_negative and value < 0):
                raise ValueError(f"GraceTimer state {name!r} is invalid: {value}")
            return value

        last, interval, cost = (opt("last_arrival", False), opt("interval", True),
                                opt("cost", True))
        counts = [state["arrivals"], state["costs"]]
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"GraceTimer state counters must be ints >= 0, got {counts}")
        self._last_arrival, self._interval, self._cost = last, interval, cost
        self.arrivals, self.costs = counts
