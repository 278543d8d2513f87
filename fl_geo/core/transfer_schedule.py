"""Conflict-free transfer schedule between training workers and sharded parameter servers.

Di-PS (NSDI 2026, §4.1 "Communication Coordination in Leader PS", Appendix A) shards the model
over K *follower* parameter servers; each indivisible unit (a layer) has a fixed destination
follower ``dest(l)``. After an outer round, the workers of a training cluster (one per pipeline
stage, holding their contiguous block of layers) all want to push at once, a many-to-many
pattern. If two workers pushed to the same follower at once they would share its inbound link
and both finish late, so the *leader* PS hands out a schedule: an ordered list of steps, each a
set of transfers run in parallel under the **no-conflict** rule "no two transfers of one step
target the same follower".

Each step is built greedily (Appendix A): visit the workers that still have unsent units in the
given order (PP rank order), and give each the earliest of its unsent units whose destination is
still free in this step, deferring the ones that would conflict; a worker sends at most one unit
per step. We implement that prose reading. The formula next to it, ``l = min L_m`` (only the
worker's very first unsent unit is a candidate), does not satisfy the step size
``|W_t| = min(|M_t|, K)`` the appendix states for layers split evenly and contiguously over
workers and followers (e.g. N = 5 layers, M = 3 workers, K = 2 followers), while the prose rule
does for every such split we tried (tests/test_transfer_schedule.py).

The appendix also stresses that new clusters can be added "without re-planning existing
schedules": :class:`TransferScheduler` keeps a live plan and slots a late cluster's transfers
into the free follower slots of the planned steps, leaving every planned transfer where it is.

Everything here is plain Python over small integers (a leader PS control-plane decision), with
no Flower or torch dependency.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Transfer",
    "TransferScheduler",
    "WorkerId",
    "contiguous_dest",
    "greedy_schedule",
    "units_for_workers",
]

# A worker is a pipeline rank (int) or a whole cluster's name (str); anything hashable works.
WorkerId = int | str


@dataclass(frozen=True)
class Transfer:
    """One unit pushed by one worker to its destination follower within a step."""

    worker: WorkerId
    unit: int
    follower: int


# ---- even contiguous partitions (Appendix A's set-up) ---------------------------------------------


def _even_sizes(n: int, parts: int) -> list[int]:
    """Sizes of an even contiguous split: differ by at most 1, the first parts get the extra."""
    if n < 0:
        raise ValueError(f"the number of units must be >= 0, got {n}")
    if parts < 1:
        raise ValueError(f"the number of parts must be >= 1, got {parts}")
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


def contiguous_dest(num_units: int, num_followers: int) -> list[int]:
    """``dest[l]``: units 0..N-1 split evenly and contiguously over K followers.

    This is how Di-PS shards the model (each follower "manages several LLM model layers");
    follower sizes differ by at most one unit and the earlier followers take the extra ones.
    """
    sizes = _even_sizes(num_units, num_followers)
    return list(itertools.chain.from_iterable(itertools.repeat(f, s) for f, s in enumerate(sizes)))


def units_for_workers(num_units: int, num_workers: int) -> list[list[int]]:
    """The units each of a cluster's M workers (PP ranks) holds: an even contiguous split.

    Appendix A assumes pipeline stages of (nearly) equal layer counts; sizes differ by at most
    one and the earlier ranks take the extra units.
    """
    bounds = [0, *itertools.accumulate(_even_sizes(num_units, num_workers))]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


# ---- validation ---------------------------------------------------------------------------------


def _dest_lookup(dest: Mapping[int, int] | Sequence[int], num_followers: int) -> Mapping[int, int]:
    """``dest`` as a mapping unit -> follower, every follower checked to be in 0..K-1.

    All entries are checked (not just the units in use) so that a bad shard map fails when it is
    handed over, not later when some cluster happens to push the bad unit.
    """
    if isinstance(num_followers, bool) or not isinstance(num_followers, int) or num_followers < 1:
        raise ValueError(f"num_followers must be an integer >= 1, got {num_followers!r}")
    table: Mapping[int, int] = dest if isinstance(dest, Mapping) else dict(enumerate(dest))
    for unit, f in table.items():
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < num_followers:
            raise ValueError(
                f"dest of unit {unit} is follower {f!r}, outside 0..{num_followers - 1} "
                f"({num_followers} followers)"
            )
    return table


def _check_units(worker: Hashable, units: Sequence[int], table: Mapping[int, int]) -> list[int]:
    """The worker's units as a list, rejecting unknown and repeated units (naming them)."""
    if isinstance(units, str | bytes):
        raise ValueError(f"worker {worker!r}: units must be a sequence of unit ids, got {units!r}")
    units = list(units)
    unknown = [u for u in units if u not in table]
    if unknown:
        raise ValueError(f"worker {worker!r}: unit {unknown[0]!r} has no destination follower in dest")
    seen: set[int] = set()
    for u in units:
        if u in seen:
            raise ValueError(f"worker {worker!r}: unit {u} is listed twice")
        seen.add(u)
    return units


