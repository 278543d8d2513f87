"""HALoS as a Flower strategy, with its settings dataclass (simulation: the regions' local
parameter servers live in the ServerApp, each driving its own nodes; the global server merges
their updates).

HALoS: Kim et al., "HALoS: Hierarchical Asynchronous Local SGD over Slow Networks for
Geo-Distributed Large Language Model Training" (arXiv:2506.04531). The two-tier deployment (one
SuperLink per region plus a global one) is ``fl-geo deploy`` with ``apps/halos-*``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.strategies.settings import MethodSettings, at
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class HALoSSettings(MethodSettings):
    """HALoS (run_halos.sh's values): local parameter servers per region (delayed Nesterov over K
    local updates) under a global server (delayed Nesterov lr 0.15 × N, momentum 0.5, N = 2).

    Parameters
    ----------
    delay_buffer : int (default: 2)
        The global server's N (its lr, ``outer_lr``, is written lr × N).
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
    local_activation : float (default: 0.0)
        The local servers' delayed-Nesterov c.
    """

    method = "halos"

    delay_buffer: int = 2
    accumulate: int = at("halos.accumulate", 32)
    alpha: float = at("halos.alpha", 0.25)
    group_size: int = at("halos.group_size", 0)
    local_lr: float = at("halos.local_lr", 0.2 * 16)
    local_momentum: float = at("halos.local_momentum", 0.9)
    local_buffer: int = at("halos.local_buffer", 16)
    local_activation: float = at("halos.local_activation", 0.0)


class HALoS(FlGeoStrategy):
    """Local parameter servers per region under a global server; local servers merge the global
    model with weight α. ``scenario`` places nodes in regions."""

    Settings = HALoSSettings
