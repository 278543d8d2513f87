"""Each config section checks its own keys where it is defined (``check()``), with the same
message `fl_geo.config.load_config` gives for the same bad value."""

from __future__ import annotations

import pytest

from fl_geo.clients.settings import ClientSection
from fl_geo.config import ConfigError, load_config
from fl_geo.core.penalty_settings import PenaltySection
from fl_geo.core.streaming_settings import StreamingSection
from fl_geo.data.settings import DataSection
from fl_geo.halos.settings import HalosSection
from fl_geo.ps.settings import PsSection
from fl_geo.run_settings import RunSection
from fl_geo.runtime.wire_settings import WireSection
from fl_geo.strategy_settings import StrategySection

CASES = [
    (RunSection, "run", "rounds", 0),
    (StrategySection, "strategy", "inner_steps", 0),
    (PenaltySection, "penalty", "rule", "x"),
    (HalosSection, "halos", "alpha", 2.0),
    (StreamingSection, "streaming", "gamma", 0.0),
    (WireSection, "wire", "up", "x"),
    (PsSection, "ps", "transport", "x"),
    (DataSection, "data", "noise_block", 0),
    (ClientSection, "client", "devices", 0),
]


@pytest.mark.parametrize("cls,section,key,bad", CASES, ids=[c[1] for c in CASES])
def test_section_check_rejects_what_load_config_rejects(cls, section, key, bad):
    cls().check()  # the defaults pass
    with pytest.raises(ConfigError) as via_config:
        load_config(None, [f"{section}.{key}={bad}"])
    with pytest.raises(ConfigError) as via_section:
        cls(**{key: bad}).check()
    assert str(via_section.value) == str(via_config.value)


def test_strategy_check_fills_the_strategy_defaults_in_place():
    s = StrategySection(name="fedadam")
    s.check()
    assert (s.outer_optimizer, s.outer_lr, s.outer_momentum, s.schedule_clock) == ("fedadam", 0.1, 0.0, "local")
    s = StrategySection(name="async_diloco", grace_s=2.0)
    s.check()
    assert s.grace and s.schedule_clock == "global"


def test_the_sections_are_still_importable_from_the_config_module():
    import fl_geo.config as config

    for cls, section, _, _ in CASES:
        assert getattr(config, cls.__name__) is cls
        assert type(getattr(config.FlGeoConfig(), section)) is cls
