"""Streaming DiLoCo / CoCoDC building blocks (fl_geo/core/streaming.py, docs/algorithms.md §7)."""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.config import load_config
from fl_geo.core.outer import OUTER_OPTIMIZERS, build_outer_optimizer
from fl_geo.core.state import ParamSpec
from fl_geo.core.streaming import (
    AdaptiveSchedule,
    FixedSchedule,
    FragmentOuterOptimizers,
    Fragments,
    cocodc_compensate,
    fixed_schedule,
    streaming_merge,
)
from fl_geo.runtime.builders import make_model

N_LAYERS = 8


@pytest.fixture(scope="module")
def spec() -> ParamSpec:
    cfg = load_config(None, [f"model.n_layers={N_LAYERS}", "model.d_model=32", "model.n_heads=2",
                             "model.max_seq_len=32", "client.seq_len=32"])
    return ParamSpec.from_state_dict(make_model(cfg.model, 0).state_dict())


def _owner(fragments: Fragments, numel: int) -> torch.Tensor:
    """Per element: how many fragments claim it (built from the ranges, vectorised)."""
    count = torch.zeros(numel, dtype=torch.int64)
    for p in range(fragments.num_fragments):
        for b, e in fragments.ranges(p):
            count[b:e] += 1
    return count


# -- Fragments -------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_fragments_strided_assignment_and_exact_partition(spec: ParamSpec, P: int) -> None:
    frags = Fragments.from_spec(spec, P)
    assert frags.num_fragments == P and frags.num_blocks == N_LAYERS
    for i in range(N_LAYERS):
        assert frags.of_block(i) == i % P
        for name in spec.names:
            if name.startswith(f"blocks.{i}."):
                assert name in frags.names(i % P)
    assert "embed.weight" in frags.names(0)
    assert "norm.weight" in frags.names(P - 1)
    # Every parameter named exactly once; every element in exactly one fragment.
    all_names = [n for p in range(P) for n in frags.names(p)]
    assert sorted(all_names) == sorted(spec.names)
    assert torch.equal(_owner(frags, spec.numel), torch.ones(spec.numel, dtype=torch.int64))
    assert sum(frags.numel(p) for p in range(P)) == spec.numel
    for p in range(P):
        ranges = frags.ranges(p)
        assert ranges == sorted(ranges)
        # merged: no two ranges touch
        assert all(e0 < b1 for (_, e0), (b1, _) in zip(ranges, ranges[1:], strict=False))
        assert frags.numel(p) == sum(e - b for b, e in ranges)


def test_fragments_range_counts(spec: ParamSpec) -> None:
    # P = 1 is one contiguous range; with P = 8 embedding + block 0 merge, block 7 + norm merge.
    assert Fragments.from_spec(spec, 1).ranges(0) == [(0, spec.numel)]
    f8 = Fragments.from_spec(spec, 8)
    assert all(len(f8.ranges(p)) == 1 for p in range(8))
    assert f8.ranges(0)[0][0] == 0 and f8.ranges(7)[-1][1] == spec.numel
    f2 = Fragments.from_spec(spec, 2)
    assert len(f2.ranges(0)) == 4 and len(f2.ranges(1)) == 4


@pytest.mark.parametrize("P", [0, 9, -1])
def test_fragments_reject_bad_counts(spec: ParamSpec, P: int) -> None:
    with pytest.raises(ValueError):
        Fragments.from_spec(spec, P)


def test_fragments_without_blocks_raise() -> None:
    spec = ParamSpec(("embed.weight", "norm.weight"), ((4, 2), (2,)), ("float32", "float32"))
    with pytest.raises(ValueError):
        Fragments.from_spec(spec, 1)