# ---- the one-shot greedy schedule ----------------------------------------------------------------


def greedy_schedule(
    worker_units: Mapping[WorkerId, Sequence[int]],
    dest: Mapping[int, int] | Sequence[int],
    num_followers: int,
) -> list[list[Transfer]]:
    """Appendix A's greedy no-conflict schedule for workers pushing their ordered units.

    Step by step, the workers are visited in the mapping's order (PP rank order); each worker
    with unsent units takes the earliest of them whose follower is not yet used in the step
    (deferring the conflicting ones), at most one per worker. Within a step the transfers are
    listed in worker order. Properties (tested): no follower twice in a step; every unit of
    every worker exactly once; each worker's units sent in its order except where a conflict
    deferred one; for even contiguous splits, step t carries ``min(|M_t|, K)`` transfers.

    The same unit may appear under several workers (e.g. whole clusters each pushing every
    layer); only a repeat within one worker is an error. Runs in
    ``O(U * K * log M)`` for U units in total: per step, the next worker to send is found by
    bisecting, per free follower, the sorted list of workers that still owe that follower,
    so workers whose every remaining unit is blocked are skipped instead of scanned.
    """
    table = _dest_lookup(dest, num_followers)
    order = list(worker_units)
    # Per worker: follower -> deque of (position in the worker's list, unit), in order.
    queues: list[dict[int, deque[tuple[int, int]]]] = []
    for w in order:
        per_f: dict[int, deque[tuple[int, int]]] = {}
        for pos, u in enumerate(_check_units(w, worker_units[w], table)):
            per_f.setdefault(table[u], deque()).append((pos, u))
        queues.append(per_f)
    # Per follower: sorted indices of the workers that still have units for it.
    owing: list[list[int]] = [[] for _ in range(num_followers)]
    for i, per_f in enumerate(queues):
        for f in per_f:
            owing[f].append(i)  # i ascending: lists stay sorted
    live = {f for f in range(num_followers) if owing[f]}

    steps: list[list[Transfer]] = []
    while live:
        free = set(live)
        step: list[Transfer] = []
        cursor = -1  # index of the last worker visited in this step
        while free:
            # The next worker (after the cursor) owing any free follower is the next one to send.
            nxt = None
            for f in free:
                lst = owing[f]
                k = bisect.bisect_right(lst, cursor)
                if k < len(lst) and (nxt is None or lst[k] < nxt):
                    nxt = lst[k]
            if nxt is None:
                break
            per_f = queues[nxt]
            # Its earliest unit among the free followers' queue heads (<= K candidates).
            _, f = min((q[0][0], g) for g, q in per_f.items() if g in free)
            _, unit = per_f[f].popleft()
            step.append(Transfer(order[nxt], unit, f))
            free.discard(f)
            if not per_f[f]:
                del per_f[f]
                lst = owing[f]
                del lst[bisect.bisect_left(lst, nxt)]
                if not lst:
                    live.discard(f)
            cursor = nxt
        steps.append(step)
    return steps


