"""The federated-learning baselines on fl-geo's path (``fl_geo.strategies.baselines``).

These are *not* Flower's ``flwr.serverapp.strategy.FedAvg`` & co.: they run on fl-geo's outer loop
(the same dispatcher, virtual clock, wire precisions, token weighting, reply validation and
metrics as DiLoCo), so a comparison with DiLoCo varies only the outer optimizer. They live in
their own namespace so that an import cannot mix them up with Flower's classes.

FedAvg: McMahan et al. 2017 (arXiv:1602.05629). FedAvgM: Hsu et al. 2019 (arXiv:1909.06335).
FedAdam / FedYogi: Reddi et al., "Adaptive Federated Optimization" (arXiv:2003.00295).
"""

from __future__ import annotations

from typing import Any

from fl_geo.strategies.strategy import FlGeoStrategy


class FedAvg(FlGeoStrategy):
    """FedAvg: θ ← θ − lr·Δ̄ (lr 1 gives the mean of the local models).

    Parameters
    ----------
    outer_lr : float (default: 1.0)
    **common
        See `FlGeoStrategy` (``inner_steps``, ``weighting``, ...).
    """

    method = "fedavg"

    def __init__(self, *, outer_lr: float = 1.0, **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr}, **common)


class FedAvgM(FlGeoStrategy):
    """FedAvg with server momentum (heavy ball).

    Parameters
    ----------
    outer_lr : float (default: 1.0)
    outer_momentum : float (default: 0.9)
    **common
        See `FlGeoStrategy`.
    """

    method = "fedavgm"

    def __init__(self, *, outer_lr: float = 1.0, outer_momentum: float = 0.9, **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum}, **common)


class _FedOpt(FlGeoStrategy):
    def __init__(self, *, outer_lr: float, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr, "beta1": beta1, "beta2": beta2, "tau": tau}, **common)


class FedAdam(_FedOpt):
    """FedOpt with Adam at the server.

    Parameters
    ----------
    outer_lr : float (default: 0.1)
        η, Flower's default.
    beta1 : float (default: 0.9)
    beta2 : float (default: 0.99)
    tau : float (default: 1e-3)
        Adaptivity (ε of the paper).
    **common
        See `FlGeoStrategy`.
    """

    method = "fedadam"

    def __init__(self, *, outer_lr: float = 0.1, **kwargs: Any) -> None:
        super().__init__(outer_lr=outer_lr, **kwargs)


class FedYogi(_FedOpt):
    """FedOpt with Yogi at the server.

    Parameters
    ----------
    outer_lr : float (default: 0.01)
        η, Flower's default.
    beta1 : float (default: 0.9)
    beta2 : float (default: 0.99)
    tau : float (default: 1e-3)
    **common
        See `FlGeoStrategy`.
    """

    method = "fedyogi"

    def __init__(self, *, outer_lr: float = 0.01, **kwargs: Any) -> None:
        super().__init__(outer_lr=outer_lr, **kwargs)