def test_fragments_nonblock_placement_generic_names() -> None:
    # Another container name, an untied head after the last block, a module between blocks.
    names = ("wte.weight", "h.0.w", "h.1.w", "mid.w", "h.2.w", "ln_f.weight", "lm_head.weight")
    spec = ParamSpec(names, tuple((3,) for _ in names), tuple("float32" for _ in names))
    frags = Fragments.from_spec(spec, 2)
    assert frags.names(0) == ["wte.weight", "h.0.w", "h.2.w"]
    assert frags.names(1) == ["h.1.w", "mid.w", "ln_f.weight", "lm_head.weight"]
    assert frags.ranges(0) == [(0, 6), (12, 15)]
    assert frags.ranges(1) == [(6, 12), (15, 21)]


@pytest.mark.parametrize("P", [1, 3, 4])
def test_gather_scatter_round_trip(spec: ParamSpec, P: int) -> None:
    frags = Fragments.from_spec(spec, P)
    flat = torch.randn(spec.numel)
    pieces = [frags.gather(flat, p) for p in range(P)]
    for p, piece in enumerate(pieces):
        assert piece.shape == (frags.numel(p),)
        assert piece.data_ptr() != flat.data_ptr()
        expected = torch.cat([flat[b:e] for b, e in frags.ranges(p)])
        assert torch.equal(piece, expected)
    rebuilt = torch.full_like(flat, float("nan"))
    for p, piece in enumerate(pieces):
        assert frags.scatter_(rebuilt, p, piece) is rebuilt
    assert torch.equal(rebuilt, flat)
    # Scatter touches only its own fragment.
    target = flat.clone()
    frags.scatter_(target, 0, torch.zeros(frags.numel(0)))
    mask = torch.zeros(spec.numel, dtype=torch.bool)
    for b, e in frags.ranges(0):
        mask[b:e] = True
    assert torch.equal(target[~mask], flat[~mask]) and bool((target[mask] == 0).all())
    with pytest.raises(ValueError):
        frags.scatter_(target, 0, torch.zeros(frags.numel(0) + 1))
    with pytest.raises(ValueError):
        frags.gather(flat[:-1], 0)
    with pytest.raises(ValueError):
        frags.gather(flat, P)


# -- FragmentOuterOptimizers -----------------------------------------------------------------


def _run_fragmented(frags: Fragments, name: str, theta: torch.Tensor,
                    deltas: list[torch.Tensor], **kw: float) -> torch.Tensor:
    opts = FragmentOuterOptimizers(frags, name, **kw)
    out = theta.clone()
    for delta in deltas:
        for p in range(frags.num_fragments):
            g = frags.gather(out, p)
            opts.step(p, g, frags.gather(delta, p))
            frags.scatter_(out, p, g)
    return out


def _run_full(name: str, theta: torch.Tensor, deltas: list[torch.Tensor],
              **kw: float) -> torch.Tensor:
    opt = build_outer_optimizer(name, theta.numel(), **kw)
    out = theta.clone()
    for delta in deltas:
        opt.step(out, delta)
    return out


@pytest.mark.parametrize("name", sorted(OUTER_OPTIMIZERS))
def test_single_fragment_equals_full_model_step(spec: ParamSpec, name: str) -> None:
    frags = Fragments.from_spec(spec, 1)
    theta = torch.randn(spec.numel)
    deltas = [torch.randn(spec.numel) * 0.01 for _ in range(3)]
    assert torch.equal(_run_fragmented(frags, name, theta, deltas),
                       _run_full(name, theta, deltas))


@pytest.mark.parametrize("P", [2, 4, 8])
def test_fragmented_nesterov_equals_full_step(spec: ParamSpec, P: int) -> None:
    frags = Fragments.from_spec(spec, P)
    theta = torch.randn(spec.numel)
    deltas = [torch.randn(spec.numel) * 0.01 for _ in range(3)]
    full = _run_full("nesterov", theta, deltas, lr=0.7, momentum=0.9)
    torch.testing.assert_close(
        _run_fragmented(frags, "nesterov", theta, deltas, lr=0.7, momentum=0.9), full,
        rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(set(OUTER_OPTIMIZERS) - {"nesterov"}))
