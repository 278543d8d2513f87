"""Wire codec: round trips, zero-copy decode, strict validation, finite check and norm."""

from __future__ import annotations

import io
import struct
import warnings

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.state import ParamSpec
from fl_geo.runtime import wire
from fl_geo.runtime.wire import (
    PayloadError,
    check_finite_and_norm,
    decode,
    decode_into,
    encode,
    payload_nbytes,
)
from tests.conftest import peak_rss_growth


@pytest.fixture
def spec() -> ParamSpec:
    return ParamSpec(
        ("embed.weight", "blocks.0.attn.wqkv", "blocks.0.norm", "scale"),
        ((50, 16), (48, 16), (16,), ()),
        ("float32", "bfloat16", "float32", "float32"),
    )


@pytest.fixture
def flat(spec: ParamSpec) -> torch.Tensor:
    return torch.randn(spec.numel, generator=torch.Generator().manual_seed(0))


def _assemble(pieces: list[tuple[int, torch.Tensor]], spec: ParamSpec,
              dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(spec.numel, dtype=dtype)
    for begin, piece in pieces:
        out[begin:begin + piece.numel()] = piece
    return out


def test_bf16_round_trip_bit_exact(spec: ParamSpec, flat: torch.Tensor) -> None:
    bf16 = flat.bfloat16()
    for source in (flat, bf16):  # encode casts fp32, or ships bf16 as is
        pieces = decode(encode(source, spec, "bf16"), spec, "bf16")
        assert all(p.dtype == torch.bfloat16 for _, p in pieces)
        back = _assemble(pieces, spec, torch.bfloat16)
        assert torch.equal(back.view(torch.int16), bf16.view(torch.int16))
    # special values survive too (decode does not judge finiteness)
    special = torch.tensor([float("inf"), -0.0, 1e-40, -3.0], dtype=torch.bfloat16)
    tiny = ParamSpec(("x",), ((4,),), ("bfloat16",))
    (_, got), = decode(encode(special, tiny, "bf16"), tiny, "bf16")
    assert torch.equal(got.view(torch.int16), special.view(torch.int16))


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32),
                                                  ("fp16", torch.float16)])
def test_fp32_fp16_round_trip_and_numpy_compat(spec: ParamSpec, flat: torch.Tensor,
                                               precision: str, dtype: torch.dtype) -> None:
    record = encode(flat, spec, precision)
    assert list(record.keys()) == list(spec.names)
    pieces = decode(record, spec, precision)
    assert torch.equal(_assemble(pieces, spec, dtype), flat.to(dtype))
    # byte-identical to what Flower's own Array(ndarray) writes, so Flower can read it
    w = flat[: 50 * 16].to(dtype).view(50, 16).numpy()
    assert record["embed.weight"].data == Array(w).data
    assert np.array_equal(record["embed.weight"].numpy(), w)
    assert record["scale"].shape == () and record["scale"].numpy().shape == ()


