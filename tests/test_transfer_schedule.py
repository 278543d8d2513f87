"""Di-PS Appendix A greedy no-conflict transfer schedule (fl_geo/core/transfer_schedule.py)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from fl_geo.core.transfer_schedule import (
    Transfer,
    TransferScheduler,
    contiguous_dest,
    greedy_schedule,
    units_for_workers,
)

T = Transfer


def reference_greedy(worker_units: Mapping, dest: Sequence[int] | Mapping[int, int]) -> list[list[Transfer]]:
    """Appendix A's prose, written as plainly as possible (quadratic; for cross-checking)."""
    remaining = {w: list(us) for w, us in worker_units.items()}
    steps = []
    while any(remaining.values()):
        used: set[int] = set()
        step = []
        for w, us in remaining.items():
            for u in us:
                if dest[u] not in used:
                    used.add(dest[u])
                    step.append(T(w, u, dest[u]))
                    us.remove(u)
                    break
        steps.append(step)
    return steps


def appendix_a(n: int, m: int, k: int) -> tuple[dict[int, list[int]], list[int]]:
    """N layers split evenly and contiguously over M workers (PP ranks) and over K followers."""
    return dict(enumerate(units_for_workers(n, m))), contiguous_dest(n, k)


def check_schedule(steps: list[list[Transfer]], worker_units: Mapping, dest) -> None:
    """The invariants every schedule must satisfy."""
    for step in steps:
        assert step, "no empty steps"
        followers = [t.follower for t in step]
        assert len(followers) == len(set(followers)), f"follower used twice in {step}"
        workers = [t.worker for t in step]
        assert len(workers) == len(set(workers)), f"worker sends twice in {step}"
        assert all(t.follower == dest[t.unit] for t in step)
    sent = sorted((str(t.worker), t.unit) for s in steps for t in s)
    expected = sorted((str(w), u) for w, us in worker_units.items() for u in us)
    assert sent == expected, "every unit of every worker exactly once"


def step_of(steps: list[list[Transfer]]) -> dict[tuple, int]:
    return {(t.worker, t.unit): i for i, s in enumerate(steps) for t in s}


# ---- partitions ---------------------------------------------------------------------------------


def test_contiguous_dest_is_even_and_contiguous():
    assert contiguous_dest(10, 4) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert contiguous_dest(4, 4) == [0, 1, 2, 3]
    assert contiguous_dest(2, 4) == [0, 1]  # more followers than units: the last ones idle
    assert contiguous_dest(0, 3) == []
    for n, k in [(96, 16), (97, 16), (5, 3), (1, 1)]:
        d = contiguous_dest(n, k)
        sizes = [d.count(f) for f in range(k)]
        assert len(d) == n and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True) and d == sorted(d)


def test_units_for_workers_is_even_and_contiguous():
    assert units_for_workers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert units_for_workers(2, 3) == [[0], [1], []]
    assert sum(units_for_workers(97, 8), []) == list(range(97))


@pytest.mark.parametrize("bad", [(-1, 2), (4, 0)])
def test_partitions_reject_bad_sizes(bad):
    with pytest.raises(ValueError):
        contiguous_dest(*bad)
    with pytest.raises(ValueError):
        units_for_workers(*bad)


# ---- hand-checked examples ----------------------------------------------------------------------


def test_hand_checked_example_defers_conflicting_units():
    # N=5 layers, M=3 PP ranks, K=2 followers. Workers: 0 -> [0, 1], 1 -> [2, 3], 2 -> [4];
    # dest = [0, 0, 0, 1, 1]: worker 0 owes f0 f0, worker 1 owes f0 f1, worker 2 owes f1.
    wu, dest = appendix_a(5, 3, 2)
    assert wu == {0: [0, 1], 1: [2, 3], 2: [4]} and dest == [0, 0, 0, 1, 1]
    assert greedy_schedule(wu, dest, 2) == [
        # w0 takes f0; w1's unit 2 wants f0 (taken): deferred, unit 3 goes to f1; w2 (f1) waits.
        [T(0, 0, 0), T(1, 3, 1)],
        # w0 f0 again; w1's unit 2 is still blocked on f0; w2 now gets f1.
        [T(0, 1, 0), T(2, 4, 1)],
        [T(1, 2, 0)],
    ]
    # Step sizes min(|M_t|, K): 3 workers -> 2, 3 -> 2, 1 -> 1. Taking only each worker's very
    # first unsent unit (the appendix formula read literally) would give step 1 = [w0, w2] and
    # step 2 = [w0] alone (w1's unit 2 blocked behind f0), one transfer below min(2, 2).


def test_hand_checked_example_with_named_clusters_and_mapping_dest():
    # Two whole clusters each push layers 10, 11, 12 (shards f0, f1, f2), A before B.
    dest = {10: 0, 11: 1, 12: 2}
    assert greedy_schedule({"A": [10, 11, 12], "B": [10, 11, 12]}, dest, 3) == [
        [T("A", 10, 0), T("B", 11, 1)],
        [T("A", 11, 1), T("B", 10, 0)],
        [T("A", 12, 2)],
        [T("B", 12, 2)],
    ]


