"""WeightedAccumulator: weighted mean, mixed dtypes, pieces, one buffer."""

from __future__ import annotations

import pytest
import torch

from fl_geo.accumulate import WeightedAccumulator, weight_for
from fl_geo.state import CHUNK_ELEMS


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
    assert len(model_sized) == 1  # the sum; the scratch is chunk-sized
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


def _peak_rss_growth(fn) -> int | None:
    """Peak RSS growth (bytes) while running fn, or None where VmHWM cannot be reset."""
    import re

    def status(field: str) -> int:
        with open("/proc/self/status") as fh:
            return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE).group(1))

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        before = status("VmRSS")
    except OSError:
        return None
    fn()
    return (status("VmHWM") - before) * 1024


def test_folding_bf16_makes_no_model_sized_temporary() -> None:
    numel = 32 * CHUNK_ELEMS  # 64 MiB of bf16; a full fp32 upcast would be 128 MiB
    update = torch.ones(numel, dtype=torch.bfloat16)
    acc = WeightedAccumulator(numel)
    acc.add(update, 1.0)  # warm-up: faults the buffer's pages in
    growth = _peak_rss_growth(lambda: acc.add(update, 2.0))
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


def test_add_checked_equals_check_then_add() -> None:
    numel = CHUNK_ELEMS + 1234
    ups = _updates(3, numel, seed=7)
    pieces = [(0, ups[0][:5000].bfloat16()), (5000, ups[0][5000:].bfloat16())]
    a, b = WeightedAccumulator(numel), WeightedAccumulator(numel)
    for acc, fused in ((a, False), (b, True)):
        for update, w in ((pieces, 2.0), (ups[1], 3.0), (ups[2].half(), 5.0)):
            norm = acc.add_checked(update, w) if fused else acc.add(update, w)
            if fused:
                flat = (torch.cat([p for _, p in update]) if isinstance(update, list)
                        else update).double()
                # fp32 sums of squares over 1 M-element chunks: ~1e-5 relative at worst
                assert norm == pytest.approx(flat.norm().item(), rel=2e-5)
    assert torch.equal(a.mean(), b.mean())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_add_checked_rejects_and_restores(bad: float) -> None:
    from fl_geo.accumulate import NonFiniteUpdateError

    numel = 3 * CHUNK_ELEMS
    good, broken = _updates(2, numel, seed=8)
    where = 2 * CHUNK_ELEMS + 10  # pieces [0,100) and [100, 100 + CHUNK) are folded first
    broken[where] = bad
    pieces = [(0, broken[:100].bfloat16()), (100, broken[100:].bfloat16())]

    # first update since reset: the buffer is restored exactly (marked empty again)
    acc = WeightedAccumulator(numel)
    with pytest.raises(NonFiniteUpdateError, match="rejected at flat offset") as err:
        acc.add_checked(pieces, 2.0)
    assert err.value.offset == 100 + CHUNK_ELEMS and acc.count == 0  # the failing chunk
    acc.add_checked(good, 1.0)
    assert torch.equal(acc.mean(), good)

    # later update: the folded chunks are subtracted again (exact up to one rounding)
    acc = WeightedAccumulator(numel)
    acc.add(good, 1.0)
    with pytest.raises(NonFiniteUpdateError):
        acc.add_checked(pieces, 2.0)
    assert acc.count == 1 and acc.total_weight == 1.0
    assert torch.isfinite(acc.buffer).all()
    torch.testing.assert_close(acc.mean(), good, rtol=0, atol=1e-6)


def _split(t: torch.Tensor, at: int, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
    return [(0, t[:at].to(dtype)), (at, t[at:].to(dtype))]


def test_add_batch_checked_equals_sequential() -> None:
    numel = CHUNK_ELEMS + 321
    ups = _updates(3, numel, seed=9)
    batch = [_split(ups[0], 4000, torch.bfloat16), ups[1], _split(ups[2], 4000, torch.float16)]
    weights = [1000.0, 3000.0, 6000.0]
    seq, bat = WeightedAccumulator(numel), WeightedAccumulator(numel)
    seq_norms = [seq.add_checked(u, w) for u, w in zip(batch, weights, strict=True)]
    bat_norms = bat.add_batch_checked(batch, weights)
    assert bat.count == 3 and bat.total_weight == 10000.0
    assert bat_norms == pytest.approx(seq_norms, rel=1e-6)  # chunking may differ
    # same terms, different summation order: equal to fp32 rounding
    torch.testing.assert_close(bat.mean(), seq.mean(), rtol=1e-6, atol=1e-7)
    # on a non-empty accumulator the batch adds on top
    acc = WeightedAccumulator(numel)
    acc.add(ups[0], 1.0)
    acc.add_batch_checked([ups[1], ups[2]], [1.0, 2.0])
    torch.testing.assert_close(acc.mean(), (ups[0] + ups[1] + 2 * ups[2]) / 4, rtol=0, atol=1e-6)


def test_add_batch_checked_exact_on_representable_values() -> None:
    a = torch.arange(-8.0, 8.0)
    b = torch.arange(16.0).bfloat16()
    seq, bat = WeightedAccumulator(16), WeightedAccumulator(16)
    seq.add(a, 1.0)
    seq.add(b, 3.0)
    bat.add_batch_checked([a, b], [1.0, 3.0])
    assert torch.equal(bat.mean(), seq.mean())


def test_add_batch_checked_rejects_whole_batch() -> None:
    from fl_geo.accumulate import NonFiniteUpdateError

    numel = 2 * CHUNK_ELEMS
    good0, good1, broken = _updates(3, numel, seed=10)
    broken[CHUNK_ELEMS + 5] = float("nan")  # second chunk: the first is already written
    acc = WeightedAccumulator(numel)
    with pytest.raises(NonFiniteUpdateError, match="update 2 of the batch rejected") as err:
        acc.add_batch_checked([good0, good1, broken.bfloat16()], [1.0, 1.0, 1.0])
    assert err.value.index == 2 and err.value.offset == CHUNK_ELEMS and acc.count == 0
    acc.add_batch_checked([good0, good1], [1.0, 1.0])  # retry without it: exact
    expected = WeightedAccumulator(numel)
    expected.add_batch_checked([good0, good1], [1.0, 1.0])
    assert torch.equal(acc.mean(), expected.mean())

    acc = WeightedAccumulator(numel)  # not empty: restored up to rounding
    acc.add(good0, 1.0)
    with pytest.raises(NonFiniteUpdateError):
        acc.add_batch_checked([good1, broken], [1.0, 1.0])
    assert acc.count == 1
    torch.testing.assert_close(acc.mean(), good0, rtol=0, atol=1e-6)


def test_add_batch_checked_layout_and_argument_errors() -> None:
    acc = WeightedAccumulator(10)
    with pytest.raises(ValueError, match="one weight per update"):
        acc.add_batch_checked([torch.ones(10)], [1.0, 2.0])
    with pytest.raises(ValueError, match="different piece layout"):
        acc.add_batch_checked([_split(torch.ones(10), 3, torch.float32),
                               _split(torch.ones(10), 4, torch.float32)], [1.0, 1.0])
    acc.add_batch_checked([_split(torch.ones(10), 3, torch.float32), torch.ones(10)], [1.0, 1.0])
    assert torch.equal(acc.mean(), torch.ones(10))
