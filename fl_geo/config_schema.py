"""The composition of a whole run's configuration: one dataclass per section, each defined
beside the code that reads it (see fl_geo/config.py for how files and overrides resolve to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fl_geo.clients.settings import ClientSection
from fl_geo.core.penalty_settings import PenaltySection
from fl_geo.core.streaming_settings import StreamingSection
from fl_geo.data.settings import DataSection
from fl_geo.halos.settings import HalosSection
from fl_geo.inner.model_config import ModelConfig
from fl_geo.ps.settings import PsSection
from fl_geo.run_settings import RunSection
from fl_geo.runtime.wire_settings import WireSection
from fl_geo.strategy_settings import StrategySection

__all__ = ["FlGeoConfig"]


@dataclass
class FlGeoConfig:
    """The whole run."""

    run: RunSection = field(default_factory=RunSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    penalty: PenaltySection = field(default_factory=PenaltySection)
    halos: HalosSection = field(default_factory=HalosSection)
    streaming: StreamingSection = field(default_factory=StreamingSection)
    wire: WireSection = field(default_factory=WireSection)
    ps: PsSection = field(default_factory=PsSection)
    model: ModelConfig = field(default_factory=ModelConfig)  # the model's own dataclass
    data: DataSection = field(default_factory=DataSection)
    client: ClientSection = field(default_factory=ClientSection)
