"""ParamSpec, flatten/unflatten/load_flat_into and the pseudo-gradient sign."""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.core.state import (
    CHUNK_ELEMS,
    SQ_ROW_ELEMS,
    ParamSpec,
    chunk_ranges,
    flatten,
    load_flat_into,
    pseudo_grad,
    sum_of_squares,
    unflatten,
)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.emb = torch.nn.Embedding(5, 4).to(torch.bfloat16)


@pytest.fixture
def model() -> _Tiny:
    torch.manual_seed(0)
    return _Tiny()


def test_spec_from_state_dict_layout(model: _Tiny) -> None:
    spec = ParamSpec.from_state_dict(model.state_dict())
    assert spec.names == ("lin.weight", "lin.bias", "norm.weight", "norm.bias", "emb.weight")
    assert spec.shapes == ((3, 4), (3,), (3,), (3,), (5, 4))
    assert spec.dtypes == ("float32",) * 4 + ("bfloat16",)
    assert spec.numels == (12, 3, 3, 3, 20)
    assert spec.offsets == (0, 12, 15, 18, 21)
    assert spec.numel == 41
    assert spec.name_at(0) == "lin.weight" and spec.name_at(21) == "emb.weight"


def test_spec_json_round_trip_and_equality(model: _Tiny) -> None:
    spec = ParamSpec.from_state_dict(model.state_dict())
    again = ParamSpec.from_json(spec.to_json())
    assert again == spec and hash(again) == hash(spec)
    other = ParamSpec(spec.names, spec.shapes[:-1] + ((4, 5),), spec.dtypes)
    assert other != spec  # same numel, different shape
    with pytest.raises(ValueError, match="malformed"):
        ParamSpec.from_json('{"names": ["a"]}')


def test_spec_rejects_inconsistent_input() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        ParamSpec(("a", "a"), ((1,), (1,)), ("float32", "float32"))
    with pytest.raises(ValueError, match="one shape and dtype per name"):
        ParamSpec(("a",), ((1,), (2,)), ("float32",))
    with pytest.raises(ValueError, match="non-floating"):
        ParamSpec(("a",), ((1,),), ("int64",))
    with pytest.raises(ValueError, match="unknown dtype"):
        ParamSpec(("a",), ((1,),), ("float33",))


def test_spec_non_float_entries() -> None:
    sd = {"w": torch.ones(2), "steps": torch.tensor(3)}
    with pytest.raises(ValueError, match="skip_non_float"):
        ParamSpec.from_state_dict(sd)
    spec = ParamSpec.from_state_dict(sd, skip_non_float=True)
    assert spec.names == ("w",)
    flat = flatten(sd, spec)
    load_flat_into(sd, flat * 2, spec)
    assert torch.equal(sd["w"], torch.full((2,), 2.0)) and sd["steps"].item() == 3


def test_flatten_unflatten_round_trip(model: _Tiny) -> None:
    sd = model.state_dict()
    spec = ParamSpec.from_state_dict(sd)
    flat = flatten(sd, spec)
    assert flat.dtype == torch.float32 and flat.shape == (spec.numel,)
    views = unflatten(flat, spec)
    assert list(views) == list(spec.names)
    for name, tensor in sd.items():
        assert torch.equal(views[name], tensor.float())  # bf16 -> fp32 is exact
    views["lin.bias"].fill_(7.0)  # views write through to the flat buffer
    assert torch.equal(flat[12:15], torch.full((3,), 7.0))


def test_flatten_into_out_and_checks(model: _Tiny) -> None:
    sd = model.state_dict()
    spec = ParamSpec.from_state_dict(sd)
    out = torch.empty(spec.numel)
    assert flatten(sd, spec, out=out) is out
    with pytest.raises(ValueError, match="1-D with 41"):
        flatten(sd, spec, out=torch.empty(40))
    with pytest.raises(KeyError, match="lacks"):
        flatten({k: v for k, v in sd.items() if k != "norm.bias"}, spec)
    bad = dict(sd, **{"lin.bias": torch.zeros(4)})
    with pytest.raises(ValueError, match="lin.bias"):
        flatten(bad, spec)


def test_load_flat_into_module_keeps_identity_and_casts(model: _Tiny) -> None:
    spec = ParamSpec.from_state_dict(model.state_dict())
    weight = model.lin.weight
    flat = torch.arange(spec.numel, dtype=torch.float32)
    load_flat_into(model, flat, spec)
    assert model.lin.weight is weight
    assert torch.equal(model.lin.weight, torch.arange(12.0).view(3, 4))
    assert model.emb.weight.dtype == torch.bfloat16
    assert torch.equal(model.emb.weight.float(), torch.arange(21.0, 41.0).view(5, 4))
    assert torch.equal(flatten(model.state_dict(), spec), flat)


def test_pseudo_grad_sign_and_in_place() -> None:
    base = torch.tensor([1.0, 2.0, 3.0])
    local = torch.tensor([0.5, 2.5, 3.0])
    delta = pseudo_grad(base, local)
    assert torch.equal(delta, torch.tensor([0.5, -0.5, 0.0]))
    # θ − Δ moves the global model onto the worker's model.
    assert torch.equal(base - delta, local)
    out = base.clone()
    assert pseudo_grad(out, local, out=out) is out and torch.equal(out, delta)
    # bf16 local (wire precision) promotes to fp32
    assert pseudo_grad(base, local.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="shape"):
        pseudo_grad(base, torch.zeros(2))


def test_chunk_ranges_cover_exactly() -> None:
    assert list(chunk_ranges(0, 10, 4)) == [(0, 4), (4, 8), (8, 10)]
    assert list(chunk_ranges(3, 3, 4)) == []
    with pytest.raises(ValueError):
        list(chunk_ranges(0, 1, 0))


@pytest.mark.parametrize("numel", [1, SQ_ROW_ELEMS - 1, SQ_ROW_ELEMS, 3 * SQ_ROW_ELEMS + 5, CHUNK_ELEMS])
def test_sum_of_squares_is_accurate_whatever_the_length(numel):
    """Within 1e-6 of the fp64 sum for a chunk of any length (rows, a tail, both): a BLAS dot over a
    2**20 chunk was 8e-6 off on an AVX2 CPU, enough for a norm bound to decide differently there."""
    gen = torch.Generator().manual_seed(numel)
    for scale in (1e-3, 30.0):
        x = torch.randn(numel, generator=gen) * scale
        exact = float(x.double().square().sum())
        assert sum_of_squares(x) == pytest.approx(exact, rel=1e-6)
    assert sum_of_squares(torch.zeros(0)) == 0.0


def test_sum_of_squares_is_not_finite_for_nan_inf_and_overflow():
    for bad in (float("nan"), float("inf"), float("-inf"), 3e19):  # 3e19² overflows fp32
        for where in (5, CHUNK_ELEMS - 3):  # in a row, in the tail
            x = torch.ones(CHUNK_ELEMS - 1)
            x[where] = bad
            assert not math.isfinite(sum_of_squares(x)), (bad, where)
