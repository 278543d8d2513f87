"""DiLoCo, EDiT and A-EDiT as Flower strategies (synchronous rounds, Nesterov outer step), each
with its settings dataclass (`fl_geo.strategies.settings`).

DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv:2311.08105). EDiT / A-EDiT: Cheng et al., "EDiT: A Local-SGD-Based Efficient Distributed
Training Method for Large Language Models" (arXiv:2412.07210).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fl_geo.errors import require
from fl_geo.strategies.settings import SyncSettings, at
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class DiLoCoSettings(SyncSettings):
    """DiLoCo: outer ``nesterov`` (or ``delayed_nesterov`` with ``delay_buffer`` N and
    ``delay_activation`` c), lr 0.7, momentum 0.5 (the registry's values: the paper's 0.9 ended above
    plain averaging on every seed of fl-geo's long-budget study, docs/benchmarks.md). Every other field is
    `SyncSettings`' and `MethodSettings`'."""

    method = "diloco"


@dataclass(kw_only=True)
class EDiTSettings(SyncSettings):
    """EDiT: DiLoCo's loop with the per-module pseudo-gradient penalty (EDiT Algorithm 2; the
    penalty's rule, granularity, keying and weighting are the registry's ``EDIT_PENALTY``).

    Parameters
    ----------
    outer_lr, outer_momentum : (default: 0.8, 0.85, the registry's)
    threshold : float (default: 3.0)
        δ, the z-score above which a module's update is rejected (``penalty.threshold``).
    warmup : int (default: 20)
        Updates per node before outlier tests start (``penalty.warmup``).
    clip : float (default: 10.0)
        The paper's φ, the absolute clip on the weighted pseudo-gradient norm per module, used
        when ``clip_mode="absolute"`` (0: no clip in either mode; ``penalty.clip``).
    clip_mode : str (default: "absolute")
        ``"absolute"``: φ = ``clip`` (the paper's); ``"relative"``: φ_g = clip_ratio × the running
        mean of module g's clipped norms (scale-free, but it lets a first step through unclipped
        and steps grow by 10 % each: it made Di-PS diverge on the own-model example;
        docs/algorithms.md §4, "The relative clip").
    clip_ratio : float (default: 2.0)
        c of the relative clip (``penalty.clip_ratio``).
    temperature : float (default: 1.0)
        T of the norm-softmax weights (``penalty.temperature``).
    """

    method = "edit"

    threshold: float = at("penalty.threshold", 3.0)
    warmup: int = at("penalty.warmup", 20)
    clip: float = at("penalty.clip", 10.0)
    clip_mode: str = at("penalty.clip_mode", "absolute")
    clip_ratio: float = at("penalty.clip_ratio", 2.0)
    temperature: float = at("penalty.temperature", 1.0)


@dataclass(kw_only=True)
class AEDiTSettings(EDiTSettings):
    """A-EDiT: EDiT with a time budget per inner loop instead of H steps (``inner_steps`` caps it).

    Parameters
    ----------
    time_budget_s : float (required)
        Seconds of inner training per round (virtual seconds on a scenario's clock); it depends
        on the hardware, so it has no default.
    step_weight_ratio : float (default: 0.0)
        r in w_i = (1 − r)·penalty weight_i + r·steps_i / Σ steps.
    """

    method = "a_edit"

    time_budget_s: float = field()  # required: no default (not even the inherited 0.0)

    def check(self) -> None:
        super().check()
        require(self.time_budget_s > 0,
                f"strategy a_edit needs strategy.time_budget_s > 0 (seconds of inner training per round), "
                f"got {self.time_budget_s}")


class DiLoCo(FlGeoStrategy):
    """Synchronous DiLoCo: every node runs H inner steps from θ_t and replies Δ_i = θ_t − θ_i;
    the server applies Nesterov momentum SGD to the (token-)weighted mean Δ̄."""

    Settings = DiLoCoSettings


class EDiT(FlGeoStrategy):
    """EDiT: DiLoCo with the per-module pseudo-gradient penalty (z-score outlier rejection
    against per-node EMA statistics, norm-softmax weights, clipping, rollback)."""

    Settings = EDiTSettings


class AEDiT(FlGeoStrategy):
    """A-EDiT: EDiT where each inner loop runs for a time budget instead of H steps, so nobody
    waits for a straggler; the steps each worker managed can be mixed into the weights."""

    Settings = AEDiTSettings
