"""Asynchronous buffered methods as Flower strategies: FedBuff, FedAsync, async DiLoCo,
Async-Local-SGD and Di-PS.

The server never waits for every worker: it folds each reply as it comes (in virtual-finish order on
a scenario's clock), steps when its buffer or grace window says so, and re-dispatches only the
workers that reported. ``num_rounds`` of ``start()`` counts outer steps.

FedBuff: Nguyen et al. 2022 (arXiv:2106.06639). FedAsync: Xie et al. 2019 (arXiv:1903.03934).
Async-Local-SGD: Liu et al. 2024 (arXiv:2401.09135). Di-PS: the decoupled parameter server with
grace time and outlier rejection.
"""

from __future__ import annotations

from typing import Any

from fl_geo.strategies.strategy import FlGeoStrategy


class FedBuff(FlGeoStrategy):
    """FedBuff: step after ``buffer_size`` buffered asynchronous updates.

    Parameters
    ----------
    buffer_size : int (default: 2)
        K, accepted updates per outer step.
    staleness_weighting : bool (default: True)
        Weight each update by s(τ) = 1/sqrt(1 + τ).
    outer_lr : float (default: 1.0)
    **common
        See `FlGeoStrategy`.
    """

    method = "fedbuff"

    def __init__(self, *, buffer_size: int = 2, staleness_weighting: bool = True, outer_lr: float = 1.0,
                 **common: Any) -> None:
        super().__init__(_strategy={"buffer_size": buffer_size, "staleness_weighting": staleness_weighting,
                                    "outer_lr": outer_lr}, **common)


class FedAsync(FlGeoStrategy):
    """FedAsync: mix every update in at once, θ ← (1 − α_t)·θ + α_t·θ_i, α_t = α·(1 + τ)^−a.

    Parameters
    ----------
    mixing : float (default: 0.6)
        α.
    staleness_exponent : float (default: 0.5)
        a.
    **common
        See `FlGeoStrategy`.
    """

    method = "fedasync"

    def __init__(self, *, mixing: float = 0.6, staleness_exponent: float = 0.5, **common: Any) -> None:
        super().__init__(_strategy={"mixing": mixing, "staleness_exponent": staleness_exponent}, **common)


class AsyncDiLoCo(FlGeoStrategy):
    """Naive asynchronous DiLoCo: one Nesterov outer step per arriving update.

    Parameters
    ----------
    outer_lr : float (default: 0.7)
    outer_momentum : float (default: 0.9)
    **common
        See `FlGeoStrategy`.
    """

    method = "async_diloco"

    def __init__(self, *, outer_lr: float = 0.7, outer_momentum: float = 0.9, **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum}, **common)


class AsyncLocalSGD(FlGeoStrategy):
    """Async-Local-SGD: delayed Nesterov (momentum applied every N updates, lr scaled by N).

    Parameters
    ----------
    outer_lr : float (default: 1.4)
        The delayed-Nesterov lr (lr × N in the HALoS harness's terms); 1.4 with N = 4 is what
        ``configs/async_local_sgd.yaml`` measures best on fl-geo's benchmarks.
    outer_momentum : float (default: 0.9)
    delay_buffer : int (default: 4)
        N, updates between momentum applications.
    **common
        See `FlGeoStrategy`.
    """

    method = "async_local_sgd"

    def __init__(self, *, outer_lr: float = 1.4, outer_momentum: float = 0.9, delay_buffer: int = 4,
                 **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum,
                                    "delay_buffer": delay_buffer}, **common)


class DiPS(FlGeoStrategy):
    """Di-PS: buffered asynchronous steps closed by a grace window after the last arrival, with
    the pseudo-gradient penalty (EMA z-score outlier rejection, token weights, clipping).

    Parameters
    ----------
    outer_lr : float (default: 0.7)
    outer_momentum : float (default: 0.8)
    grace_s : float (default: -1.0)
        Grace window in seconds; -1 = the ski-rental estimate from arrivals and update cost.
    grace_max_s : float (default: 60.0)
        Upper bound of the estimated window.
    weighting : str (default: "tokens")
    threshold : float (default: 3.0)
        β of the relative-max outlier rule.
    warmup : int (default: 5)
        Updates before outlier tests start.
    clip : float (default: 1.0)
        φ, the clip on the mean pseudo-gradient norm (0: none).
    penalty : bool (default: True)
        False: plain buffered aggregation with the grace window (no outlier test, no clip).
    followers : int (default: 0)
        Shard the parameter server over this many followers (0: one server).
    transport : str (default: "local")
        ``"local"`` (followers in this process) or ``"grpc"`` (follower processes and a gRPC
        data path; needs fl-geo's ClientApp).
    **common
        See `FlGeoStrategy`.
    """

    method = "dips"

    def __init__(self, *, outer_lr: float = 0.7, outer_momentum: float = 0.8, grace_s: float = -1.0,
                 grace_max_s: float = 60.0, weighting: str = "tokens", threshold: float = 3.0, warmup: int = 5,
                 clip: float = 1.0, penalty: bool = True, followers: int = 0, transport: str = "local",
                 **common: Any) -> None:
        sections: dict[str, dict[str, Any]] = {"ps": {"followers": followers, "transport": transport}}
        if penalty:
            sections["penalty"] = {"enabled": True, "granularity": "global", "rule": "relative_max",
                                   "threshold": threshold, "warmup": warmup, "keying": "pooled",
                                   "weighting": "tokens", "clip": clip}
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum, "grace_s": grace_s,
                                    "grace_max_s": grace_max_s, "pseudo_grad_base": "dispatch"},
                         weighting=weighting, _sections=sections, **common)
