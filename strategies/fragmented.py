"""Streaming DiLoCo and CoCoDC as Flower strategies, each with its settings dataclass: the model's
blocks are split into P fragments that sync in turn, each overlapped with τ inner steps of training.

Streaming DiLoCo: Douillard et al. 2025 (arXiv:2501.18512). CoCoDC: delay-compensated streaming
with adaptive transmission. Both need fl-geo's ClientApp (``train.stream`` messages: a worker keeps
its own model between syncs); a plain Flower ClientApp is refused at start with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require
from fl_geo.strategies.settings import MethodSettings, at
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class StreamingDiLoCoSettings(MethodSettings):
    """Streaming DiLoCo (outer Nesterov per fragment, lr 0.7, momentum 0.9). The fragments are cut
    from the model ``start()`` is handed: P larger than its number of blocks is a one-line
    ConfigError there, not here (the strategy does not know the model before).

    Parameters
    ----------
    fragments : int (default: 2)
        P, strided fragments of the transformer blocks (the papers use 4 on deeper models, as
        ``configs/streaming_diloco.yaml`` does). P must divide ``inner_steps`` unless ``adaptive``.
    overlap : int (default: 5)
        τ, inner steps between a fragment's sync start and its merge (τ·P < H).
    rule : str (default: "blend")
        The merge: ``"blend"`` (weight ``alpha`` of the global fragment) or ``"compensate"``
        (CoCoDC's delay compensation with λ = ``compensation``).
    alpha : float (default: 0.5)
        Merge weight of the global fragment (1: overwrite).
    compensation : float (default: 0.5)
        λ of the delay compensation.
    adaptive : bool (default: False)
        N = max(P, ⌊γ·H·T_c / T_s⌋) syncs per H steps from the modelled compute and sync times.
    gamma : float (default: 0.4)
        Share of the network capacity the adaptive schedule may use.
    quantize : str (default: "none")
        ``"int8"`` / ``"int4"``: an alias of ``wire.compress`` of that codec without error feedback
        (blockwise-quantised fragment updates, as before); ``wire.compress`` offers every codec.
    """

    method = "streaming_diloco"

    fragments: int = at("streaming.fragments", 2)
    overlap: int = at("streaming.overlap", 5)
    rule: str = at("streaming.rule", "blend")
    alpha: float = at("streaming.alpha", 0.5)
    compensation: float = at("streaming.compensation", 0.5)
    adaptive: bool = at("streaming.adaptive", False)
    gamma: float = at("streaming.gamma", 0.4)
    quantize: str = at("streaming.quantize", "none")

    def check(self) -> None:
        super().check()
        P, H = self.fragments, self.inner_steps
        require(P >= 1, f"streaming.fragments must be >= 1, got {P}")
        require(self.adaptive or H % P == 0,
                f"streaming.fragments (P={P}) must divide strategy.inner_steps (H={H}) for the fixed "
                "schedule (or set streaming.adaptive=true)")
        require(self.overlap * P < H,
                f"streaming.overlap (tau={self.overlap}) must be < strategy.inner_steps / streaming.fragments "
                f"(H/P = {H / P:g}) so that a fragment's sync ends before the next one starts")


@dataclass(kw_only=True)
class CoCoDCSettings(StreamingDiLoCoSettings):
    """CoCoDC (Algorithms 1 and 2): Streaming DiLoCo's fields with the delay-compensated merge
    (``rule="compensate"``) and the adaptive schedule (``adaptive=True``) on."""

    method = "cocodc"

    rule: str = at("streaming.rule", "compensate")
    adaptive: bool = at("streaming.adaptive", True)


class StreamingDiLoCo(FlGeoStrategy):
    """Streaming DiLoCo: P fragments synced in turn, each overlapped with τ inner steps."""

    Settings = StreamingDiLoCoSettings


class CoCoDC(FlGeoStrategy):
    """CoCoDC: Streaming DiLoCo whose merge compensates the delay of a fragment's sync and whose
    schedule adapts the number of syncs to the link."""

    Settings = CoCoDCSettings
