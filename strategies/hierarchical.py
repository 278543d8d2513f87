"""HALoS as a Flower strategy (simulation: the regions' local parameter servers live in the
ServerApp, each driving its own nodes; the global server merges their updates).

HALoS: Kim et al., "HALoS: Hierarchical Asynchronous Local SGD over Slow Networks for
Geo-Distributed Large Language Model Training" (arXiv:2506.04531). The two-tier deployment (one
SuperLink per region plus a global one) is ``fl-geo deploy`` with ``apps/halos-*``.
"""

from __future__ import annotations

from typing import Any

from fl_geo.strategies.strategy import FlGeoStrategy


class HALoS(FlGeoStrategy):
    """Local parameter servers per region (delayed Nesterov over K local updates) under a global
    server (delayed Nesterov); local servers merge the global model with weight α.

    Parameters
    ----------
    accumulate : int (default: 32)
        K, local updates a local server folds before it sends one global update.
    alpha : float (default: 0.25)
        Weight of the global model when a local server merges it.
    group_size : int (default: 0)
        Workers per local server (0: one local server per scenario region).
    local_lr : float (default: 3.2)
        The local servers' delayed-Nesterov lr × N (0.2 × 16).
    local_momentum : float (default: 0.9)
    local_buffer : int (default: 16)
        The local servers' N.
    outer_lr : float (default: 0.3)
        The global server's lr × N (0.15 × 2).
    outer_momentum : float (default: 0.5)
    delay_buffer : int (default: 2)
        The global server's N.
    **common
        See `FlGeoStrategy`; ``scenario`` places nodes in regions.
    """

    method = "halos"

    def __init__(self, *, accumulate: int = 32, alpha: float = 0.25, group_size: int = 0,
                 local_lr: float = 0.2 * 16, local_momentum: float = 0.9, local_buffer: int = 16,
                 outer_lr: float = 0.15 * 2, outer_momentum: float = 0.5, delay_buffer: int = 2,
                 **common: Any) -> None:
        super().__init__(
            _strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum, "delay_buffer": delay_buffer},
            _sections={"halos": {"accumulate": accumulate, "alpha": alpha, "group_size": group_size,
                                 "local_lr": local_lr, "local_momentum": local_momentum,
                                 "local_buffer": local_buffer}},
            **common)
