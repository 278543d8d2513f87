"""Streaming DiLoCo and CoCoDC as Flower strategies: the model's blocks are split into P
fragments that sync in turn, each overlapped with τ inner steps of training.

Streaming DiLoCo: Douillard et al. 2025 (arXiv:2501.18512). CoCoDC: delay-compensated streaming
with adaptive transmission. Both need fl-geo's ClientApp (``train.stream`` messages: a worker keeps
its own model between syncs); a plain Flower ClientApp is refused at start with that reason.
"""

from __future__ import annotations

from typing import Any

from fl_geo.strategies.strategy import FlGeoStrategy


class StreamingDiLoCo(FlGeoStrategy):
    """Streaming DiLoCo.

    Every default here is also what a config naming ``streaming_diloco`` gets. The fragments are
    cut from the model ``start()`` is handed: P larger than its number of blocks is a one-line
    ConfigError there.

    Parameters
    ----------
    fragments : int (default: 2)
        P, strided fragments of the transformer blocks (at most the model's blocks; the papers
        use 4 on deeper models, as ``configs/streaming_diloco.yaml`` does).
    overlap : int (default: 5)
        τ, inner steps between a fragment's sync start and its merge (τ < H/P).
    alpha : float (default: 0.5)
        Merge weight of the global fragment (1: overwrite).
    quantize : str (default: "none")
        ``"int8"`` / ``"int4"``: blockwise-quantised fragment updates on the uplink.
    outer_lr : float (default: 0.7)
    outer_momentum : float (default: 0.9)
    **common
        See `FlGeoStrategy` (``inner_steps`` = H, default 50: P must divide it unless the
        schedule is adaptive).
    """

    method = "streaming_diloco"

    def __init__(self, *, fragments: int = 2, overlap: int = 5, alpha: float = 0.5, quantize: str = "none",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, _streaming: dict[str, Any] | None = None,
                 **common: Any) -> None:
        streaming = {"fragments": fragments, "overlap": overlap, "alpha": alpha, "quantize": quantize,
                     **(_streaming or {})}
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum},
                         _sections={"streaming": streaming}, **common)


class CoCoDC(StreamingDiLoCo):
    """CoCoDC: Streaming DiLoCo whose merge compensates the delay of a fragment's sync
    (``streaming.rule=compensate``) and whose schedule adapts the number of syncs to the link.

    Parameters
    ----------
    compensation : float (default: 0.5)
        λ of the delay compensation.
    adaptive : bool (default: True)
        N = max(P, ⌊γ·H·T_c / T_s⌋) syncs per H steps from the modelled compute and sync times.
    gamma : float (default: 0.4)
        Share of the network capacity the adaptive schedule may use.
    **streaming
        `StreamingDiLoCo`'s arguments (``alpha`` is not used by CoCoDC's merge) and `FlGeoStrategy`'s.
    """

    method = "cocodc"

    def __init__(self, *, compensation: float = 0.5, adaptive: bool = True, gamma: float = 0.4,
                 **streaming: Any) -> None:
        super().__init__(_streaming={"compensation": compensation, "adaptive": adaptive, "gamma": gamma},
                         **streaming)