# ---- the incremental (asynchronous) scheduler --------------------------------------------------


class TransferScheduler:
    """A live schedule that late clusters join without re-planning anyone else's transfers.

    In asynchronous training clusters ask to push at any time (§4.1). Re-planning the whole
    schedule on each arrival could move transfers the leader already told other clusters about,
    so :meth:`add_worker` only fills slots: each of the new worker's units, in order, goes into
    the earliest step *after the step of its previous unit* whose follower is free, and steps are
    appended when none is. Every earlier-planned transfer keeps its step; the no-conflict rule
    holds for the combined plan; the new worker's units stay in its order (one per step).

    This is a sequential first-fit per worker, not Appendix A's step-by-step greedy: batch
    arrivals should be planned together (the ``worker_units`` given here, or
    :func:`greedy_schedule`), which packs steps better.
    """

    def __init__(
        self,
        dest: Mapping[int, int] | Sequence[int],
        num_followers: int,
        worker_units: Mapping[WorkerId, Sequence[int]] | None = None,
    ) -> None:
        self._dest = dict(_dest_lookup(dest, num_followers))  # a copy: the plan must not drift
        self._k = num_followers
        self._steps: list[dict[int, Transfer]] = []  # per step: follower -> transfer
        self._pending: dict[WorkerId, int] = {}  # worker -> planned, not yet popped transfers
        if worker_units:
            for step in greedy_schedule(worker_units, self._dest, num_followers):
                self._steps.append({t.follower: t for t in step})
            for w in worker_units:
                n = len(worker_units[w])
                if n:
                    self._pending[w] = n

    @property
    def num_followers(self) -> int:
        return self._k

    @property
    def steps(self) -> list[list[Transfer]]:
        """The planned steps (a copy), transfers in the order they were planned."""
        return [list(s.values()) for s in self._steps]

    @property
    def workers(self) -> list[WorkerId]:
        """Workers with planned transfers, in the order they were added."""
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._steps)

    def add_worker(self, worker: WorkerId, units: Sequence[int]) -> list[int]:
        """Plan a newly arrived worker's ordered ``units``; returns the step index of each unit.

        Only free slots are used, so nothing planned before moves (see the class docstring).
        Cost ``O(len(steps) + len(units))``: the search for each unit resumes after the step of
        the previous one. A worker that still has planned transfers cannot be added again
        (ValueError); once its transfers are popped or removed it can (its next round).
        """
        if worker in self._pending:
            raise ValueError(f"worker {worker!r} already has planned transfers; remove it first")
        units = _check_units(worker, units, self._dest)
        placed: list[int] = []
        s = 0
        for u in units:
            f = self._dest[u]
            while s < len(self._steps) and f in self._steps[s]:
                s += 1
            if s == len(self._steps):
                self._steps.append({})
            self._steps[s][f] = Transfer(worker, u, f)
            placed.append(s)
            s += 1
        if units:
            self._pending[worker] = len(units)
        return placed

    def remove_worker(self, worker: WorkerId) -> int:
        """Drop a departed worker's planned transfers; returns how many were dropped.

        Steps left empty are deleted; the other transfers keep their relative order and are not
        pulled forward (that would be re-planning). Unknown workers drop nothing.
        """
        if self._pending.pop(worker, None) is None:
            return 0
        dropped = 0
        kept: list[dict[int, Transfer]] = []
        for step in self._steps:
            mine = [f for f, t in step.items() if t.worker == worker]
            for f in mine:
                del step[f]
            dropped += len(mine)
            if step:
                kept.append(step)
        self._steps = kept
        return dropped

    def pop_step(self) -> list[Transfer]:
        """Remove and return the next step to execute (IndexError when nothing is planned)."""
        if not self._steps:
            raise IndexError("pop_step from an empty transfer schedule")
        step = list(self._steps.pop(0).values())
        for t in step:
            self._pending[t.worker] -= 1
            if not self._pending[t.worker]:
                del self._pending[t.worker]
        return step
