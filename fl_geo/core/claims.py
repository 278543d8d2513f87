"""Bounding what a site says about itself: example counts and reported times.

A plain Flower ClientApp weights its update by the ``num-examples`` it declares, in its own
unit, so no job-derived cap exists for it (fl-geo's own replies are capped by the tokens their
job could produce). A claim can still be judged against what the run has *accepted* so far:
:class:`ClaimBound` rejects a claim above ``factor`` × the reference (the lower median over the
sites of each site's median accepted claim, the claimant's included), and, before anything was
accepted, above ``factor`` × the lower median of the claims of the round being judged when it
has at least ``MIN_PEERS`` of them. One site's lie can then never own a synchronous round's
weighted mean or end a token budget. The asynchronous loops (and HALoS) hold the plain
replies that come before the first accepted claim and judge them together once ``MIN_PEERS``
have come or no other site can still reply (with fewer they cap each at their lower median
instead, `ClaimBound.cap_few`: strategies/plain_claims.py); from then on every claim is bounded
against the accepted ones.

:class:`ReportedTimes` does the same for the wall times a site reports (a step time, a training
time): each is capped at ``factor`` × that site's own median of earlier reports, and the loop
combines the sites' capped values with the median (`robust_time`), so no single site moves a
schedule built from them.

Why ``factor`` is a constant (`CLAIM_FACTOR` = 4) rather than a setting: honest sites of one run
hold data and hardware of the same order, so a factor of 4 leaves room for an uneven partition
or a slow accelerator while refusing lies of the orders that matter (2^40 examples, a 3600 s
step); the one operator who needs more trusts the claims outright (``strategy.token_cap: none``).
Framework-free (no Flower import).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

__all__ = ["CLAIM_FACTOR", "MIN_PEERS", "ClaimBound", "ReportedTimes", "robust_time"]

CLAIM_FACTOR = 4.0  # a claim or a time beyond this × the reference median is not believed
MIN_PEERS = 3  # claims a round needs before its own median is a reference (two cannot outvote one)
WINDOW = 16  # accepted claims / reports remembered per site (the reference follows the run)


class ClaimBound:
    """Judge declared example counts against the accepted ones (see the module docstring).

    Contract: `judge` never records anything; the loop calls `accepted` for the claims it
    folded, so a rejected claim never enters the reference. The reference: `reference`.
    """

    def __init__(self, factor: float = CLAIM_FACTOR, window: int = WINDOW, min_peers: int = MIN_PEERS) -> None:
        if not factor >= 1.0:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.factor, self.window, self.min_peers = float(factor), int(window), int(min_peers)
        self._history: dict[Hashable, deque[int]] = {}

    def has_history(self) -> bool:
        """Whether any claim was accepted yet (then `judge` needs no round)."""
        return any(self._history.values())

    def reference(self) -> float | None:
        """The lower median, over the sites, of each site's median accepted claim; None before
        the first. One vote per site, so a site that replies more often (a fast one in an
        asynchronous run) does not own the reference; the lower median, so that one honest site
        next to one lying site (an asynchronous run whose first replies lied) already makes the
        honest claim the reference."""
        votes = [statistics.median(h) for h in self._history.values() if h]
        return float(statistics.median_low(votes)) if votes else None

    def judge(self, claim: int, round_claims: Sequence[int] = ()) -> str | None:
        """Why ``claim`` is refused, or None. Against the accepted history when there is one;
        otherwise against ``round_claims`` (the round's claims, ``claim`` among them) when they
        are at least `min_peers`; otherwise accepted."""
        ref, what = self.reference(), "accepted claims so far"
        if ref is None:
            if len(round_claims) < self.min_peers:
                return None
            ref, what = float(statistics.median_low(round_claims)), f"{len(round_claims)} claims this round"
        if claim > self.factor * ref:
            return (f"num-examples={claim} is more than {self.factor:g} x the median {ref:g} of the {what} "
                    "(strategy.token_cap=none trusts it)")
        return None

    def cap_few(self, claims: Sequence[int]) -> int | None:
        """The most any of ``claims`` may count for when they are judged together with no history
        and too few to outvote a lie (1 to `min_peers` - 1 of them): their lower median, so of
        two neither weighs more than the other and a lone claim is believed. None otherwise."""
        if self.has_history() or not 0 < len(claims) < self.min_peers:
            return None
        return int(statistics.median_low(claims))

    def accepted(self, site: Hashable, claim: int) -> None:
        """Record a claim the loop folded."""
        self._history.setdefault(site, deque(maxlen=self.window)).append(int(claim))

    def state_dict(self) -> dict[str, Any]:
        """The accepted claims per site, for a checkpoint: a resumed run judges its first claims
        against what the run had accepted, instead of believing them (an asynchronous loop) or
        needing a round of peers (a synchronous one). Sites are partition ids (ints) or
        ``"node N"`` strings; each pair keeps its type."""
        return {"factor": self.factor, "history": [[site, list(h)] for site, h in self._history.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output; ValueError (and nothing changed) if it does not fit."""
        if float(state.get("factor", -1.0)) != self.factor:
            raise ValueError(f"checkpoint's claim factor {state.get('factor')!r} is not this run's {self.factor:g}")
        history: dict[Hashable, deque[int]] = {}
        for pair in state.get("history", []):
            site, claims = pair
            if isinstance(site, bool) or not isinstance(site, int | str) or not all(
                    isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in claims):
                raise ValueError(f"checkpoint's accepted claims are malformed: {pair!r}")
            history[site] = deque((int(c) for c in claims), maxlen=self.window)
        self._history = history


class ReportedTimes:
    """Cap each site's reported times at ``factor`` × its own median of earlier reports.

    Contract: `bound` returns the value to use and records it (capped, so a liar raises its
    own reference by at most ``factor`` per report, and a robust statistic across sites,
    `robust_time`, removes it entirely while it is a minority); the first report of a site is
    taken as it is (the caller checks the absolute range: replies.py ``MAX_STEP_TIME_S``).
    """

    def __init__(self, factor: float = CLAIM_FACTOR, window: int = WINDOW) -> None:
        if not factor >= 1.0:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.factor, self.window = float(factor), int(window)
        self._history: dict[Hashable, deque[float]] = {}

    def bound(self, site: Hashable, value: float) -> float:
        """``value`` capped at factor × the site's own median of earlier reports; recorded."""
        history = self._history.setdefault(site, deque(maxlen=self.window))
        if history:
            value = min(value, self.factor * statistics.median(history))
        history.append(value)
        return value

    def state_dict(self) -> dict[str, Any]:
        """Each site's kept reports, for a checkpoint: a resumed run caps a site's first reports
        by what it reported before. Sites are partition ids (ints)."""
        return {"history": [[site, list(h)] for site, h in self._history.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output; ValueError (and nothing changed) if it does not fit."""
        history: dict[Hashable, deque[float]] = {}
        for pair in state.get("history", []):
            site, values = pair
            if isinstance(site, bool) or not isinstance(site, int) or not all(
                    isinstance(v, float) and v >= 0.0 and v != float("inf") for v in values):
                raise ValueError(f"checkpoint's reported times are malformed: {pair!r}")
            history[site] = deque(values, maxlen=self.window)
        self._history = history


def robust_time(values: Sequence[float]) -> float:
    """The median of the sites' (capped) times: one site of three or more cannot move it; 0.0
    when there are none (the caller treats 0 as not measured)."""
    return float(statistics.median(values)) if values else 0.0
