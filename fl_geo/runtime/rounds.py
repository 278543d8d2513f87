"""A synchronous round on the dispatcher: push one message per node, hand the good replies over
in groups, and say what happened to every job (`RoundOutcome`).

A round is the special case of the dispatcher's event stream "hand everything over once every job
of the round is resolved", plus the bookkeeping only a round needs: the hand-over order, the
quorum, and where events of other jobs go. It lives apart from `fl_geo.runtime.dispatch`, which
knows single jobs and events only; `Dispatcher.run_jobs` is `run_round` as a method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import Message

from fl_geo.runtime.jobs import TIMED_OUT, Event, JobTiming

if TYPE_CHECKING:
    from fl_geo.runtime.dispatch import Dispatcher

__all__ = ["RoundOutcome", "run_round"]


@dataclass
class RoundOutcome:
    """What happened to the jobs of one synchronous round."""

    replied: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    vanished: list[int] = field(default_factory=list)
    timed_out: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # still in flight when the quorum came


def _hand_over(queue: list[int], resolved: dict[int, Message | None], outcome: RoundOutcome,
               on_replies: Callable[[Sequence[tuple[int, Message]]], None]) -> None:
    """Pass on, as one group, the good replies of the resolved nodes at the head of ``queue``.

    Stops at the first node in ``queue`` that has not resolved yet; the nodes passed are taken
    off ``queue`` and ``resolved``, and those with a reply are added to ``outcome.replied``.
    """
    group: list[tuple[int, Message]] = []
    while queue and queue[0] in resolved:
        nid = queue.pop(0)
        reply = resolved.pop(nid)
        if reply is not None:
            group.append((nid, reply))
            outcome.replied.append(nid)
    if group:
        on_replies(group)


def _record_event(ev: Event, remaining: set[str], resolved: dict[int, Message | None],
                  outcome: RoundOutcome) -> None:
    """Note a resolved job of this round: no longer remaining, its fault (if any) in ``outcome``,
    and its reply (None unless it succeeded) in ``resolved``."""
    remaining.discard(ev.job.id)
    if ev.error == "vanished":
        outcome.vanished.append(ev.job.node)
    elif ev.error == TIMED_OUT:
        outcome.timed_out.append(ev.job.node)
    elif ev.error is not None:
        outcome.errors[ev.job.node] = ev.error
    resolved[ev.job.node] = ev.reply if ev.ok else None


def run_round(
    dispatcher: Dispatcher,
    messages: list[Message],
    on_replies: Callable[[Sequence[tuple[int, Message]]], None],
    order: list[int] | None,
    timeout_s: float = 0.0,
    timings: Sequence[JobTiming] | None = None,
    meta: Sequence[dict[str, Any]] | None = None,
    quorum: int = 0,
    on_late: Callable[[Event], None] | None = None,
    keep_foreign: bool = False,
) -> RoundOutcome:
    """A synchronous round: push one message per node, hand good replies over in groups.

    A group is every reply that can be handed over at once: the strategy folds a group in one
    pass over its buffers, several times cheaper than one pass per reply. ``order`` lists the
    nodes in hand-over order: a reply that resolves early waits until every node before it
    has replied or failed (deterministic folding whatever the clock). ``None`` hands replies
    over in clock order. ``timeout_s`` > 0 (wall seconds) abandons jobs still running then;
    0 leaves each job to the dispatcher's deadline rule (`Dispatcher.deadline_s`; no rule: no
    limit). A job given up at its deadline is listed in ``outcome.timed_out``.

    ``quorum`` > 0: the round ends as soon as that many replies came (in clock order; with a
    virtual clock, at the quorum-th modelled finish time); the other jobs stay in flight,
    their nodes busy, and are listed in ``outcome.pending``. Their events come in a later
    round and go to ``on_late`` (dropped when None), as do those of any job not of this round.
    ``keep_foreign``: events of jobs not of this round are kept instead, in order, and handed
    over by the dispatcher's next `Dispatcher.next_event` calls (a profile probe or query in the
    middle of an asynchronous run must not lose the replies that come meanwhile).
    """
    jobs = dispatcher.submit(messages, timings, meta, timeout_s=timeout_s)
    outcome = RoundOutcome()
    queue = [j.node for j in jobs] if order is None else list(order)
    resolved: dict[int, Message | None] = {}
    remaining = {j.id for j in jobs}
    replies = 0
    foreign: list[Event] = []
    while remaining and not (quorum and replies >= quorum):
        ev = dispatcher.next_event(block=False)
        if ev is not None and ev.job.id not in remaining:  # a job of an earlier round
            if keep_foreign:
                foreign.append(ev)
            elif on_late is not None:
                on_late(ev)
            continue
        if ev is None:
            _hand_over(queue, resolved, outcome, on_replies)
            dispatcher.pause()
            continue
        _record_event(ev, remaining, resolved, outcome)
        replies += int(ev.ok)
        if order is None:
            queue.sort(key=lambda n: n not in resolved)  # clock order (stable sort)
    if remaining:  # the quorum came first: the rest are late, their nodes stay busy
        pending = {j.node for j in jobs if j.id in remaining}
        outcome.pending = sorted(pending)
        queue[:] = [n for n in queue if n not in pending]
    _hand_over(queue, resolved, outcome, on_replies)
    dispatcher.hand_over_next(foreign)
    return outcome