def test_empty_inputs_give_an_empty_schedule():
    assert greedy_schedule({}, [0, 1], 2) == []
    assert greedy_schedule({0: [], 1: []}, [0, 1], 2) == []


def test_one_follower_serialises_everything_in_worker_order():
    steps = greedy_schedule({0: [0, 1], 1: [2]}, [0, 0, 0], 1)
    assert steps == [[T(0, 0, 0)], [T(0, 1, 0)], [T(1, 2, 0)]]


# ---- Appendix A properties ----------------------------------------------------------------------

COMBOS = [  # (N layers, M workers, K followers)
    (16, 4, 4), (96, 8, 8),  # M = K
    (16, 2, 4), (96, 4, 16), (7, 1, 3), (10, 3, 4),  # M < K
    (16, 8, 2), (96, 64, 16), (7, 5, 3), (5, 3, 2), (9, 6, 4),  # M > K
    (3, 5, 2), (2, 2, 5),  # workers / followers without units
]


@pytest.mark.parametrize(("n", "m", "k"), COMBOS, ids=[f"N{n}-M{m}-K{k}" for n, m, k in COMBOS])
def test_appendix_a_properties(n, m, k):
    wu, dest = appendix_a(n, m, k)
    steps = greedy_schedule(wu, dest, k)
    check_schedule(steps, wu, dest)
    assert steps == reference_greedy(wu, dest)
    remaining = {w: len(us) for w, us in wu.items()}
    for step in steps:
        active = sum(1 for r in remaining.values() if r)
        assert len(step) == min(active, k), "|W_t| = min(|M_t|, K)"
        for t in step:
            remaining[t.worker] -= 1
    # Transfers within a step are listed in worker (PP rank) order.
    for step in steps:
        assert [t.worker for t in step] == sorted(t.worker for t in step)


def test_step_size_property_over_a_sweep():
    """|W_t| = min(|M_t|, K) for every even contiguous split with N <= 24, M, K <= 12."""
    for n in range(1, 25):
        for m in range(1, 13):
            for k in range(1, 13):
                wu, dest = appendix_a(n, m, k)
                remaining = {w: len(us) for w, us in wu.items()}
                for step in greedy_schedule(wu, dest, k):
                    active = sum(1 for r in remaining.values() if r)
                    assert len(step) == min(active, k), (n, m, k)
                    for t in step:
                        remaining[t.worker] -= 1


@pytest.mark.parametrize("seed", range(20))
def test_order_and_deferral_on_random_inputs(seed):
    """Matches the plain reference; a worker's units leave in order except for deferrals.

    Per follower, a worker's units are sent in its order. A unit can overtake an earlier one of
    the same worker only when the earlier one's follower was already taken in that step by a
    worker visited before (the appendix's "deferring the conflicting layers").
    """
    rng = random.Random(seed)
    k = rng.randint(1, 6)
    n = rng.randint(1, 40)
    dest = [rng.randrange(k) for _ in range(n)]
    wu = {f"w{i}": rng.sample(range(n), rng.randint(0, n)) for i in range(rng.randint(1, 8))}
    steps = greedy_schedule(wu, dest, k)
    check_schedule(steps, wu, dest)
    assert steps == reference_greedy(wu, dest)
    at = step_of(steps)
    for w, us in wu.items():
        for i, u in enumerate(us):
            for v in us[:i]:  # v comes before u in w's order
                if at[(w, u)] < at[(w, v)]:
                    s = steps[at[(w, u)]]
                    pos = [t.worker for t in s].index(w)
                    assert dest[v] != dest[u]
                    assert dest[v] in {t.follower for t in s[:pos]}, (w, v, u)


def test_large_schedules_run_fast_enough():
    """No quadratic blow-up: these finish in well under a second (not timed, just run)."""
    # Appendix A: 96 layers over 64 PP ranks and 16 followers.
    wu, dest = appendix_a(96, 64, 16)
    check_schedule(greedy_schedule(wu, dest, 16), wu, dest)
    # 64 clusters each pushing all 96 layers (6,144 transfers), and 10,240 layers over 64 ranks.
    dest = contiguous_dest(96, 16)
    wu = {c: list(range(96)) for c in range(64)}
    steps = greedy_schedule(wu, dest, 16)
    assert len(steps) == 64 * 96 // 16  # every step uses every follower
    wu, dest = appendix_a(10_240, 64, 16)
    check_schedule(greedy_schedule(wu, dest, 16), wu, dest)
    sched = TransferScheduler(dest, 16)
    for c in range(64):
        sched.add_worker(c, list(range(c * 160, (c + 1) * 160)))
    assert sum(len(s) for s in sched.steps) == 10_240


# ---- validation ---------------------------------------------------------------------------------


def test_unknown_unit_is_named():
    with pytest.raises(ValueError, match="unit 7 has no destination"):
        greedy_schedule({0: [0, 7]}, [0, 1], 2)
    with pytest.raises(ValueError, match="unit 7 has no destination"):
        greedy_schedule({0: [7]}, {0: 0}, 2)


