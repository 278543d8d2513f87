"""The federated-learning baselines on fl-geo's path (``fl_geo.strategies.baselines``), each with
its settings dataclass.

These are *not* Flower's ``flwr.serverapp.strategy.FedAvg`` & co.: they run on fl-geo's outer loop
(the same dispatcher, virtual clock, wire precisions, token weighting, reply validation and
metrics as DiLoCo), so a comparison with DiLoCo varies only the outer optimizer. They live in
their own namespace so that an import cannot mix them up with Flower's classes.

FedAvg: McMahan et al. 2017 (arXiv:1602.05629). FedAvgM: Hsu et al. 2019 (arXiv:1909.06335).
FedAdam / FedYogi: Reddi et al., "Adaptive Federated Optimization" (arXiv:2003.00295).
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.strategies.settings import SyncSettings
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class FedAvgSettings(SyncSettings):
    """FedAvg: outer ``avg``, θ ← θ − lr·Δ̄ (lr 1 gives the mean of the local models)."""

    method = "fedavg"


@dataclass(kw_only=True)
class FedAvgMSettings(SyncSettings):
    """FedAvgM: outer ``sgdm`` (heavy ball, as Flower's FedAvgM), lr 0.7, momentum 0.5.

    Not the paper's lr 1 / momentum 0.9 (Hsu et al. 2019, a cross-device setting): with pseudo-
    gradients of many local steps that setting ended 15-20 % above FedAvg on fl-geo's long-budget
    study, and 0.7 / 0.5 level with FedAvg (docs/benchmarks.md, "the long-budget study"). Pass
    ``outer_lr=1.0, outer_momentum=0.9`` for the paper's.
    """

    method = "fedavgm"


@dataclass(kw_only=True)
class FedOptSettings(SyncSettings):
    """FedOpt's server optimizer constants (Reddi et al.), shared by FedAdam and FedYogi.

    Parameters
    ----------
    beta1 : float (default: 0.9)
    beta2 : float (default: 0.99)
    tau : float (default: 1e-3)
        Adaptivity (ε of the paper).
    """

    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3


@dataclass(kw_only=True)
class FedAdamSettings(FedOptSettings):
    """FedAdam: FedOpt with Adam at the server; outer lr η = 0.1 (Flower's default)."""

    method = "fedadam"


@dataclass(kw_only=True)
class FedYogiSettings(FedOptSettings):
    """FedYogi: FedOpt with Yogi at the server; outer lr η = 0.01 (Flower's default)."""

    method = "fedyogi"


class FedAvg(FlGeoStrategy):
    """FedAvg: θ ← θ − lr·Δ̄ (lr 1 gives the mean of the local models)."""

    Settings = FedAvgSettings


class FedAvgM(FlGeoStrategy):
    """FedAvg with server momentum (heavy ball)."""

    Settings = FedAvgMSettings


class FedAdam(FlGeoStrategy):
    """FedOpt with Adam at the server."""

    Settings = FedAdamSettings


class FedYogi(FlGeoStrategy):
    """FedOpt with Yogi at the server."""

    Settings = FedYogiSettings