def test_decode_is_zero_copy_and_silent(spec: ParamSpec, flat: torch.Tensor) -> None:
    record = encode(flat, spec, "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's non-writable-buffer warning must not leak
        pieces = decode(record, spec, "bf16")
    data = record["embed.weight"].data
    begin, piece = pieces[0]
    base = np.frombuffer(data, dtype=np.uint8)
    addr = base.__array_interface__["data"][0]
    assert addr <= piece.data_ptr() < addr + len(data)  # a view into the payload bytes


def test_decode_into_full_model(spec: ParamSpec, flat: torch.Tensor) -> None:
    out = torch.empty(spec.numel)
    assert decode_into(encode(flat, spec, "fp32"), spec, "fp32", out=out) is out
    assert torch.equal(out, flat)
    assert torch.equal(decode_into(encode(flat, spec, "fp16"), spec, "fp16"),
                       flat.half().float())


def test_payload_nbytes(spec: ParamSpec, flat: torch.Tensor) -> None:
    n32 = payload_nbytes(encode(flat, spec, "fp32"))
    n16 = payload_nbytes(encode(flat, spec, "bf16"))
    headers = 4 * 128  # np.save pads each header to 128 bytes here
    assert n32 == headers + 4 * spec.numel and n16 == headers + 2 * spec.numel


def _tamper(record: ArrayRecord, key: str, **fields) -> ArrayRecord:
    arrays = dict(record.items())
    old = arrays[key]
    arrays[key] = Array(dtype=fields.get("dtype", old.dtype), shape=fields.get("shape", old.shape),
                        stype=fields.get("stype", old.stype), data=fields.get("data", old.data))
    return ArrayRecord(arrays)


def test_rejects_wrong_precision(spec: ParamSpec, flat: torch.Tensor) -> None:
    with pytest.raises(PayloadError, match=r"'embed.weight': dtype 'float32', expected 'int16' "
                                           r"for precision bf16 \(bf16 travels as int16\)"):
        decode(encode(flat, spec, "fp32"), spec, "bf16")
    with pytest.raises(PayloadError, match="dtype 'int16', expected 'float16'"):
        decode(encode(flat, spec, "bf16"), spec, "fp16")
    # metadata claims int16 but the bytes are fp32: caught by the .npy header check
    fp32_bytes = encode(flat, spec, "fp32")["blocks.0.norm"].data
    record = _tamper(encode(flat, spec, "bf16"), "blocks.0.norm", data=fp32_bytes)
    with pytest.raises(PayloadError, match=r"'blocks.0.norm': .npy header dtype '<f4', "
                                           r"expected '<i2'"):
        decode(record, spec, "bf16")
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        decode(encode(flat, spec, "fp32"), spec, "int8")


def test_rejects_wrong_shape(spec: ParamSpec, flat: torch.Tensor) -> None:
    record = encode(flat, spec, "fp32")
    arrays = dict(record.items())
    arrays["embed.weight"] = Array(flat[: 50 * 16].view(16, 50).numpy().copy())
    with pytest.raises(PayloadError, match=r"'embed.weight': shape \(16, 50\), expected \(50, 16\)"):
        decode(ArrayRecord(arrays), spec, "fp32")
    # metadata right, header wrong
    bad = _tamper(record, "embed.weight", data=Array(flat[:800].view(16, 50).numpy()).data)
    with pytest.raises(PayloadError, match=r"header shape \(16, 50\), expected \(50, 16\)"):
        decode(bad, spec, "fp32")


def test_rejects_missing_and_extra_keys(spec: ParamSpec, flat: torch.Tensor) -> None:
    record = encode(flat, spec, "fp32")
    arrays = dict(record.items())
    del arrays["blocks.0.norm"]
    with pytest.raises(PayloadError, match=r"missing 1 key\(s\) \['blocks.0.norm'\]"):
        decode(ArrayRecord(arrays), spec, "fp32")
    arrays = dict(record.items())
    arrays["lm_head.weight"] = Array(np.zeros(3, np.float32))
    with pytest.raises(PayloadError, match=r"unexpected 1 key\(s\) \['lm_head.weight'\]"):
        decode(ArrayRecord(arrays), spec, "fp32")


def test_rejects_truncated_or_padded_data(spec: ParamSpec, flat: torch.Tensor) -> None:
    record = encode(flat, spec, "bf16")
    data = record["blocks.0.attn.wqkv"].data
    with pytest.raises(PayloadError, match=r"'blocks.0.attn.wqkv': data truncated: "
                                           r"1662 bytes, expected 1664"):
        decode(_tamper(record, "blocks.0.attn.wqkv", data=data[:-2]), spec, "bf16")
    with pytest.raises(PayloadError, match="trailing bytes"):
        decode(_tamper(record, "blocks.0.attn.wqkv", data=data + b"\0\0"), spec, "bf16")
    with pytest.raises(PayloadError, match="truncated .npy header"):
        decode(_tamper(record, "blocks.0.attn.wqkv", data=data[:40]), spec, "bf16")
    with pytest.raises(PayloadError, match="not an .npy payload"):
        decode(_tamper(record, "scale", data=b"garbage"), spec, "bf16")
    with pytest.raises(PayloadError, match="stype 'torch.Tensor'"):
        decode(_tamper(record, "scale", stype="torch.Tensor"), spec, "bf16")


def _padded_npy(piece: np.ndarray, header_bytes: int, version: int) -> bytes:
    """A well-formed .npy of ``piece`` whose header is padded with spaces to about ``header_bytes``
    (the format allows it; np.save never writes it)."""
    text = repr({"descr": piece.dtype.str, "fortran_order": False, "shape": piece.shape})
    prefix = 10 if version == 1 else 12
    total = -(-(prefix + header_bytes) // 64) * 64  # a 64-byte multiple, as the format wants
    text = text + " " * (total - prefix - len(text) - 1) + "\n"
    size = struct.pack("<H", len(text)) if version == 1 else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + size + text.encode("latin1") + piece.tobytes()


@pytest.mark.parametrize(("header_bytes", "version"), [(60_000, 1), (1 << 20, 2)])
def test_rejects_a_padded_npy_header_before_parsing_it(spec: ParamSpec, flat: torch.Tensor,
                                                       header_bytes: int, version: int) -> None:
    """A header padded to 60 KB (format 1.0) or 1 MB (2.0) is valid .npy, and NumPy would parse
    it; decode refuses it from the length field, before copying or parsing a byte of it."""
    record = encode(flat, spec, "fp32")
    piece = flat[1568:1584].numpy().copy()  # the values of 'blocks.0.norm' (16 floats)
    data = _padded_npy(piece, header_bytes, version)
    assert np.load(io.BytesIO(data), allow_pickle=False, max_header_size=header_bytes + 100).tolist() == piece.tolist()
    with pytest.raises(PayloadError, match=r"'blocks.0.norm': .npy header of \d+ bytes exceeds 4096"):
        decode(_tamper(record, "blocks.0.norm", data=data), spec, "fp32")
    # a header that claims 3 GB but is not there: refused by the same bound, nothing allocated
    claim = b"\x93NUMPY\x02\x00" + struct.pack("<I", 3 << 30) + b"{}"
    with pytest.raises(PayloadError, match="exceeds 4096"):
        decode(_tamper(record, "scale", data=claim), spec, "fp32")


@pytest.mark.parametrize(("value", "what"), [(float("nan"), "1 NaN, 0 \\+Inf, 0 -Inf"),
                                             (float("inf"), "0 NaN, 1 \\+Inf, 0 -Inf"),
                                             (float("-inf"), "0 NaN, 0 \\+Inf, 1 -Inf")])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rejects_non_finite(spec: ParamSpec, flat: torch.Tensor, value: float, what: str,
                            precision: str) -> None:
    bad = flat.clone()
    bad[spec.offsets[1] + 7] = value  # inside blocks.0.attn.wqkv
    pieces = decode(encode(bad, spec, precision), spec, precision)
    with pytest.raises(PayloadError, match=rf"parameter 'blocks.0.attn.wqkv': non-finite "
                                           rf"values: {what}; update rejected"):
        check_finite_and_norm(pieces, spec)
    with pytest.raises(PayloadError, match="piece at offset 800"):
        check_finite_and_norm(pieces)


def test_rejects_fp32_norm_overflow_of_finite_update() -> None:
    spec = ParamSpec(("x",), ((4,),), ("float32",))
    huge = torch.full((4,), 3e19)  # finite, but Σx² overflows fp32
    with pytest.raises(PayloadError, match="all values finite but the fp32 sum of squares "
                                           "overflowed"):
        check_finite_and_norm(decode(encode(huge, spec, "fp32"), spec, "fp32"), spec)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_norm_matches_reference(spec: ParamSpec, flat: torch.Tensor, precision: str) -> None:
    pieces = decode(encode(flat, spec, precision), spec, precision)
    reference = _assemble(pieces, spec, torch.float64).norm().item()
    assert check_finite_and_norm(pieces) == pytest.approx(reference, rel=1e-6)


def test_decoded_pieces_fold_into_accumulator(spec: ParamSpec, flat: torch.Tensor) -> None:
    acc = WeightedAccumulator(spec.numel)
    acc.add(decode(encode(flat, spec, "bf16"), spec, "bf16"), 2.0)
    acc.add(decode(encode(-flat, spec, "fp32"), spec, "fp32"), 2.0)
    torch.testing.assert_close(acc.mean(), (flat.bfloat16().float() - flat) / 2)


def test_decode_and_norm_make_no_model_sized_copy() -> None:
    numel = 32 << 20  # 64 MiB as bf16; an fp32 copy would be 128 MiB
    spec = ParamSpec(("w",), ((numel,),), ("float32",))
    record = encode(torch.ones(numel, dtype=torch.bfloat16), spec, "bf16")
    # The same path once on a small payload first: the first call maps code pages of the norm's
    # kernels and allocates the 4 MiB fp32 scratch (10-15 MiB of RSS on a 2-core AMD EPYC, once
    # per process), which is not what this test is about: a copy of the model (64-128 MiB).
    small = ParamSpec(("w",), ((1 << 21,),), ("float32",))
    check_finite_and_norm(decode(encode(torch.ones(1 << 21, dtype=torch.bfloat16), small, "bf16"), small, "bf16"))
    norms: list[float] = []
    growth = peak_rss_growth(
        lambda: norms.append(check_finite_and_norm(decode(record, spec, "bf16"))))
    if growth is None:
        pytest.skip("/proc/self/clear_refs not available")
    assert growth < 16 * 2**20, f"decode + norm grew RSS by {growth / 2**20:.0f} MiB"
    assert norms[0] == pytest.approx(numel**0.5)


# ---- array_of / tensor_of: Flower's Array(ndarray) and array.numpy(), without np.save / np.load --------

@pytest.mark.parametrize("values", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(2.5, dtype=np.float64),  # 0-d, as a stored Python number
    np.arange(5, dtype=np.int64),
    np.array([True, False]),
    np.zeros((0, 3), dtype=np.float16),
    np.arange(300 * 2, dtype=np.float32).reshape(300, 2).T,  # not C-contiguous: Flower's own path
    np.arange(6, dtype=">f4"),  # big-endian: the bytes agree; torch reads neither (below)
])
def test_array_of_is_flowers_array_byte_for_byte_and_tensor_of_reads_it_back(values):
    ours, theirs = wire.array_of(values), Array(values)
    assert (ours.dtype, ours.shape, ours.stype, ours.data) == (theirs.dtype, theirs.shape, theirs.stype, theirs.data)
    if not values.dtype.isnative:
        with pytest.raises(ValueError, match="byte order"):  # as torch.from_numpy(theirs.numpy()) does
            wire.tensor_of(theirs)
        return
    back = wire.tensor_of(theirs)
    expected = torch.from_numpy(theirs.numpy())
    assert back.dtype == expected.dtype and back.shape == expected.shape and torch.equal(back, expected)
    if back.numel():  # a copy of its own: writable, and writing it leaves the Array as it was
        back.reshape(-1)[0] = back.reshape(-1)[-1] if back.dtype == torch.bool else back.reshape(-1)[0] + 1
        assert torch.equal(torch.from_numpy(theirs.numpy()), expected)


def test_array_of_takes_a_tensor_and_tensor_of_falls_back_to_flowers_reader_with_its_errors():
    t = torch.randn(4, 5)
    assert wire.array_of(t).data == Array(t.numpy()).data
    with pytest.raises(TypeError):  # bf16 has no NumPy dtype: the same refusal as Array(tensor)
        wire.array_of(torch.zeros(2, dtype=torch.bfloat16))
    good = Array(np.arange(4, dtype=np.float32))
    for bad in (good.data[:-3], b"not an npy payload at all", good.data[:8] + b"\xff\xff" + good.data[10:]):
        broken = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=bad)
        with pytest.raises(ValueError) as ours:
            wire.tensor_of(broken)
        with pytest.raises(ValueError) as theirs:
            broken.numpy()
        assert type(ours.value) is type(theirs.value)
