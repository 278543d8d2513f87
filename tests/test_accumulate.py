"""WeightedAccumulator: weighted mean, mixed dtypes, pieces, one buffer."""

from __future__ import annotations

import pytest
import torch

from fl_geo.core.accumulate import BatchResult, WeightedAccumulator, weight_for
from fl_geo.core.state import CHUNK_ELEMS
from tests.conftest import peak_rss_growth


def _updates(k: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(k)]


def test_uniform_weights_equal_plain_mean() -> None:
    ups = _updates(5, 1000)
    acc = WeightedAccumulator(1000)
    for u in ups:
        acc.add(u, weight_for("uniform", 123))
    assert acc.count == 5 and acc.total_weight == 5.0
    torch.testing.assert_close(acc.mean(), torch.stack(ups).mean(0), rtol=0, atol=1e-6)


def test_token_weights_equal_hand_computed_mean() -> None:
    ups = _updates(3, 1000, seed=1)
    tokens = [1000, 3000, 6000]
    acc = WeightedAccumulator(1000)
    for u, t in zip(ups, tokens, strict=True):
        acc.add(u, weight_for("tokens", t))
    expected = (1000 * ups[0] + 3000 * ups[1] + 6000 * ups[2]) / 10000
    assert acc.total_weight == 10000.0
    out = torch.empty(1000)
    assert acc.mean(out=out) is out
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    acc.add(ups[0], 1.0)  # mean(out=...) leaves the sum intact
    assert acc.count == 4


def test_mixed_dtypes_and_pieces() -> None:
    numel = CHUNK_ELEMS + 777  # a piece that spans a chunk boundary of the scratch
    ups = _updates(3, numel, seed=2)
    bf16, fp16 = ups[0].bfloat16(), ups[1].half()
    acc = WeightedAccumulator(numel)
    acc.add(bf16, 2.0)
    split = 1000
    acc.add([(0, fp16[:split]), (split, fp16[split:])], 3.0)  # as decoded payload pieces
    acc.add([(split, ups[2][split:]), (0, ups[2][:split])], 5.0)  # any order
    expected = (2.0 * bf16.double() + 3.0 * fp16.double() + 5.0 * ups[2].double()) / 10.0
    torch.testing.assert_close(acc.mean().double(), expected, rtol=0, atol=1e-6)


def test_exact_on_representable_values() -> None:
    # small integers: every product and sum is exact in fp32, so the mean is exact too
    a = torch.arange(-8, 8, dtype=torch.float32).bfloat16()
    b = torch.arange(16, dtype=torch.float32)
    acc = WeightedAccumulator(16)
    acc.add(a, 1.0)
    acc.add(b, 3.0)
    assert torch.equal(acc.mean(), (a.float() + 3 * b) / 4)


def test_one_buffer_regardless_of_count() -> None:
    numel = 2 * CHUNK_ELEMS + 5  # larger than the chunk scratch
    acc = WeightedAccumulator(numel)
    buf_ptr = acc.buffer.data_ptr()
    tensors_before = {id(t) for t in vars(acc).values() if isinstance(t, torch.Tensor)}
    for i in range(20):
        acc.add(torch.full((numel,), float(i), dtype=torch.bfloat16), 1.0)
    tensors_after = {id(t) for t in vars(acc).values() if isinstance(t, torch.Tensor)}
    assert tensors_after == tensors_before  # no new tensor attributes appeared
    assert acc.buffer.data_ptr() == buf_ptr and acc.buffer.numel() == numel
    model_sized = [t for t in vars(acc).values()
                   if isinstance(t, torch.Tensor) and t.numel() >= numel]
    assert len(model_sized) == 1  # the sum (add folds in place); the scratch is chunk-sized
    assert acc.mean()[0].item() == pytest.approx(9.5)
    acc.reset()
    assert acc.count == 0 and acc.total_weight == 0.0 and acc.buffer.data_ptr() == buf_ptr
    assert torch.count_nonzero(acc.buffer) == 0