def test_fragmented_other_optimizers_equal_full_step(spec: ParamSpec, name: str) -> None:
    # Elementwise too; pinned to fp32 rounding only, since a vectorised kernel's scalar tail
    # (which moves with the fragment boundaries) may round sqrt differently on some CPUs.
    frags = Fragments.from_spec(spec, 4)
    theta = torch.randn(spec.numel)
    deltas = [torch.randn(spec.numel) * 0.01 for _ in range(3)]
    torch.testing.assert_close(_run_fragmented(frags, name, theta, deltas),
                               _run_full(name, theta, deltas))


def test_fragment_states_are_independent(spec: ParamSpec) -> None:
    frags = Fragments.from_spec(spec, 4)
    opts = FragmentOuterOptimizers(frags, "nesterov")
    g = frags.gather(torch.randn(spec.numel), 2)
    opts.step(2, g, torch.ones_like(g))
    assert opts.optimizer(2).steps == 1
    assert all(opts.optimizer(p).steps == 0 for p in (0, 1, 3))
    assert "momentum_buffer" not in opts.state_dict()["fragments"][0]
    with pytest.raises(ValueError):
        opts.step(0, g, torch.ones_like(g))  # fragment 0 (with the embedding) is larger


def test_fragment_optimizers_state_round_trip_and_atomic_load(spec: ParamSpec) -> None:
    frags = Fragments.from_spec(spec, 4)
    opts = FragmentOuterOptimizers(frags, "nesterov", lr=0.7, momentum=0.9)
    theta = torch.randn(spec.numel)
    for p in range(4):
        g = frags.gather(theta, p)
        opts.step(p, g, torch.randn_like(g))
    saved = opts.state_dict()
    snapshot = {**saved, "fragments": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in s.items()} for s in saved["fragments"]]}
    restored = FragmentOuterOptimizers(frags, "nesterov", lr=0.7, momentum=0.9)
    restored.load_state_dict(snapshot)
    for p in range(4):
        a, b = opts.optimizer(p).state_dict(), restored.optimizer(p).state_dict()
        assert a["steps"] == b["steps"] == 1
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])

    # A bad state for the last fragment leaves every fragment (including 0..2) untouched.
    fresh = FragmentOuterOptimizers(frags, "nesterov", lr=0.7, momentum=0.9)
    bad = {**snapshot, "fragments": list(snapshot["fragments"])}
    bad["fragments"][3] = {**bad["fragments"][3], "momentum_buffer": torch.zeros(3)}
    with pytest.raises(ValueError, match="fragment 3"):
        fresh.load_state_dict(bad)
    assert all(fresh.optimizer(p).steps == 0 for p in range(4))
    with pytest.raises(ValueError):
        fresh.load_state_dict({**snapshot, "name": "fedadam"})
    with pytest.raises(ValueError):
        fresh.load_state_dict({**snapshot, "fragments": snapshot["fragments"][:3]})


# -- merges ----------------------------------------------------------------------------------


def test_streaming_merge_endpoints_and_midpoint() -> None:
    local, glob = torch.randn(1000), torch.randn(1000)
    assert torch.equal(streaming_merge(local, glob, 1.0), glob)
    assert torch.equal(streaming_merge(local, glob, 0.0), local)
    torch.testing.assert_close(streaming_merge(local, glob, 0.25), 0.75 * local + 0.25 * glob)
    out = streaming_merge(local, glob, 0.5)
    assert out.data_ptr() not in (local.data_ptr(), glob.data_ptr())
    for alpha in (-0.1, 1.5):
        with pytest.raises(ValueError):
            streaming_merge(local, glob, alpha)
    with pytest.raises(ValueError):
        streaming_merge(local, glob[:-1], 0.5)


def test_cocodc_lambda_zero_is_global_plus_progress() -> None:
    start, now, glob = torch.randn(4096), torch.randn(4096), torch.randn(4096)
    copies = [t.clone() for t in (start, now, glob)]
    out = cocodc_compensate(start, now, glob, tau=5, H=100, lam=0.0)
    assert torch.equal(out, glob + (now - start))
    # Inputs untouched.
    assert all(torch.equal(a, b) for a, b in zip((start, now, glob), copies, strict=True))


