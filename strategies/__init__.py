"""fl-geo's Flower strategies (installed as ``fl_geo.strategies``).

One public class per method, each a ``flwr.serverapp.strategy.Strategy`` built from keyword
arguments and run with Flower's ``strategy.start(grid, initial_arrays, num_rounds, ...)``::

    from fl_geo.strategies import DiPS
    result = DiPS(inner_steps=25).start(grid, ArrayRecord(model.state_dict()), num_rounds=100)

The FL baselines on fl-geo's path are in ``fl_geo.strategies.baselines`` (so they cannot be
confused with Flower's own ``FedAvg`` & co.). `build_strategy` builds the class a config names
(what ``fl-geo run`` and ``flwr run .`` do). The outer loops behind the classes are in ``sync``,
``asynchronous``, ``halos``, ``streaming``, ``sharded`` and ``data_parallel`` (`DDP`, the
data-parallel reference every comparison is measured against).
"""

from __future__ import annotations

from typing import Any

from fl_geo.config import FlGeoConfig
from fl_geo.registry import METHODS, method
from fl_geo.strategies import baselines
from fl_geo.strategies.buffered import AsyncDiLoCo, AsyncLocalSGD, DiPS, FedAsync, FedBuff
from fl_geo.strategies.ddp import DDP
from fl_geo.strategies.diloco import AEDiT, DiLoCo, EDiT
from fl_geo.strategies.fragmented import CoCoDC, StreamingDiLoCo
from fl_geo.strategies.hierarchical import HALoS
from fl_geo.strategies.strategy import FlGeoStrategy, RunStats

__all__ = [
    "AEDiT", "AsyncDiLoCo", "AsyncLocalSGD", "CoCoDC", "DDP", "DiLoCo", "DiPS", "EDiT", "FedAsync", "FedBuff",
    "FlGeoStrategy", "HALoS", "RunStats", "StreamingDiLoCo", "baselines", "build_strategy", "strategy_class",
]

_CLASSES: dict[str, type[FlGeoStrategy]] = {
    cls.__name__: cls
    for cls in (DiLoCo, EDiT, AEDiT, FedBuff, FedAsync, AsyncDiLoCo, AsyncLocalSGD, DiPS, HALoS,
                StreamingDiLoCo, CoCoDC, DDP, baselines.FedAvg, baselines.FedAvgM, baselines.FedAdam,
                baselines.FedYogi)
}
assert {m.class_name for m in METHODS.values()} == set(_CLASSES), "registry and public classes disagree"


def strategy_class(name: str) -> type[FlGeoStrategy]:
    """The public class of the method a config calls ``name`` (e.g. ``"dips"`` -> `DiPS`)."""
    return _CLASSES[method(name).class_name]


def build_strategy(config: FlGeoConfig, **collaborators: Any) -> FlGeoStrategy:
    """The public strategy a resolved config names, with the CLI's collaborators (logger,
    checkpoints, progress, evaluator, ...; see `FlGeoStrategy.from_config`)."""
    return strategy_class(config.strategy.name).from_config(config, **collaborators)
