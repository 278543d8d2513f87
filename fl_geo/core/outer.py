"""Outer (server-side) optimizers on a flat fp32 parameter buffer (docs/algorithms.md §2), by name.

Every optimizer receives the averaged pseudo-gradient Δ̄ = mean(base − local) and updates the
global parameters in place, with fp32 state allocated lazily on the first step and kernels that
walk the buffer in cache-sized chunks. That contract is `OuterOptimizer`
(``fl_geo.core.outer_base``); the five optimizers, with the references their rounding follows,
are in ``fl_geo.core.outer_optimizers``. This module names them for the config (`OUTER_OPTIMIZERS`,
`build_outer_optimizer`) and re-exports every class, so callers import them all from here.
"""

from __future__ import annotations

from typing import Any

from fl_geo.core.outer_base import OuterOptimizer
from fl_geo.core.outer_optimizers import SGD, DelayedNesterov, FedAdam, FedYogi, Nesterov

__all__ = [
    "OUTER_OPTIMIZERS",
    "SGD",
    "DelayedNesterov",
    "FedAdam",
    "FedYogi",
    "Nesterov",
    "OuterOptimizer",
    "build_outer_optimizer",
]


OUTER_OPTIMIZERS: dict[str, tuple[type[OuterOptimizer], dict[str, Any], frozenset[str]]] = {
    # name: (class, defaults that define the name, kwargs a caller may set)
    "nesterov": (Nesterov, {}, frozenset({"lr", "momentum"})),
    "delayed_nesterov": (
        DelayedNesterov, {}, frozenset({"lr", "momentum", "buffer_size", "activation"})
    ),
    "avg": (SGD, {"lr": 1.0, "momentum": 0.0}, frozenset({"lr"})),
    "sgdm": (SGD, {"lr": 1.0, "momentum": 0.9}, frozenset({"lr", "momentum"})),
    "fedadam": (FedAdam, {}, frozenset({"lr", "beta1", "beta2", "tau", "bias_correction"})),
    "fedyogi": (FedYogi, {}, frozenset({"lr", "beta1", "beta2", "tau"})),
}


def build_outer_optimizer(name: str, numel: int, **kwargs: Any) -> OuterOptimizer:
    """Outer optimizer by config name; unknown names or keyword arguments raise ValueError.

    ``avg`` is SGD with lr 1 and no momentum (only ``lr`` may be changed); ``sgdm`` defaults to
    lr 1, μ 0.9 (Hsu et al.'s FedAvgM setting; Flower's class default μ = 0 would be ``avg``).
    """
    if name not in OUTER_OPTIMIZERS:
        raise ValueError(
            f"unknown outer optimizer {name!r}; valid names: {', '.join(OUTER_OPTIMIZERS)}"
        )
    cls, defaults, allowed = OUTER_OPTIMIZERS[name]
    if unknown := sorted(set(kwargs) - allowed):
        raise ValueError(
            f"unknown argument(s) {unknown} for outer optimizer {name!r}; valid: "
            f"{', '.join(sorted(allowed))}"
        )
    return cls(numel, **{**defaults, **kwargs})
