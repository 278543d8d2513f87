"""Streaming DiLoCo's sync schedules: *which* fragment starts syncing *when* (docs/algorithms.md §7).

:func:`fixed_schedule` / :class:`FixedSchedule` are torchft's round-robin over one period of H
inner steps; :class:`AdaptiveSchedule` is CoCoDC's Algorithm 2, which the server runs from the
measured step and sync times and each completed sync's ‖Δ̄_p‖. Schedules deal in step counts and
fragment indices only, never in tensors, so they sit apart from the fragment layout
(`fl_geo.core.streaming_fragments`) and the outer step and merge (`fl_geo.core.streaming`).
Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

__all__ = ["AdaptiveSchedule", "FixedSchedule", "fixed_schedule"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are rejected (they are config slips)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def fixed_schedule(P: int, H: int, tau: int) -> list[tuple[int, int, int]]:
    """torchft-style round-robin: ``(p, start, apply)`` per fragment, steps within one period.

    Fragment p starts its sync at (p+1)·H/P − τ and applies the result at (p+1)·H/P, so the
    syncs are spread evenly over H and fragment P − 1 applies at H, where plain DiLoCo would
    sync. P must divide H (torchft's requirement, keeping every offset an integer step) and
    0 ≤ τ < H/P, so a fragment's sync never starts before the previous one was applied.
    """
    P = _check_int("P", P, 1)
    H = _check_int("H", H, 1)
    tau = _check_int("tau", tau, 0)
    if H % P:
        raise ValueError(f"P ({P}) must divide H ({H})")
    step = H // P
    if tau >= step:
        raise ValueError(f"tau must be < H/P = {step}, got {tau}")
    return [(p, (p + 1) * step - tau, (p + 1) * step) for p in range(P)]


class FixedSchedule:
    """The fixed round-robin schedule (`fixed_schedule`) as the loop asks it, over global steps.

    Steps count from 1 across periods of H; the schedule repeats every period. ``starts_at(t)``
    lists the fragments whose sync starts when global step ``t`` ends; ``next_start_after(t)`` is
    the first step after ``t`` at which any sync starts (the loop dispatches work up to it).
    """

    def __init__(self, P: int, H: int, tau: int) -> None:
        self.H = _check_int("H", H, 1)
        self._starts: dict[int, list[int]] = {}  # step within a period (1..H) -> fragments
        for p, start, _ in fixed_schedule(P, H, tau):
            self._starts.setdefault(start, []).append(p)

    def starts_at(self, step: int) -> list[int]:
        """Fragments whose sync starts at global step ``step`` (>= 1)."""
        offset = step - self.H * ((step - 1) // self.H)  # in 1..H
        return list(self._starts.get(offset, []))

    def next_start_after(self, step: int) -> int:
        """The first global step after ``step`` (>= 0) at which a sync starts."""
        base = self.H * (step // self.H)
        return min(b + s for b in (base, base + self.H) for s in self._starts if b + s > step)


def _exact(x: float) -> Fraction:
    """``x`` as the decimal it prints as (0.29 → 29/100), so floors of products of config values
    are not off by one from binary rounding (the float 0.29·100 is 28.999999999999996)."""
    return Fraction(repr(float(x)))


class AdaptiveSchedule:
    """CoCoDC's adaptive fragment selection (Algorithm 2, docs/algorithms.md §7), decided by the
    server alone and told to the workers.

    Bookkeeping per fragment p: t_{p,b}, the step at which p's last sync *completed* (0 at the
    start), and ‖Δ̄_p‖₂ of that sync. At step t the interval is I_p = t − t_{p,b} and the change
    rate R_p = ‖Δ̄_p‖₂ / I_p. `choose` returns the lowest-index idle fragment with I_p ≥ H
    (nothing may go stale for more than a period), else the idle fragment with the largest R_p.

    Conventions (where the paper leaves a gap):

    * R_p = ∞ until p's first sync completes (the paper's initial priority), whatever I_p is;
      ties, ∞ included, go to the lowest index, so the first P choices are 0, 1, …, P−1.
    * I_p = 0 after a first sync (p completed at this very step): R_p = −∞, i.e. ranked below
      every real rate but still eligible. Dividing by zero would make the fragment just synced
      the most urgent one although it has had no training since; skipping it entirely could
      leave `choose` with nothing to return although a fragment is idle.
    * Fragments in ``in_flight`` are skipped in both rules; None only if all are in flight.
    """

    def __init__(self, num_fragments: int, H: int, gamma: float = 0.4) -> None:
        self.num_fragments = _check_int("num_fragments", num_fragments, 1)
        self.H = _check_int("H", H, 1)
        self.gamma = self._check_gamma(gamma)
        self._last_completed = [0] * self.num_fragments
        self._last_norm: list[float | None] = [None] * self.num_fragments

    @staticmethod
    def _check_gamma(gamma: Any) -> float:
        gamma = float(gamma)
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        return gamma

    # -- capacity (Eqs. 9-10) -------------------------------------------------------------

    def syncs_per_period(self, t_c: float, t_s: float) -> int:
        """N = max(P, ⌊γ·H·T_c/T_s⌋): fragment syncs that fit into H inner steps (Eq. 9).

        Following the paper (§III-B): ``t_c`` is the time of one local *computation* step and
        ``t_s`` the time of one fragment *synchronisation*, so H·T_c/T_s syncs could run back
        to back during one period and γ keeps headroom for network variability. N ≥ P keeps
        every fragment synced at least once per period. The floor is taken on the exact
        decimal values (see `_exact`).
        """
        for name, value in (("t_c", t_c), ("t_s", t_s)):
            if not (math.isfinite(float(value)) and float(value) > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        capacity = _exact(self.gamma) * self.H * _exact(t_c) / _exact(t_s)
        return max(self.num_fragments, math.floor(capacity))

    def interval(self, t_c: float, t_s: float) -> int:
        """h = max(1, ⌊H/N⌋) inner steps between sync starts (Eq. 10; at least one step)."""
        return max(1, self.H // self.syncs_per_period(t_c, t_s))

    # -- selection (Eqs. 11-12, Algorithm 2) ----------------------------------------------

    def _check_p(self, p: Any) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_fragments:
            raise ValueError(f"fragment index must be an int in [0, {self.num_fragments}), "
                             f"got {p!r}")
        return p

    def rates(self, t_now: int) -> list[float]:
        """R_p at step ``t_now`` for every fragment, with the ∞ / −∞ conventions of the class."""
        t_now = _check_int("t_now", t_now, 0)
        if t_now < max(self._last_completed):
            raise ValueError(f"t_now {t_now} is before a completed sync "
                             f"(step {max(self._last_completed)})")
        out = []
        for t_b, norm in zip(self._last_completed, self._last_norm, strict=True):
            interval = t_now - t_b
            if norm is None:
                out.append(math.inf)
            elif interval == 0:
                out.append(-math.inf)
            else:
                out.append(norm / interval)
        return out

    def choose(self, t_now: int, in_flight: set[int] | frozenset[int]) -> int | None:
        """The fragment to start syncing at step ``t_now``, or None if all are in flight."""
        rates = self.rates(t_now)
        busy = {self._check_p(p) for p in in_flight}
        idle = [p for p in range(self.num_fragments) if p not in busy]
        if not idle:
            return None
        for p in idle:  # ascending: the lowest-index stale fragment
            if t_now - self._last_completed[p] >= self.H:
                return p
        return max(idle, key=lambda p: (rates[p], -p))

    def completed(self, p: int, t_now: int, mean_delta_norm: float) -> None:
        """Record that fragment p's sync completed at step ``t_now`` with ‖Δ̄_p‖₂."""
        p = self._check_p(p)
        t_now = _check_int("t_now", t_now, 0)
        if t_now < self._last_completed[p]:
            raise ValueError(f"fragment {p} completed at {self._last_completed[p]}, cannot "
                             f"complete again at earlier step {t_now}")
        norm = float(mean_delta_norm)
        if not (math.isfinite(norm) and norm >= 0.0):
            raise ValueError(f"mean_delta_norm must be finite and >= 0, got {norm}")
        self._last_completed[p] = t_now
        self._last_norm[p] = norm

    def last_completed(self, p: int) -> int:
        """t_{p,b}: step of fragment p's last completed sync (0 before the first)."""
        return self._last_completed[self._check_p(p)]

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (JSON-serialisable); ``last_norm`` is None before a first sync."""
        return {
            "num_fragments": self.num_fragments,
            "H": self.H,
            "gamma": self.gamma,
            "last_completed": list(self._last_completed),
            "last_norm": list(self._last_norm),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (H and γ included), validating everything before changing
        anything; ``num_fragments`` must match, since the fragments themselves are fixed."""
        expected = {"num_fragments", "H", "gamma", "last_completed", "last_norm"}
        if not isinstance(state, dict) or set(state) != expected:
            raise ValueError(f"state must be a dict with keys {sorted(expected)}")
        if state["num_fragments"] != self.num_fragments:
            raise ValueError(f"state is for {state['num_fragments']} fragments, this schedule "
                             f"has {self.num_fragments}")
        H = _check_int("H", state["H"], 1)
        gamma = self._check_gamma(state["gamma"])
        last_completed, last_norm = state["last_completed"], state["last_norm"]
        if (not isinstance(last_completed, (list, tuple)) or not isinstance(last_norm, (list, tuple))
                or len(last_completed) != self.num_fragments
                or len(last_norm) != self.num_fragments):
            raise ValueError(f"last_completed and last_norm must hold {self.num_fragments} "
                             "entries")
        completed = [_check_int("last_completed entry", t, 0) for t in last_completed]
        norms: list[float | None] = []
        for value in last_norm:
            if value is None:
                norms.append(None)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"last_norm entries must be numbers or None, got {value!r}")
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"last_norm entries must be finite and >= 0, got {value}")
            norms.append(float(value))
        self.H, self.gamma = H, gamma
        self._last_completed, self._last_norm = completed, norms
