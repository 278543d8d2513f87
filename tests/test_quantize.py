"""Blockwise int8 / int4 quantisation (fl_geo.core.quantize) against its formulas, through the path the
old fragment quantiser's configs now take: ``streaming.quantize: int8 | int4`` is an alias of
``wire.compress`` of that codec with ``wire.error_feedback=false`` (`fl_geo.config.uplink_wire`), and
its payloads are `fl_geo.runtime.compressed` records of the same two arrays and bytes as before."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fl_geo.core.compress import Compressor, CompressSettings
from fl_geo.core.quantize import quantized_nbytes
from fl_geo.errors import ConfigError
from fl_geo.runtime.compressed import compress_record, decompress_record
from fl_geo.runtime.wire import PayloadError


def _compressor(kind: str, block: int) -> Compressor:
    return Compressor(CompressSettings(codec=kind, block=block, error_feedback=False))  # the alias's settings


def quantize_record(x: torch.Tensor, kind: str, block: int = 128) -> ArrayRecord:
    return compress_record(_compressor(kind, block).compress(x)[0])


def dequantize_record(record: ArrayRecord, numel: int, kind: str, block: int = 128) -> torch.Tensor:
    return decompress_record(record, _compressor(kind, block), numel)

KINDS = [("int8", 127), ("int4", 7)]


def _reference(x: torch.Tensor, q_max: int, block: int) -> torch.Tensor:
    """The module docstring's formulas, block by block (a slow reference, test only)."""
    out = torch.empty_like(x)
    for b in range(0, x.numel(), block):
        xb = x[b:b + block]
        scale = float(xb.abs().max()) / q_max
        out[b:b + block] = 0.0 if scale == 0 else torch.round(xb / scale).clamp(-q_max, q_max) * scale
    return out


@pytest.mark.parametrize("kind,q_max", KINDS)
@pytest.mark.parametrize("n,block", [(1000, 128), (1001, 128), (7, 3), (1, 128), (256, 256)])
def test_round_trip_matches_the_formula_and_its_error_bound(kind, q_max, n, block):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-4, 0, n)  # a wide dynamic range, as pseudo-gradients have
    y = dequantize_record(quantize_record(x, kind, block), n, kind, block)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert torch.allclose(y, _reference(x, q_max, block), rtol=1e-6, atol=0)
    # |x − x̂| ≤ scale_b / 2 in every block, and each block's largest element is exact
    for b in range(0, n, block):
        xb, yb = x[b:b + block], y[b:b + block]
        scale = float(xb.abs().max()) / q_max
        assert float((xb - yb).abs().max()) <= scale / 2 * (1 + 1e-5)
        i = int(xb.abs().argmax())
        assert float(yb[i]) == pytest.approx(float(xb[i]), rel=1e-6)


@pytest.mark.parametrize("kind,q_max", KINDS)
def test_zeros_and_grid_values_are_exact(kind, q_max):
    block = 4
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5 * 2 / q_max * q_max, 0.0])
    y = dequantize_record(quantize_record(x, kind, block), 8, kind, block)
    assert torch.equal(y[:4], torch.zeros(4))  # a zero block: scale 0, codes 0
    grid = torch.arange(-q_max, q_max + 1, dtype=torch.float32) * 0.25
    z = dequantize_record(quantize_record(grid, kind, grid.numel()), grid.numel(), kind, grid.numel())
    assert torch.equal(z, grid)  # values on the grid come back bit for bit


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_payload_size(kind):
    n, block = 1001, 128
    record = quantize_record(torch.randn(n), kind, block)
    data = sum(a.numpy().nbytes for a in record.values())
    assert data == quantized_nbytes(kind, n, block) == (n if kind == "int8" else 501) + 4 * 8
    assert quantized_nbytes(kind, 10**6, 128) / (4 * 10**6) == pytest.approx(
        (1.0 if kind == "int8" else 0.5) / 4 + 1 / 128, rel=1e-5)  # ceil(n / block) scales


def test_non_finite_input_is_refused_by_the_encoder_and_a_nan_scale_by_the_receiver():
    x = torch.ones(300)
    x[200] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        quantize_record(x, "int8", 128)
    record = quantize_record(torch.ones(300), "int8", 128)
    scales = record["scales"].numpy().copy()
    scales[1] = np.nan
    with pytest.raises(PayloadError, match="scale"):
        dequantize_record(ArrayRecord({"codes": record["codes"], "scales": Array(scales)}), 300, "int8", 128)


def _record(**arrays):
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


@pytest.mark.parametrize(
    "record,kind,needle",
    [
        (_record(codes=np.zeros(8, "i1")), "int8", "holds exactly"),
        (_record(codes=np.zeros(8, "i1"), scales=np.ones(2, "f4"), extra=np.ones(1, "f4")), "int8", "holds exactly"),
        (_record(codes=np.zeros(8, "i2"), scales=np.ones(2, "f4")), "int8", "codes must be int8"),
        (_record(codes=np.zeros(7, "i1"), scales=np.ones(2, "f4")), "int8", "shape (8,)"),
        (_record(codes=np.zeros(8, "i1"), scales=np.ones(3, "f4")), "int8", "scales must be float32 of shape (2,)"),
        (_record(codes=np.zeros(8, "i1"), scales=np.ones(2, "f8")), "int8", "scales must be float32"),
        (_record(codes=np.zeros(8, "i1"), scales=np.array([1, -1], "f4")), "int8", "finite and >= 0"),
        (_record(codes=np.zeros(8, "i1"), scales=np.array([1, np.inf], "f4")), "int8", "finite and >= 0"),
        (_record(codes=np.array([-128] + [0] * 7, "i1"), scales=np.ones(2, "f4")), "int8", "-128"),
        (_record(codes=np.full(4, 0x88, "u1"), scales=np.ones(2, "f4")), "int8", "codes must be int8"),
        (_record(codes=np.full(4, 0x80, "u1"), scales=np.ones(2, "f4")), "int4", "nibble 0"),
        (_record(codes=np.full(3, 0x88, "u1"), scales=np.ones(2, "f4")), "int4", "shape (4,)"),
    ],
)
def test_malformed_payloads_are_rejected(record, kind, needle):
    with pytest.raises(PayloadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        dequantize_record(record, 8, kind, 4)


def test_odd_int4_padding_must_encode_zero():
    record = quantize_record(torch.ones(5), "int4", 4)
    assert torch.equal(dequantize_record(record, 5, "int4", 4), torch.ones(5))
    codes = record["codes"].numpy().copy()
    codes[-1] = (codes[-1] & 0x0F) | (9 << 4)  # padding nibble says +1
    bad = ArrayRecord({"codes": Array(codes), "scales": record["scales"]})
    with pytest.raises(PayloadError, match="padding nibble"):
        dequantize_record(bad, 5, "int4", 4)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="compress.codec must be one of"):
        quantize_record(torch.ones(4), "int3")
    with pytest.raises(ConfigError, match="compress.block must be"):
        quantize_record(torch.ones(4), "int8", 0)
    with pytest.raises(ValueError, match="1-D floating"):
        quantize_record(torch.ones(2, 2), "int8")
