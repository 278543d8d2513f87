"""The ``num-examples`` claims of plain Flower replies, judged for one outer loop.

A plain Flower ClientApp weights its update by the example count it declares; nothing caps
that count (fl-geo's own replies are capped by the tokens their job could produce), so one
lying site could own a weighted mean or end a token budget. Every loop judges the claims the
same way (`fl_geo.core.claims.ClaimBound`): against the claims accepted so far, refused beyond
4 × their median; before any was accepted, a synchronous round judges its whole round, and the
asynchronous loops hold their first plain replies until `MIN_PEERS` of them (or every one a
live node can still send) can be judged together. ``strategy.token_cap=none`` trusts every
claim. The accepted claims are part of the loop's checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fl_geo.core.claims import ClaimBound

if TYPE_CHECKING:
    from fl_geo.strategies.base import OuterLoop
    from fl_geo.strategies.replies import Tally, TrainReply

log = logging.getLogger("fl_geo")


class PlainClaims:
    """Judge the plain replies' claims of ``loop`` (refusals are the loop's: logged, counted)."""

    def __init__(self, loop: OuterLoop) -> None:
        self.loop = loop
        self.bound = ClaimBound()

    @property
    def judged(self) -> bool:
        """Whether claims are judged at all: not with ``strategy.token_cap=none``."""
        return self.loop.cfg.strategy.token_cap != "none"

    def awaiting_first(self) -> bool:
        """No claim has been accepted yet to judge a new one against."""
        return self.judged and not self.bound.has_history()

    def holds_first(self, r: TrainReply) -> bool:
        """Whether plain reply ``r`` must wait to be judged with its peers (`awaiting_first`)."""
        return r.plain and self.awaiting_first()

    def judge(self, tally: Tally, items: Sequence[tuple[int, TrainReply]],
              whole_round: bool = False) -> list[tuple[int, TrainReply]]:
        """The items whose claim passes, in their order (the fold's bits depend on it); the
        others are refused. fl-geo replies pass untouched. Against the accepted claims; before
        any, against the items' own claims when ``whole_round`` and they are at least
        `MIN_PEERS`. The passing claims are recorded by partition."""
        if not self.judged:
            return list(items)
        round_claims = [r.tokens for _, r in items if r.plain] if whole_round else []
        kept = []
        for node, r in items:
            reason = self.bound.judge(r.tokens, round_claims) if r.plain else None
            if reason is not None:
                self.loop._reject(tally, node, reason)
                continue
            kept.append((node, r))
        for node, r in kept:
            if r.plain:
                site = self.loop.partition_of(node)  # -1: a node that answered no profile
                self.bound.accepted(site if site >= 0 else f"node {node}", r.tokens)
        return kept

    def judge_first(self, tally: Tally, held: Sequence[tuple[int, TrainReply]]) -> list[bool]:
        """Judge held first claims together; which to keep, in ``held``'s order. Too few to
        outvote a lie, none is refused but none counts for more than their lower median
        (`ClaimBound.cap_few`)."""
        cap = self.bound.cap_few([r.tokens for _, r in held])
        if cap is not None:
            for _, r in held:
                if r.tokens > cap:
                    log.warning("plain claim num-examples=%d counted as %d: nothing accepted yet to judge it "
                                "against, and %d claim(s) this step cannot outvote it", r.tokens, cap, len(held))
                    r.tokens = cap
        kept = {id(r) for _, r in self.judge(tally, held, whole_round=True)}
        return [id(r) in kept for _, r in held]
