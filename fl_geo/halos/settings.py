"""The ``halos`` section: the local parameter servers of HALoS's two tiers.

`fl_geo.core.halos` builds the local servers from these values, in the simulation and in the
two-tier deployment of this package alike. The section's own ranges are checked here; the rule
that the HALoS global server takes no penalty reads two sections and stays in `fl_geo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require


@dataclass
class HalosSection:
    """HALoS local parameter servers (docs/algorithms.md §6); the global server is ``strategy.*``."""

    accumulate: int = 32  # K: local updates per global update
    alpha: float = 0.25  # weight of the global model when a local server merges
    group_size: int = 0  # workers per local server ("consistent grouping"); 0 = one per region
    local_lr: float = 0.2 * 16  # delayed Nesterov of the local servers: lr x N
    local_momentum: float = 0.9
    local_buffer: int = 16  # N
    local_activation: float = 0.0  # c

    def check(self) -> None:
        """Raise `ConfigError` for a local-server setting out of its range."""
        require(self.accumulate >= 1, f"halos.accumulate (K) must be >= 1, got {self.accumulate}")
        require(0 <= self.alpha <= 1, f"halos.alpha must be in [0, 1], got {self.alpha}")
        require(self.group_size >= 0, f"halos.group_size must be >= 0, got {self.group_size}")
        require(self.local_lr > 0 and 0 <= self.local_momentum < 1 and self.local_buffer >= 1,
                "halos: local_lr > 0, local_momentum in [0, 1), local_buffer >= 1")
        require(self.local_activation >= 0, f"halos.local_activation must be >= 0, got {self.local_activation}")
