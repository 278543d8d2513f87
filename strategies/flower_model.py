"""A Flower user's model and evaluation as an fl-geo outer loop sees them: the model's layout
and fp32 flat buffer from an ``ArrayRecord`` (`spec_and_params`, with one-line errors for what
an outer optimizer cannot hold), the flat buffer back as an ``ArrayRecord``
(`arrays_from_flat`), and Flower's ``evaluate_fn`` as a server evaluator (`FlowerEvaluateFn`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from flwr.app import ArrayRecord, MetricRecord

from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec, flatten, unflatten

__all__ = ["EvaluateFn", "FlowerEvaluateFn", "ServerEvaluator", "arrays_from_flat", "spec_and_params"]


EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]


class ServerEvaluator(Protocol):
    """What an outer loop asks of server-side evaluation: ``metrics(flat, step)`` of the global
    model as a flat fp32 buffer at outer step ``step`` (``val/loss`` first of all)."""

    def metrics(self, flat: torch.Tensor, step: int) -> dict[str, float]: ...


class FlowerEvaluateFn:
    """Adapts Flower's ``evaluate_fn(server_round, arrays) -> MetricRecord | None``.

    Its ``"loss"`` becomes ``val/loss`` (what fl-geo's progress, tables and comparisons read);
    every other key ``k`` is logged as ``val/k``. Each record is also kept for the `Result`.
    """

    def __init__(self, fn: EvaluateFn, spec: ParamSpec) -> None:
        self.fn = fn
        self.spec = spec
        self.by_step: dict[int, MetricRecord] = {}

    def metrics(self, flat: torch.Tensor, step: int) -> dict[str, float]:
        record = self.fn(step, arrays_from_flat(flat, self.spec))
        if record is None:
            return {}
        self.by_step[step] = record
        out: dict[str, float] = {}
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out["val/loss" if key == "loss" else f"val/{key}"] = float(value)
        if "val/loss" in out:
            out["val/ppl"] = math.exp(min(out["val/loss"], 50.0))
        return out


def arrays_from_flat(flat: torch.Tensor, spec: ParamSpec) -> ArrayRecord:
    """The model as Flower's ``ArrayRecord`` (one array per tensor, in the spec's dtypes)."""
    state = {name: t.to(getattr(torch, dtype)) for (name, t), dtype in zip(unflatten(flat, spec).items(), spec.dtypes, strict=True)}
    return ArrayRecord(state)


def spec_and_params(initial_arrays: ArrayRecord) -> tuple[ParamSpec, torch.Tensor]:
    """The model layout and its fp32 flat buffer from a Flower ``ArrayRecord``; a one-line
    ConfigError for what an outer optimizer cannot hold (empty, non-floating tensors)."""
    if not isinstance(initial_arrays, ArrayRecord) or len(initial_arrays) == 0:
        raise ConfigError("initial_arrays must be a non-empty flwr.app.ArrayRecord (e.g. ArrayRecord(model.state_dict()))")
    state = initial_arrays.to_torch_state_dict()
    bad = [k for k, t in state.items() if not t.is_floating_point()]
    if bad:
        raise ConfigError(f"initial_arrays holds non-floating tensors {bad}: the outer optimizer steps floating "
                          "tensors only; leave integer buffers (e.g. BatchNorm's num_batches_tracked) out")
    spec = ParamSpec.from_state_dict(state)
    params = flatten(state, spec)
    if not bool(torch.isfinite(params).all()):
        raise ConfigError("initial_arrays hold NaN or Inf values")
    return spec, params
