"""Which outer loop and clock a config runs on (the registry's family -> the loop class).

The public strategy classes (`fl_geo.strategies.strategy.FlGeoStrategy`) call these; nothing else
chooses a loop, so the CLI and a Flower user's ServerApp take one path.
"""

from __future__ import annotations

from typing import Any

from fl_geo.config import ConfigError, FlGeoConfig
from fl_geo.registry import method
from fl_geo.strategies.asynchronous import AsyncOuterLoop
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.data_parallel import DataParallelLoop
from fl_geo.strategies.halos import HalosLoop
from fl_geo.strategies.sharded import ShardedDiPSLoop
from fl_geo.strategies.streaming import StreamingLoop
from fl_geo.strategies.sync import SyncOuterLoop

LOOPS: dict[str, type[OuterLoop]] = {
    "sync": SyncOuterLoop,
    "async": AsyncOuterLoop,
    "halos": HalosLoop,
    "streaming": StreamingLoop,
    "data_parallel": DataParallelLoop,
}


def loop_class(cfg: FlGeoConfig) -> type[OuterLoop]:
    """The method's loop; ``ps.followers`` turns Di-PS into the sharded parameter server."""
    if cfg.ps.followers:
        return ShardedDiPSLoop
    return LOOPS[method(cfg.strategy.name).family]


def make_wall_faults(cfg: FlGeoConfig, num_params: int, scenario: Any = None) -> Any:
    """``run.wall_faults``: the failure trace of ``run.scenario`` (or ``scenario``) as real faults
    (`fl_geo.runtime.wall_faults.WallFaults`); None when off. A scenario without a trace is a
    config error."""
    if not cfg.run.wall_faults:
        return None
    from fl_geo.runtime.wall_faults import WallFaults
    from fl_geo.scenario_files import load_scenario
    from fl_geo.timing.scenario import scenario_for_nodes

    scenario = scenario_for_nodes(scenario or load_scenario(cfg.run.scenario), cfg.run.num_clients)
    try:
        return WallFaults(scenario, cfg.run.wall_fault_scale, scenario.modelled_params(fallback=num_params))
    except ValueError as exc:
        raise ConfigError(f"run.wall_faults=true: {exc}; add failures or a failure_process to it") from None


def make_clock(cfg: FlGeoConfig, scenario: Any = None) -> tuple[Any, Any]:
    """The run's clock, and its scenario when the clock is virtual (modelled WAN and speeds):
    ``scenario`` when given (a `Scenario` object), else the one ``run.scenario`` names."""
    from fl_geo.timing.clock import VirtualClock, WallClock

    if cfg.run.clock == "wall":
        return WallClock(), None
    from fl_geo.scenario_files import load_scenario
    from fl_geo.timing.scenario import scenario_for_nodes

    scenario = scenario_for_nodes(scenario or load_scenario(cfg.run.scenario), cfg.run.num_clients)
    return VirtualClock(scenario), scenario