def test_errors() -> None:
    acc = WeightedAccumulator(10)
    with pytest.raises(RuntimeError, match="empty"):
        acc.mean()
    with pytest.raises(ValueError, match="1-D with 10"):
        acc.add(torch.zeros(11), 1.0)
    with pytest.raises(ValueError, match="positive"):
        acc.add(torch.zeros(10), 0.0)
    with pytest.raises(ValueError, match="positive"):
        acc.add(torch.zeros(10), float("nan"))
    with pytest.raises(ValueError, match="outside buffer"):
        acc.add([(0, torch.zeros(5)), (8, torch.zeros(5))], 1.0)
    assert acc.count == 0 and torch.count_nonzero(acc.buffer) == 0  # nothing was folded
    with pytest.raises(TypeError, match="non-floating"):
        acc.add([(0, torch.zeros(5, dtype=torch.int16))], 1.0)
    acc.add(torch.ones(10), 2.0)
    acc.mean()
    with pytest.raises(RuntimeError, match="reset"):
        acc.add(torch.ones(10), 1.0)
    with pytest.raises(RuntimeError, match="reset"):
        acc.mean()
    with pytest.raises(ValueError, match="unknown weight kind 'norm'; valid kinds: uniform, tok"):
        weight_for("norm", 10)
    with pytest.raises(ValueError, match="tokens must be positive, got 0"):
        weight_for("tokens", 0)
    with pytest.raises(ValueError, match="tokens must be positive"):
        weight_for("uniform", -3)
    with pytest.raises(TypeError, match="int"):
        weight_for("tokens", 1.5)  # type: ignore[arg-type]


def test_folding_bf16_makes_no_model_sized_temporary() -> None:
    numel = 32 * CHUNK_ELEMS  # 64 MiB of bf16; a full fp32 upcast would be 128 MiB
    update = torch.ones(numel, dtype=torch.bfloat16)
    acc = WeightedAccumulator(numel)
    acc.add(update, 1.0)  # warm-up: faults the buffer's pages in
    growth = peak_rss_growth(lambda: acc.add(update, 2.0))
    if growth is None:
        pytest.skip("/proc/self/clear_refs not available")
    assert growth < 32 * 2**20, f"folding grew RSS by {growth / 2**20:.0f} MiB"
    assert acc.buffer[0].item() == 3.0


def test_reset_then_partial_or_full_cover() -> None:
    """After reset the buffer is zeroed lazily: a full-cover first add overwrites it, a partial
    one zeroes first. Both must equal a freshly zeroed accumulator."""
    acc = WeightedAccumulator(6)
    acc.add(torch.full((6,), 9.0), 1.0)
    acc.reset()
    acc.add([(0, torch.ones(2))], 2.0)  # partial: elements 2..5 must be zero, not 9
    assert torch.equal(acc.mean(), torch.tensor([1.0, 1, 0, 0, 0, 0]))
    acc.reset()
    acc.add([(3, torch.ones(3, dtype=torch.bfloat16)), (0, torch.full((3,), 2.0))], 4.0)
    acc.add(torch.ones(6), 4.0)
    assert torch.equal(acc.mean(), torch.tensor([1.5, 1.5, 1.5, 1.0, 1.0, 1.0]))


# ---------------------------------------------------------------------------------------------
# add_batch_checked: bit-exact against one-by-one adds, whatever the grouping

Pieces = list[tuple[int, torch.Tensor]]


def _pieces(t: torch.Tensor, cuts: list[int], dtype: torch.dtype, reverse: bool = False
            ) -> Pieces:
    bounds = [0, *cuts, t.numel()]
    pieces = [(b, t[b:e].to(dtype)) for b, e in zip(bounds, bounds[1:], strict=False)]
    return pieces[::-1] if reverse else pieces