def test_cocodc_matches_literal_formula() -> None:
    start, now, glob = torch.randn(4096), torch.randn(4096), torch.randn(4096)
    tau, H, lam = 5, 100, 0.5
    r = (now - start) / tau
    D = glob - start
    literal = glob + tau * (r - lam * r * r * D / H)
    torch.testing.assert_close(cocodc_compensate(start, now, glob, tau, H, lam), literal)


def _rc(start: torch.Tensor, now: torch.Tensor, glob: torch.Tensor, tau: float, H: float,
        lam: float) -> torch.Tensor:
    """r_c recovered from the returned fragment: (result − θ^g)/τ."""
    return (cocodc_compensate(start, now, glob, tau, H, lam) - glob) / tau


def test_cocodc_correction_sign() -> None:
    tau, H, lam = 4, 10, 0.5
    start = torch.tensor([0.0, 1.0, -2.0])
    now = start + torch.tensor([0.4, 0.8, 1.2])          # r = (now − start)/τ > 0
    r = (now - start) / tau
    glob_ahead = start + torch.tensor([1.0, 2.0, 3.0])  # D > 0
    glob_behind = start - torch.tensor([1.0, 2.0, 3.0])  # D < 0
    assert bool((_rc(start, now, glob_ahead, tau, H, lam) < r).all())
    assert bool((_rc(start, now, glob_behind, tau, H, lam) > r).all())
    # r < 0 with D > 0: r² > 0, so r_c < r as well (correction ∝ r⊙r⊙D).
    now_back = start - torch.tensor([0.4, 0.8, 1.2])
    r_back = (now_back - start) / tau
    assert bool((_rc(start, now_back, glob_ahead, tau, H, lam) < r_back).all())


def test_cocodc_hand_computed() -> None:
    # τ = 2, H = 4, λ = 0.5: d = [2, −2, 0], r = [1, −1, 0], D = [4, −4, 3],
    # r_c = r − 0.5·r²·D/4 = [0.5, −0.5, 0], result = θ^g + 2·r_c = [5, −4, 5].
    start = torch.tensor([0.0, 1.0, 2.0])
    now = torch.tensor([2.0, -1.0, 2.0])
    glob = torch.tensor([4.0, -3.0, 5.0])
    out = cocodc_compensate(start, now, glob, tau=2, H=4, lam=0.5)
    assert torch.equal(out, torch.tensor([5.0, -4.0, 5.0]))


@pytest.mark.parametrize("kw", [{"tau": 0.5}, {"H": 0}, {"lam": -0.1}, {"tau": math.inf}])
def test_cocodc_rejects_bad_scalars(kw: dict[str, float]) -> None:
    args = {"tau": 5, "H": 100, "lam": 0.5, **kw}
    t = torch.zeros(3)
    with pytest.raises(ValueError):
        cocodc_compensate(t, t, t, **args)


def test_cocodc_rejects_bad_tensors() -> None:
    t = torch.zeros(3)
    with pytest.raises(ValueError):
        cocodc_compensate(t, torch.zeros(4), t, 5, 100, 0.5)
    with pytest.raises(ValueError):
        cocodc_compensate(t, t.double(), t, 5, 100, 0.5)
    with pytest.raises(ValueError):
        cocodc_compensate(t, torch.tensor([0.0, float("nan"), 0.0]), t, 5, 100, 0.5)
    with pytest.raises(ValueError):
        cocodc_compensate(t, t, torch.tensor([0.0, float("inf"), 0.0]), 5, 100, 0.5)


# -- fixed schedule --------------------------------------------------------------------------


def test_fixed_schedule_paper_setup() -> None:
    sched = fixed_schedule(4, 100, 5)
    assert sched == [(0, 20, 25), (1, 45, 50), (2, 70, 75), (3, 95, 100)]
    assert fixed_schedule(4, 100, 0) == [(0, 25, 25), (1, 50, 50), (2, 75, 75), (3, 100, 100)]


