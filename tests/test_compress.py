"""The compression core: int2 in quantize, and quantize's int8/int4 bytes against hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_geo.core.quantize import dequantize, dequantize_codes, quantize, quantize_codes
from fl_geo.errors import PayloadError

# ---- quantize.py: int8 / int4 unchanged, int2 added ------------------------------------------


def test_int8_and_int4_bytes_match_hand_computed_cases():
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, 3.0])  # blocks of 4: scale 1/q, then 3/q
    codes, scales = quantize(x, "int8", 4)
    # -0.5 / fp32(1/127) is exactly -63.5: ties to even give -64
    assert codes.dtype == np.int8 and codes.tolist() == [127, -64, 32, 0, 127]
    assert scales.tolist() == [np.float32(1 / 127), np.float32(3 / 127)]
    codes, scales = quantize(x, "int4", 4)
    # -0.5 / fp32(1/7) is a hair above -3.5: codes [7, -3, 2, 0 | 7] + 8 -> nibbles
    # [15, 5, 10, 8 | 15, pad 8], element 2k in the low nibble
    assert codes.dtype == np.uint8 and codes.tolist() == [15 | 5 << 4, 10 | 8 << 4, 15 | 8 << 4]
    assert scales.tolist() == [np.float32(1 / 7), np.float32(3 / 7)]
    for kind in ("int8", "int4"):  # the general entry point writes the same bytes
        a, b = quantize(x, kind, 4), quantize_codes(x, kind, 4)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_int2_packs_four_ternary_codes_per_byte():
    x = torch.tensor([0.9, -0.3, 0.6, 0.0, -2.0])
    codes, scales = quantize_codes(x, "int2", 4)
    # codes [1, 0, 1, 0 | -1] + 2 -> fields [3, 2, 3, 2 | 1, pad 2, 2, 2], bits 2j..2j+1
    assert codes.tolist() == [3 | 2 << 2 | 3 << 4 | 2 << 6, 1 | 2 << 2 | 2 << 4 | 2 << 6]
    assert scales.tolist() == [np.float32(0.9), np.float32(2.0)]
    y = dequantize_codes(codes, scales, 5, "int2", 4)
    assert y.tolist() == pytest.approx([0.9, 0.0, 0.9, 0.0, -2.0])


def test_the_streaming_wire_still_refuses_int2():
    with pytest.raises(ValueError, match="unknown quantisation 'int2'; valid: int8, int4"):
        quantize(torch.ones(4), "int2")
    with pytest.raises(ValueError, match="unknown quantisation"):
        dequantize(np.zeros(1, "u1"), np.ones(1, "f4"), 4, "int2", 4)


@pytest.mark.parametrize("codes,needle", [
    (np.array([0b10101000, 0b10101010], "u1"), r"2-bit field 0 \(code -2\)"),
    (np.array([0b10101010, 0b11101010], "u1"), "padding 2-bit fields"),
    (np.array([0b10101010], "u1"), r"shape \(2,\)"),  # truncated
])
def test_int2_malformed_codes(codes, needle):
    with pytest.raises(PayloadError, match=needle):
        dequantize_codes(codes, np.ones(2, "f4"), 5, "int2", 4)
