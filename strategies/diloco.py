"""DiLoCo, EDiT and A-EDiT as Flower strategies (synchronous rounds, Nesterov outer step).

DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv:2311.08105). EDiT / A-EDiT: Cheng et al., "EDiT: A Local-SGD-Based Efficient Distributed
Training Method for Large Language Models" (arXiv:2412.07210).
"""

from __future__ import annotations

from typing import Any

from fl_geo.strategies.strategy import FlGeoStrategy


class DiLoCo(FlGeoStrategy):
    """Synchronous DiLoCo: every node runs H inner steps from θ_t and replies Δ_i = θ_t − θ_i;
    the server applies Nesterov momentum SGD to the (token-)weighted mean Δ̄.

    Parameters
    ----------
    outer_lr : float (default: 0.7)
        Outer learning rate.
    outer_momentum : float (default: 0.9)
        Outer Nesterov momentum.
    outer_optimizer : str (default: "nesterov")
        ``"nesterov"`` or ``"delayed_nesterov"`` (momentum applied every ``delay_buffer`` steps).
    delay_buffer : int (default: 1)
        Delayed Nesterov's N.
    delay_activation : float (default: 0.0)
        Delayed Nesterov's c.
    **common
        The arguments every fl-geo strategy takes (`FlGeoStrategy`): ``inner_steps`` (default 50),
        ``weighting``, ``wire_up``, ``wire_down``, ``scenario``, ``options``, ``logger``, ...
    """

    method = "diloco"

    def __init__(self, *, outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_optimizer: str = "nesterov",
                 delay_buffer: int = 1, delay_activation: float = 0.0, **common: Any) -> None:
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum,
                                    "outer_optimizer": outer_optimizer, "delay_buffer": delay_buffer,
                                    "delay_activation": delay_activation}, **common)


class EDiT(FlGeoStrategy):
    """EDiT: DiLoCo with the per-module pseudo-gradient penalty (z-score outlier rejection
    against per-node EMA statistics, norm-softmax weights, clipping, rollback).

    Parameters
    ----------
    outer_lr : float (default: 0.8)
    outer_momentum : float (default: 0.85)
    threshold : float (default: 3.0)
        z-score above which a module's update is rejected.
    warmup : int (default: 20)
        Updates per node before outlier tests start.
    clip : float (default: 10.0)
        φ, the clip on the weighted pseudo-gradient norm (0: none).
    temperature : float (default: 1.0)
        Norm-softmax temperature.
    sync_warmup_steps : int (default: 0)
        EDiT's warm-up: this many one-step rounds with plain averaging first.
    **common
        See `FlGeoStrategy`.
    """

    method = "edit"

    def __init__(self, *, outer_lr: float = 0.8, outer_momentum: float = 0.85, threshold: float = 3.0,
                 warmup: int = 20, clip: float = 10.0, temperature: float = 1.0, sync_warmup_steps: int = 0,
                 _strategy: dict[str, Any] | None = None, **common: Any) -> None:
        sections = {"penalty": {"threshold": threshold, "warmup": warmup, "clip": clip, "temperature": temperature}}
        super().__init__(_strategy={"outer_lr": outer_lr, "outer_momentum": outer_momentum,
                                    "sync_warmup_steps": sync_warmup_steps, **(_strategy or {})},
                         _sections=sections, **common)


class AEDiT(EDiT):
    """A-EDiT: EDiT where each inner loop runs for a time budget instead of H steps, so nobody
    waits for a straggler; the steps each worker managed can be mixed into the weights.

    Parameters
    ----------
    time_budget_s : float
        Seconds of inner training per round (virtual seconds on a scenario's clock). Required.
    step_weight_ratio : float (default: 0.0)
        r in w_i = (1 − r)·penalty weight_i + r·steps_i / Σ steps.
    **edit
        EDiT's arguments and `FlGeoStrategy`'s. ``inner_steps`` caps the steps per round.
    """

    method = "a_edit"

    def __init__(self, *, time_budget_s: float, step_weight_ratio: float = 0.0, **edit: Any) -> None:
        super().__init__(_strategy={"time_budget_s": time_budget_s, "step_weight_ratio": step_weight_ratio}, **edit)