def _as_fp32(update: torch.Tensor | Pieces, numel: int) -> torch.Tensor:
    if isinstance(update, torch.Tensor):
        return update.to(torch.float32, copy=True)
    flat = torch.empty(numel)
    for offset, piece in update:
        flat[offset:offset + piece.numel()] = piece.float()
    return flat


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns: equality here is bit-identity, zero signs included."""
    return t.view(torch.int32)


def _mixed_batch(numel: int, seed: int) -> tuple[list[torch.Tensor | Pieces], list[float]]:
    """Four updates in four wire forms, piece edges off the chunk grid, some signed zeros."""
    ups = [u * s for u, s in zip(_updates(4, numel, seed=seed), (1e-3, 1.0, 30.0, 1e-2),
                                 strict=True)]
    ups[0][:50] = -0.0
    ups[1][50:100] = 0.0
    batch: list[torch.Tensor | Pieces] = [
        _pieces(ups[0], [100, CHUNK_ELEMS + 7], torch.bfloat16, reverse=True),
        ups[1],
        _pieces(ups[2], [5000], torch.float16),
        _pieces(ups[3], [CHUNK_ELEMS - 3, CHUNK_ELEMS + 10], torch.float32, reverse=True),
    ]
    return batch, [65536.0, 3.3, 0.1, 7000.5]


SPLITS = [[1, 1, 1, 1], [2, 2], [4], [3, 1], [1, 3], [1, 2, 1]]


@pytest.mark.parametrize("prefilled", [False, True])
def test_batches_bit_identical_to_sequential_adds(prefilled: bool) -> None:
    numel = 2 * CHUNK_ELEMS + 4321
    batch, weights = _mixed_batch(numel, seed=11)
    pre = _updates(1, numel, seed=12)[0].bfloat16()

    seq = WeightedAccumulator(numel)
    if prefilled:
        seq.add(pre, 5.0)
    for update, w in zip(batch, weights, strict=True):
        seq.add(update, w)
    # Independent reference, whole-tensor torch: ((pre·5) + fl(w₀u₀)) + fl(w₁u₁) + ... in order
    terms = ([pre.float() * 5.0] if prefilled else []) + [
        _as_fp32(u, numel) * w for u, w in zip(batch, weights, strict=True)]
    ref = terms[0]
    for term in terms[1:]:
        ref = ref + term
    assert torch.equal(_bits(seq.buffer), _bits(ref))
    # the test has teeth: another order or a fused multiply-add gives other bits
    assert not torch.equal(ref, sum(terms[::-1], torch.zeros(numel)))
    fused = (pre.float() * 5.0 if prefilled else torch.zeros(numel))
    for u, w in zip(batch, weights, strict=True):
        fused.add_(_as_fp32(u, numel), alpha=w)
    assert not torch.equal(ref, fused)

    acc = WeightedAccumulator(numel)  # one accumulator for all splits: reset + swapped buffers
    for split in SPLITS:
        acc.reset()
        if prefilled:
            acc.add(pre, 5.0)
        start = 0
        for size in split:
            result = acc.add_batch_checked(batch[start:start + size], weights[start:start + size])
            assert result.rejected == {} and None not in result.norms
            start += size
        assert torch.equal(_bits(acc.buffer), _bits(seq.buffer)), f"split {split}"
        assert acc.count == seq.count and acc.total_weight == seq.total_weight
    assert torch.equal(_bits(acc.mean()), _bits(seq.mean()))


def test_batch_norms() -> None:
    numel = CHUNK_ELEMS + 321
    batch, weights = _mixed_batch(numel, seed=13)
    result = WeightedAccumulator(numel).add_batch_checked(batch, weights)
    for update, norm in zip(batch, result.norms, strict=True):
        exact = _as_fp32(update, numel).double().norm().item()
        # sum_of_squares: ~2e-8 measured; a BLAS dot over the chunk was 2.3e-5 off on an AVX2 EPYC
        assert norm == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bad_index", [0, 2])
@pytest.mark.parametrize("prefilled", [False, True])
def test_rejected_update_leaves_no_trace(bad: float, bad_index: int, prefilled: bool) -> None:
    numel = 3 * CHUNK_ELEMS + 17
    batch, weights = _mixed_batch(numel, seed=14)
    where = 2 * CHUNK_ELEMS + 10  # third chunk: two chunks were folded with it before it fails
    broken = _as_fp32(batch[bad_index], numel)
    broken[where] = bad
    batch[bad_index] = _pieces(broken, [7, CHUNK_ELEMS], torch.bfloat16)
    pre = _updates(1, numel, seed=15)[0]

    acc, without, seq = (WeightedAccumulator(numel) for _ in range(3))
    if prefilled:
        for a in (acc, without, seq):
            a.add(pre, 2.0)
    before = acc.buffer.clone()
    result = acc.add_batch_checked(batch, weights)
    kind = "NaN" if bad != bad else ("+Inf" if bad > 0 else "-Inf")
    assert set(result.rejected) == {bad_index}
    assert f"non-finite value ({kind}) at element {where} of {numel}" in result.rejected[bad_index]
    assert result.norms[bad_index] is None
    assert all(n is not None for i, n in enumerate(result.norms) if i != bad_index)

    good = [i for i in range(len(batch)) if i != bad_index]
    without.add_batch_checked([batch[i] for i in good], [weights[i] for i in good])
    for i in good:
        seq.add(batch[i], weights[i])
    for other in (without, seq):
        assert torch.equal(_bits(acc.buffer), _bits(other.buffer))
        assert acc.count == other.count and acc.total_weight == other.total_weight
    assert not torch.equal(acc.buffer, before)  # the good ones were folded


def test_several_rejections_and_all_rejected() -> None:
    numel = 3 * CHUNK_ELEMS
    batch, weights = _mixed_batch(numel, seed=16)
    late = _as_fp32(batch[1], numel)
    late[2 * CHUNK_ELEMS + 1] = float("nan")  # detected in the third chunk
    early = _as_fp32(batch[3], numel)
    early[3] = float("inf")  # detected in the first chunk
    bad_batch = [batch[0], late, batch[2], early.half()]
    acc, seq = WeightedAccumulator(numel), WeightedAccumulator(numel)
    acc.add(batch[2], 1.5)
    seq.add(batch[2], 1.5)
    result = acc.add_batch_checked(bad_batch, weights)
    assert sorted(result.rejected) == [1, 3]
    seq.add(batch[0], weights[0])
    seq.add(batch[2], weights[2])
    assert torch.equal(_bits(acc.buffer), _bits(seq.buffer)) and acc.count == 3

    # every update rejected: nothing changes, on a filled and on an empty accumulator
    before, count, total = acc.buffer.clone(), acc.count, acc.total_weight
    result = acc.add_batch_checked([late, early], [1.0, 2.0])
    assert sorted(result.rejected) == [0, 1] and result.norms == [None, None]
    assert torch.equal(_bits(acc.buffer), _bits(before))
    assert (acc.count, acc.total_weight) == (count, total)
    empty = WeightedAccumulator(numel)
    assert sorted(empty.add_batch_checked([early, late], [1.0, 1.0]).rejected) == [0, 1]
    assert empty.count == 0
    empty.add_batch_checked([batch[1]], [1.0])
    assert torch.equal(empty.mean(), batch[1])


def test_finite_but_overflowing_update_is_rejected() -> None:
    acc = WeightedAccumulator(1000)
    result = acc.add_batch_checked([torch.full((1000,), 1e30), torch.ones(1000)], [1.0, 1.0])
    assert "overflowed" in result.rejected[0] and set(result.rejected) == {0}
    assert torch.equal(acc.mean(), torch.ones(1000))


def test_batch_memory_does_not_grow_with_batch_size() -> None:
    numel = 32 * CHUNK_ELEMS  # 64 MiB of bf16 per update, 128 MiB per fp32 buffer
    update = torch.ones(numel, dtype=torch.bfloat16)
    acc = WeightedAccumulator(numel)
    acc.add_batch_checked([update], [1.0])  # warm-up: allocates and faults in both buffers
    acc.add_batch_checked([update], [1.0])
    growth = peak_rss_growth(lambda: acc.add_batch_checked([update] * 8, [1.0] * 8))
    model_sized = [t for t in vars(acc).values()
                   if isinstance(t, torch.Tensor) and t.numel() >= numel]
    assert len(model_sized) == 2  # the sum and the batch's output buffer, whatever the count
    assert acc.buffer[0].item() == 10.0
    if growth is None:
        pytest.skip("/proc/self/clear_refs not available")
    assert growth < 32 * 2**20, f"a batch of 8 grew RSS by {growth / 2**20:.0f} MiB"


def test_batch_layouts_and_argument_errors() -> None:
    acc = WeightedAccumulator(10)
    assert acc.add_batch_checked([], []) == BatchResult([], {}) and acc.count == 0
    with pytest.raises(ValueError, match="one weight per update"):
        acc.add_batch_checked([torch.ones(10)], [1.0, 2.0])
    for weight in (0.0, -1.0, float("nan"), float("inf"), 1e-40, 1e39):  # last two: fp32 range
        with pytest.raises(ValueError, match="update 1 of the batch: weight must be finite"):
            acc.add_batch_checked([torch.ones(10), torch.ones(10)], [1.0, weight])
    with pytest.raises(ValueError, match="update 0 of the batch: .*1-D with 10"):
        acc.add_batch_checked([torch.ones(11)], [1.0])
    with pytest.raises(TypeError, match="update 0 of the batch: piece at offset 0 has non-fl"):
        acc.add_batch_checked([[(0, torch.ones(10, dtype=torch.int16))]], [1.0])
    for gap_or_overlap in ([(0, torch.ones(3)), (5, torch.ones(5))],
                           [(0, torch.ones(6)), (5, torch.ones(5))]):
        with pytest.raises(ValueError, match="cover \\[0, 10\\) exactly once"):
            acc.add_batch_checked([torch.ones(10), gap_or_overlap], [1.0, 1.0])
    assert acc.count == 0 and torch.count_nonzero(acc.buffer) == 0  # nothing was folded
    # different layouts (and empty pieces) in one batch are fine
    a = torch.arange(10.0)
    acc.add_batch_checked([_pieces(a, [3], torch.float32),
                           [(7, a[7:]), (0, a[:0]), (0, a[:7])], a], [1.0, 1.0, 2.0])
    assert torch.equal(acc.mean(), a)
    with pytest.raises(RuntimeError, match="reset"):
        acc.add_batch_checked([a], [1.0])


def test_max_norm_rejects_an_oversized_update_and_folds_the_rest_bit_identically():
    torch.manual_seed(3)
    n = 3 * CHUNK_ELEMS + 17  # several chunks: the rejected update was folded into all of them
    a, b = torch.randn(n), torch.randn(n)
    big = torch.randn(n) * 1e6
    acc = WeightedAccumulator(n)
    res = acc.add_batch_checked([a, big, b], [1.0, 2.0, 3.0], max_norm=10 * float(a.norm()))
    assert list(res.rejected) == [1] and "exceeds the bound" in res.rejected[1]
    ref = WeightedAccumulator(n)
    ref.add_batch_checked([a, b], [1.0, 3.0])
    assert torch.equal(acc.buffer, ref.buffer) and acc.total_weight == ref.total_weight
    none = WeightedAccumulator(n)
    assert list(none.add_batch_checked([big], [1.0], max_norm=1.0).rejected) == [0]
    assert none.total_weight == 0