@pytest.mark.parametrize("args", [(3, 100, 5), (4, 100, 25), (4, 100, -1), (0, 100, 0),
                                  (4, 100, 2.0)])
def test_fixed_schedule_rejects(args: tuple) -> None:
    with pytest.raises(ValueError):
        fixed_schedule(*args)


# -- adaptive schedule -----------------------------------------------------------------------


def test_adaptive_capacity_paper_setup() -> None:
    sched = AdaptiveSchedule(4, 100, gamma=0.4)
    assert sched.syncs_per_period(0.2, 1.0) == 8  # ⌊0.4·100·0.2⌋ = 8
    assert sched.syncs_per_period(1.0, 5.0) == 8  # a sync lasts τ = 5 steps
    assert sched.interval(0.2, 1.0) == 12  # ⌊100/8⌋
    # N never below P, even when the network is slow.
    assert sched.syncs_per_period(1.0, 1000.0) == 4
    assert sched.interval(1.0, 1000.0) == 25
    # h never below 1.
    assert sched.syncs_per_period(1000.0, 1.0) == 40000
    assert sched.interval(1000.0, 1.0) == 1
    # Exact floor of decimal inputs: the float 0.29·100 is 28.999999999999996.
    assert AdaptiveSchedule(4, 100, gamma=0.29).syncs_per_period(1.0, 1.0) == 29
    for bad in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            sched.syncs_per_period(*bad)
    for gamma in (0.0, 1.5):
        with pytest.raises(ValueError):
            AdaptiveSchedule(4, 100, gamma=gamma)


def test_adaptive_first_choices_in_index_order() -> None:
    sched = AdaptiveSchedule(4, 100)
    # All R = ∞ before the first sync: ties by lowest index, skipping in-flight ones.
    assert sched.choose(0, set()) == 0
    assert sched.choose(0, {0}) == 1
    assert sched.choose(12, {0, 1}) == 2
    assert sched.choose(24, {0, 1, 2}) == 3
    assert sched.choose(36, {0, 1, 2, 3}) is None
    # Once fragment 0 completes, the never-synced ones (∞) still win.
    sched.completed(0, 5, 10.0)
    assert sched.choose(40, set()) == 1


def test_adaptive_largest_rate_wins() -> None:
    sched = AdaptiveSchedule(4, 100)
    for p, (t, norm) in enumerate([(10, 1.0), (20, 8.0), (30, 3.0), (40, 3.0)]):
        sched.completed(p, t, norm)
    # t = 50: R = [1/40, 8/30, 3/20, 3/10] -> fragment 3.
    assert sched.rates(50) == pytest.approx([1 / 40, 8 / 30, 3 / 20, 3 / 10])
    assert sched.choose(50, set()) == 3
    assert sched.choose(50, {3}) == 1
    # Equal rates: lowest index (fragments 2 and 3 at t = 50 with equal R).
    sched.completed(2, 40, 3.0)
    assert sched.choose(50, {1}) == 2


def test_adaptive_stale_fragments_first() -> None:
    sched = AdaptiveSchedule(4, 100)
    for p, (t, norm) in enumerate([(10, 0.0), (20, 0.1), (30, 50.0), (40, 0.1)]):
        sched.completed(p, t, norm)
    # t = 125: I = [115, 105, 95, 85]; fragments 0 and 1 are stale. The lowest stale index
    # wins although fragment 2 has by far the largest rate.
    assert sched.choose(125, set()) == 0
    assert sched.choose(125, {0}) == 1
    # I_p = H exactly counts as stale (t = 120: I_1 = 100).
    assert sched.choose(120, {0}) == 1
    # With no stale idle fragment, the rate decides.
    assert sched.choose(125, {0, 1}) == 2


