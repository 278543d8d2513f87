"""Asynchronous buffered methods as Flower strategies: FedBuff, FedAsync, async DiLoCo,
Async-Local-SGD and Di-PS, each with its settings dataclass (on `AsyncSettings`).

The server never waits for every worker: it folds each reply as it comes (in virtual-finish order on
a scenario's clock), steps when its buffer or grace window says so, and re-dispatches only the
workers that reported. ``num_rounds`` of ``start()`` counts outer steps.

FedBuff: Nguyen et al. 2022 (arXiv:2106.06639). FedAsync: Xie et al. 2019 (arXiv:1903.03934).
Async-Local-SGD: Liu et al. 2024 (arXiv:2401.09135). Di-PS: the decoupled parameter server with
grace time and outlier rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.strategies.settings import AsyncSettings, at
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class FedBuffSettings(AsyncSettings):
    """FedBuff (Nguyen et al. 2022): K = 2 buffered updates per step, each weighted by
    s(τ) = 1/sqrt(1 + τ) (the paper's rule); outer ``avg`` with lr 1.

    Parameters
    ----------
    buffer_size : int (default: 2)
        K, accepted updates per outer step.
    staleness_weighting : bool (default: True)
    """

    method = "fedbuff"

    buffer_size: int = 2
    staleness_weighting: bool = True


@dataclass(kw_only=True)
class FedAsyncSettings(AsyncSettings):
    """FedAsync (Xie et al. 2019): workers send their parameters (``pseudo_grad_base="current"``)
    and every update is mixed in at once, θ ← (1 − α_t)·θ + α_t·θ_i, α_t = α·(1 + τ)^−a
    (``staleness_mixing``; α = ``mixing`` 0.6, a = ``staleness_exponent`` 0.5)."""

    method = "fedasync"

    staleness_mixing: bool = True
    pseudo_grad_base: str = "current"


@dataclass(kw_only=True)
class AsyncDiLoCoSettings(AsyncSettings):
    """Naive asynchronous DiLoCo: one Nesterov outer step per arriving update (lr 0.7, momentum 0.9)."""

    method = "async_diloco"


@dataclass(kw_only=True)
class AsyncLocalSGDSettings(AsyncSettings):
    """Async-Local-SGD (Liu et al. 2024) as the HALoS harness runs it: delayed Nesterov, momentum
    0.9, lr written lr × N = 0.05 × 32 = 1.6 (docs/algorithms.md, "Defaults").
    ``configs/async_local_sgd.yaml`` sets 1.4 with N = 4, which measures better on fl-geo's
    4-datacenter benchmarks.

    Parameters
    ----------
    delay_buffer : int (default: 32)
        N, updates between momentum applications.
    """

    method = "async_local_sgd"

    delay_buffer: int = 32


@dataclass(kw_only=True)
class DiPSSettings(AsyncSettings):
    """Di-PS: buffered asynchronous steps with no buffer cap, closed by a grace window after the
    last arrival, with the pseudo-gradient penalty (the registry's ``DIPS_PENALTY``: one global
    norm, the relative-max rule on pooled statistics, token weights).

    Parameters
    ----------
    outer_lr, outer_momentum : (default: 0.7, 0.8, the registry's)
    buffer_size : int (default: 1_000_000)
        No cap: the grace window or a full house closes a step.
    grace : bool (default: True)
    weighting : str (default: "tokens")
        The weights of the mean pseudo-gradient; with the penalty on they are the penalty's
        weights, so this sets ``penalty.weighting`` too.
    threshold : float (default: 3.0)
        β of the relative-max outlier rule (``penalty.threshold``).
    warmup : int (default: 5)
        Updates before outlier tests start (``penalty.warmup``).
    clip : float (default: 1.0)
        The paper's φ, the absolute clip on the mean pseudo-gradient norm, used when
        ``clip_mode="absolute"`` (0: no clip in either mode; ``penalty.clip``).
    clip_mode : str (default: "absolute")
        ``"absolute"``: φ = ``clip`` (the paper's; configs/dips.yaml); ``"relative"``: φ =
        clip_ratio × the running mean of the clipped norms (scale-free, but unclipped on the first
        step and growing by up to 10 % a step: on the own-model example it diverged where φ = 1
        learned; docs/algorithms.md §4, "The relative clip").
    clip_ratio : float (default: 2.0)
        c of the relative clip (``penalty.clip_ratio``).
    penalty : bool (default: True)
        False: plain buffered aggregation with the grace window (``penalty.enabled``).
    followers : int (default: 0)
        Shard the parameter server over this many followers (0: one server; ``ps.followers``).
    transport : str (default: "local")
        ``"local"`` (followers in this process) or ``"grpc"`` (follower processes and a gRPC
        data path; needs fl-geo's ClientApp; ``ps.transport``).
    """

    method = "dips"

    buffer_size: int = 1_000_000
    grace: bool = True
    weighting: str = at("strategy.weighting", "tokens", "penalty.weighting")
    threshold: float = at("penalty.threshold", 3.0)
    warmup: int = at("penalty.warmup", 5)
    clip: float = at("penalty.clip", 1.0)
    clip_mode: str = at("penalty.clip_mode", "absolute")
    clip_ratio: float = at("penalty.clip_ratio", 2.0)
    penalty: bool = at("penalty.enabled", True)
    followers: int = at("ps.followers", 0)
    transport: str = at("ps.transport", "local")


class FedBuff(FlGeoStrategy):
    """FedBuff: step after ``buffer_size`` buffered asynchronous updates."""

    Settings = FedBuffSettings


class FedAsync(FlGeoStrategy):
    """FedAsync: mix every update in at once with a staleness-decayed weight."""

    Settings = FedAsyncSettings


class AsyncDiLoCo(FlGeoStrategy):
    """Naive asynchronous DiLoCo: one Nesterov outer step per arriving update."""

    Settings = AsyncDiLoCoSettings


class AsyncLocalSGD(FlGeoStrategy):
    """Async-Local-SGD: delayed Nesterov (momentum applied every N updates, lr scaled by N)."""

    Settings = AsyncLocalSGDSettings


class DiPS(FlGeoStrategy):
    """Di-PS: buffered asynchronous steps closed by a grace window after the last arrival, with
    the pseudo-gradient penalty (outlier rejection, token weights, clipping)."""

    Settings = DiPSSettings