def test_dest_out_of_range():
    with pytest.raises(ValueError, match="dest of unit 1 is follower 2"):
        greedy_schedule({0: [0]}, [0, 2], 2)
    with pytest.raises(ValueError, match="follower -1"):
        greedy_schedule({0: [0]}, {0: -1}, 2)
    with pytest.raises(ValueError, match="num_followers"):
        greedy_schedule({0: [0]}, [0], 0)


def test_duplicate_unit_within_a_worker():
    with pytest.raises(ValueError, match="worker 'a': unit 1 is listed twice"):
        greedy_schedule({"a": [0, 1, 1]}, [0, 1], 2)
    # The same unit under different workers is fine (clusters each push every layer).
    assert len(greedy_schedule({"a": [0], "b": [0]}, [0], 1)) == 2


# ---- incremental scheduler ----------------------------------------------------------------------


def test_add_worker_hand_checked():
    sched = TransferScheduler([0, 1, 2], 3, {"A": [0, 1, 2]})
    assert sched.steps == [[T("A", 0, 0)], [T("A", 1, 1)], [T("A", 2, 2)]]
    # B's unit 0 (f0) cannot join step 0 (A uses f0): step 1; unit 1 (f1) then step 2; unit 2
    # (f2) finds no free f2 after step 2: a new step.
    assert sched.add_worker("B", [0, 1, 2]) == [1, 2, 3]
    assert sched.steps == [
        [T("A", 0, 0)],
        [T("A", 1, 1), T("B", 0, 0)],
        [T("A", 2, 2), T("B", 1, 1)],
        [T("B", 2, 2)],
    ]
    assert sched.workers == ["A", "B"] and len(sched) == 4


@pytest.mark.parametrize("seed", range(10))
def test_add_worker_never_moves_planned_transfers(seed):
    rng = random.Random(seed)
    n, k = rng.randint(4, 40), rng.randint(1, 6)
    dest = contiguous_dest(n, k) if seed % 2 else [rng.randrange(k) for _ in range(n)]
    base = dict(enumerate(units_for_workers(n, rng.randint(1, 8))))
    sched = TransferScheduler(dest, k, base)
    assert sched.steps == greedy_schedule(base, dest, k)
    everyone = dict(base)
    for c in range(3):
        before = sched.steps
        units = rng.sample(range(n), rng.randint(1, n))
        placed = sched.add_worker(f"late{c}", units)
        after = sched.steps
        for i, step in enumerate(before):
            assert [t for t in after[i] if not str(t.worker).startswith(f"late{c}")] == step
        assert placed == sorted(placed) and len(set(placed)) == len(placed), "in order, one per step"
        assert [after[s][-1] for s in placed] == [T(f"late{c}", u, dest[u]) for u in units]
        everyone[f"late{c}"] = units
        check_schedule(after, everyone, dest)


def test_add_worker_fills_free_slots_first():
    # A uses f0 in steps 0..3; a late B pushing to f1 fits into the existing steps.
    sched = TransferScheduler([0, 0, 0, 0, 1, 1], 2, {"A": [0, 1, 2, 3]})
    assert sched.add_worker("B", [4, 5]) == [0, 1]
    assert len(sched) == 4


def test_pop_remove_and_rejoin():
    sched = TransferScheduler([0, 1], 2, {"A": [0, 1]})
    sched.add_worker("B", [0, 1])
    with pytest.raises(ValueError, match="already has planned transfers"):
        sched.add_worker("B", [0])
    assert sched.pop_step() == [T("A", 0, 0)]
    assert sched.remove_worker("B") == 2
    assert sched.remove_worker("B") == 0
    assert sched.steps == [[T("A", 1, 1)]]  # B's step (and the one it shared with A) compacted
    assert sched.pop_step() == [T("A", 1, 1)]
    assert sched.workers == [] and len(sched) == 0
    with pytest.raises(IndexError):
        sched.pop_step()
    assert sched.add_worker("A", [1, 0]) == [0, 1]  # A's next round
    assert sched.add_worker("C", []) == [] and sched.workers == ["A"]


def test_remove_keeps_other_transfers_in_place_relative_order():
    sched = TransferScheduler(contiguous_dest(8, 2), 2, dict(enumerate(units_for_workers(8, 4))))
    before = sched.steps
    sched.remove_worker(1)
    after = sched.steps
    expected = [[t for t in s if t.worker != 1] for s in before]
    assert after == [s for s in expected if s]


def test_scheduler_validates_like_greedy_schedule():
    with pytest.raises(ValueError, match="follower 3"):
        TransferScheduler([0, 3], 2)
    sched = TransferScheduler([0, 1], 2)
    with pytest.raises(ValueError, match="unit 5 has no destination"):
        sched.add_worker("x", [5])
    with pytest.raises(ValueError, match="listed twice"):
        sched.add_worker("x", [0, 0])
    assert sched.workers == [] and sched.steps == []