def test_adaptive_never_synced_becomes_stale_at_H() -> None:
    sched = AdaptiveSchedule(3, 10)
    sched.completed(0, 2, 5.0)
    sched.completed(1, 4, 5.0)
    # Fragment 2 never synced: t_{2,b} = 0, so at t = 10 it is stale; and ∞ anyway.
    assert sched.choose(10, set()) == 2
    assert sched.choose(10, {2}) == 1  # fragment 0 is at I = 8 < H; R_1 = 5/6 > R_0 = 5/8


def test_adaptive_zero_interval_ranks_last() -> None:
    sched = AdaptiveSchedule(3, 100)
    for p in range(3):
        sched.completed(p, 10, 1.0)
    sched.completed(1, 20, 50.0)  # just completed at t = 20: I = 0, huge norm
    assert sched.rates(20) == [pytest.approx(0.1), -math.inf, pytest.approx(0.1)]
    assert sched.choose(20, set()) == 0  # R_0 = R_2 = 1/10: lowest index
    # A zero-norm fragment (R = 0) still outranks one with I = 0 ...
    sched.completed(0, 10, 0.0)
    assert sched.choose(20, {2}) == 0
    # ... and I = 0 is eligible when nothing else is idle.
    assert sched.choose(20, {0, 2}) == 1


def test_adaptive_validation() -> None:
    sched = AdaptiveSchedule(2, 10)
    sched.completed(0, 5, 1.0)
    with pytest.raises(ValueError):
        sched.choose(4, set())  # before a completed sync
    with pytest.raises(ValueError):
        sched.completed(0, 3, 1.0)  # time goes backwards
    with pytest.raises(ValueError):
        sched.completed(2, 6, 1.0)
    with pytest.raises(ValueError):
        sched.completed(1, 6, math.nan)
    with pytest.raises(ValueError):
        sched.choose(6, {5})
    for args in ((0, 10), (2, 0), (2.0, 10)):
        with pytest.raises(ValueError):
            AdaptiveSchedule(*args)


def test_adaptive_state_round_trip() -> None:
    sched = AdaptiveSchedule(4, 100, gamma=0.5)
    sched.completed(1, 30, 2.5)
    sched.completed(3, 40, 0.0)
    state = sched.state_dict()
    assert state["last_norm"] == [None, 2.5, None, 0.0]
    other = AdaptiveSchedule(4, 50)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.choose(60, {0}) == 2 and sched.choose(60, {0}) == 2
    assert other.rates(60) == sched.rates(60)
    # Bad states change nothing.
    before = other.state_dict()
    for bad in ({**state, "num_fragments": 3}, {**state, "last_norm": [None, -1.0, None, 0.0]},
                {**state, "last_completed": [0, 1, 2]}, {**state, "gamma": 2.0},
                {**state, "H": 0}, {k: v for k, v in state.items() if k != "H"}):
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
        assert other.state_dict() == before


@pytest.mark.parametrize(("P", "H", "tau"), [(4, 8, 1), (2, 10, 0), (1, 5, 4), (3, 12, 3)])
def test_fixed_schedule_over_global_steps(P, H, tau):
    """Fragment p starts at (p+1)·H/P − τ in every period of H global steps (counted from 1), and
    the next start after any step is the first step at which `starts_at` is non-empty."""
    sched = FixedSchedule(P, H, tau)
    for step in range(1, 4 * H + 1):
        within = (step - 1) % H + 1
        want = [p for p in range(P) if (p + 1) * (H // P) - tau == within]
        assert sched.starts_at(step) == want, step
    for step in range(0, 3 * H):
        nxt = sched.next_start_after(step)
        assert nxt > step and sched.starts_at(nxt)
        assert not any(sched.starts_at(t) for t in range(step + 1, nxt))


def test_fixed_schedule_refuses_what_fixed_schedule_refuses():
    with pytest.raises(ValueError, match="must divide"):
        FixedSchedule(3, 8, 0)
    with pytest.raises(ValueError, match="tau must be"):
        FixedSchedule(4, 8, 2)
