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

    Every default here is also what a config naming ``fedbuff`` gets (fl_geo.registry).

    Parameters
    ----------
    buffer_size : int (default: 2)
        K, accepted updates per outer step.
    staleness_weighting : bool (default: True)
        Weight each update by s(τ) = 1/sqrt(1 + τ) (the FedBuff paper's rule).
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

    Workers send their parameters (``strategy.pseudo_grad_base=current``) and each step is scaled
    by α_t (``strategy.staleness_mixing``): the method's registry defaults.

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
    outer_lr : float (default: 1.6)
        The delayed-Nesterov lr, written lr × N as in the HALoS harness: 0.05 × 32
        (docs/algorithms.md, "Defaults"). ``configs/async_local_sgd.yaml`` sets 1.4 with N = 4,
        which measures better on fl-geo's 4-datacenter benchmarks.
    outer_momentum : float (default: 0.9)
    delay_buffer : int (default: 32)
        N, updates between momentum applications.
    **common
        See `FlGeoStrategy`.
    """

    method = "async_local_sgd"

    def __init__(self, *, outer_lr: float = 1.6, outer_momentum: float = 0.9, delay_buffer: int = 32,
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
        ``"tokens"`` or ``"uniform"``: the weights of the mean pseudo-gradient. With the penalty on
        they are the penalty's weights (``penalty.weighting``, set to the same value).
    threshold : float (default: 3.0)
        β of the relative-max outlier rule.
    warmup : int (default: 5)
        Updates before outlier tests start.
    clip : float (default: 1.0)
        φ, the clip on the mean pseudo-gradient norm (0: none).
    penalty : bool (default: True)
        False: plain buffered aggregation with the grace window (no outlier test, no clip,
        ``weighting`` as for any method).
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
        # The rest of Di-PS (no buffer cap, the grace window, the penalty's rule, granularity and
        # keying) is its registry entry's, shared with a config naming dips.
        sections: dict[str, dict[str, Any]] = {
            "ps": {"followers": followers, "transport": transport},
            "penalty": {"enabled": penalty, "threshold": threshold, "warmup": warmup, "clip": clip,
                        "weighting": weighting},
        }
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum, "grace_s": grace_s,
                                    "grace_max_s": grace_max_s},
                         weighting=weighting, _sections=sections, **common)
