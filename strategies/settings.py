"""`MethodSettings`: the typed settings of one method, and how they map onto a run's config.

Each method's settings are one keyword-only dataclass in the method's own module (`DiLoCoSettings`
in ``diloco``, `FedBuffSettings` in ``buffered``, ...), built on the family bases here. That
dataclass is the one place for the method's fields, their defaults and their docstring, and it
is used three ways, so the entry points cannot disagree:

- the public class (`FlGeoStrategy` subclass) takes exactly its fields as keyword arguments
  (plus the collaborators of `fl_geo.strategies.strategy.COLLABORATORS`);
- ``load_config`` merges its defaults under a config naming the method, and refuses a key in the
  config's ``strategy:`` section that is not one of its fields (`strategy_keys`);
- `MethodSettings.from_config` reads the same fields back from a resolved config, so a test can
  compare a class built with defaults and a config naming the method field by field.

Where a field lives in the run config is its ``at`` metadata (``"penalty.threshold"``; default
``"strategy.<field>"``): the outer loops still read the composed `fl_geo.config.FlGeoConfig`,
whose sections keep the value-range checks. A field whose default is None takes the method's
registry value (`fl_geo.registry.Method`: outer optimizer, lr, momentum), filled in
``__post_init__`` so that a built object always holds the value that runs.

This module imports only the registry and the error type: ``fl_geo.config`` imports it lazily.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, Self

from fl_geo.errors import ConfigError
from fl_geo.registry import METHODS


def at(place: str, default: Any = MISSING, *more: str) -> Any:
    """A settings field stored at ``place`` (``"section.key"``) of the run config, and also at
    ``more`` places (Di-PS's ``weighting`` is both the strategy's and the penalty's weighting)."""
    return field(default=default, metadata={"at": (place, *more)})


def places(f: Field[Any]) -> tuple[str, ...]:
    """Where field ``f`` of a settings dataclass lives in the run config (first: where it is read)."""
    return tuple(f.metadata.get("at", (f"strategy.{f.name}",)))


def _get(config: Any, place: str) -> Any:
    section, _, key = place.partition(".")
    return getattr(getattr(config, section), key)


@dataclass(kw_only=True)
class MethodSettings:
    """The settings every method has.

    Parameters
    ----------
    inner_steps : int (default: 50)
        H, the inner steps each worker runs per job (sent to the ClientApp as ``inner_steps``).
    weighting : str (default: "uniform")
        ``"uniform"`` or ``"tokens"``: how replies are weighted in the mean pseudo-gradient. Token
        weights come from the reply's ``num-tokens`` (fl-geo clients), else ``num-examples``.
    outer_optimizer, outer_lr, outer_momentum : (default: None = the method's, fl_geo.registry)
        The outer optimizer (the method's allowed ones are listed in its registry entry), its
        learning rate and momentum.
    delay_buffer, delay_activation : int, float (default: 1, 0.0)
        Delayed Nesterov's N and c.
    schedule_clock : str (default: "" = local for synchronous, global for asynchronous methods)
        Which step count positions the inner learning-rate schedule.
    dynupd : bool (default: False)
        H_i = ceil(H · speed_i / max speed) from the scenario's speeds (virtual clock only).
    clients_per_round, min_replies : int (default: 0, 1)
        Nodes sampled per round (0: every live node); skip an outer step with fewer accepted updates.
    quorum, late_replies : float, str (default: 0.0, "drop")
        Synchronous: step once this share of the round's nodes replied; the late replies are
        dropped or (``"fold"``) folded into a later round with a staleness weight.
    max_update_ratio : float (default: 10.0)
        Reject an update whose L2 norm exceeds this multiple of the model's (0: no bound).
    token_cap : str (default: "job")
        ``"job"``: a reply claiming more tokens than its job could produce is rejected;
        ``"none"``: trust the claim (a ClientApp whose batches follow other settings).
    site_devices : int (default: 0 = ``client.devices × client.nodes``)
        The most devices a site's token cap counts, set by the operator: a site's own profile
        may claim fewer, never more.
    robust, robust_factor, robust_window : str, float, int (default: "none", 3.0, 16)
        ``"median_norm"``: reject an update whose norm exceeds robust_factor × the median of its
        peers' (the round's, or the last robust_window for asynchronous methods); the
        direction-aware rules ``"trimmed_mean"``, ``"median"`` (synchronous), ``"cosine"`` and
        ``"centered_clip"`` (both) are described in docs/robustness.md.
    fold_order : str (default: "rank")
        ``"rank"``: fold replies in partition order (bit-reproducible); ``"arrival"``: as they come.
    round_timeout_s : float (default: 0.0)
        Wall seconds a job waits for its reply (0: the derived deadline below). A public class's
        ``start(timeout=...)`` sets it for that run.
    reply_deadline_factor, reply_deadline_floor_s, reply_deadline_first_s : float
        (default: 10.0, 300.0, 3600.0) The derived reply deadline: k × the median reply time of
        comparable jobs, at least the floor, and the first bound before any of them replied.
    wire_up, wire_down : str (default: "fp32")
        Precision of the pseudo-gradient / model on the wire: ``fp32``, ``fp16`` or ``bf16``.
    seed : int (default: 0)
        Seeds client sampling and what the fl-geo ClientApp seeds from.
    """

    method: ClassVar[str] = ""

    inner_steps: int = 50
    weighting: str = "uniform"
    outer_optimizer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    delay_buffer: int = 1
    delay_activation: float = 0.0
    schedule_clock: str = ""
    dynupd: bool = False
    clients_per_round: int = 0
    min_replies: int = 1
    quorum: float = 0.0
    late_replies: str = "drop"
    max_update_ratio: float = 10.0
    token_cap: str = "job"
    site_devices: int = 0
    robust: str = "none"
    robust_factor: float = 3.0
    robust_window: int = 16
    fold_order: str = "rank"
    round_timeout_s: float = 0.0
    reply_deadline_factor: float = 10.0
    reply_deadline_floor_s: float = 300.0
    reply_deadline_first_s: float = 3600.0
    wire_up: str = at("wire.up", "fp32")
    wire_down: str = at("wire.down", "fp32")
    seed: int = at("run.seed", 0)

    def __post_init__(self) -> None:
        entry = METHODS[self.method]
        if self.outer_optimizer is None:
            self.outer_optimizer = entry.optimizers[0]
        if self.outer_lr is None:
            self.outer_lr = entry.outer_lr
        if self.outer_momentum is None:
            self.outer_momentum = entry.outer_momentum
        self.schedule_clock = self.schedule_clock or ("global" if entry.is_async else "local")
        self.check()

    def check(self) -> None:
        """The method's own invariants (a subclass adds its own). The value ranges of each key are
        checked where the composed config is validated (each section's ``check()``); what is
        checked here is what makes the method itself valid."""

    def config_values(self) -> dict[str, dict[str, Any]]:
        """The fields as nested config values ``{section: {key: value}}`` (with ``strategy.name``)."""
        out: dict[str, dict[str, Any]] = {"strategy": {"name": self.method}}
        for f in fields(self):
            for place in places(f):
                section, _, key = place.partition(".")
                out.setdefault(section, {})[key] = getattr(self, f.name)
        return out

    @classmethod
    def default_values(cls) -> dict[str, dict[str, Any]]:
        """The defaults a config naming the method is merged onto (`fl_geo.config.load_config`):
        every field with a default, at its places, except the ``run`` section (the run's own
        settings, whose schema defaults stand) and the registry-filled None defaults."""
        out: dict[str, dict[str, Any]] = {}
        for f in fields(cls):
            if f.default is MISSING or f.default is None:
                continue
            for place in places(f):
                section, _, key = place.partition(".")
                if section != "run":
                    out.setdefault(section, {})[key] = f.default
        return out

    @classmethod
    def strategy_keys(cls) -> frozenset[str]:
        """The ``strategy:`` keys a config naming the method may set (``name`` and its fields)."""
        keys = {place.partition(".")[2] for f in fields(cls) for place in places(f) if place.startswith("strategy.")}
        return frozenset({"name", *keys})

    @classmethod
    def from_config(cls, config: Any) -> Self:
        """The settings a resolved `fl_geo.config.FlGeoConfig` naming this method holds."""
        if config.strategy.name != cls.method:
            raise ConfigError(f"{cls.__name__} holds the settings of '{cls.method}', the config names "
                              f"'{config.strategy.name}'")
        return cls(**{f.name: _get(config, places(f)[0]) for f in fields(cls)})


@dataclass(kw_only=True)
class SyncSettings(MethodSettings):
    """Settings of the synchronous methods (every node trains each round).

    Parameters
    ----------
    time_budget_s : float (default: 0.0)
        A-EDiT: each inner loop trains for this long instead of H steps (0: off; H caps it).
    step_weight_ratio : float (default: 0.0)
        r in w_i = (1 − r)·penalty weight_i + r·steps_i / Σ steps (needs the penalty).
    sync_warmup_steps : int (default: 0)
        EDiT's warm-up: this many one-step rounds with plain averaging first.
    """

    time_budget_s: float = 0.0
    step_weight_ratio: float = 0.0
    sync_warmup_steps: int = 0


@dataclass(kw_only=True)
class AsyncSettings(MethodSettings):
    """Settings of the asynchronous buffered methods (docs/algorithms.md §5).

    Parameters
    ----------
    buffer_size : int (default: 1)
        K, accepted updates per outer step.
    staleness_weighting : bool (default: False)
        Weight each update by s(τ) = 1/sqrt(1 + τ).
    staleness_mixing, mixing, staleness_exponent : bool, float, float (default: False, 0.6, 0.5)
        Scale each one-update step by α_t = mixing · (1 + τ)^−staleness_exponent (FedAsync).
    grace, grace_s, grace_max_s : bool, float, float (default: False, -1.0, 60.0)
        Close a step once grace_s has passed since the last arrival (-1: the ski-rental estimate,
        at most grace_max_s); grace_s >= 0 turns the window on.
    pseudo_grad_base : str (default: "dispatch")
        ``"dispatch"``: workers send Δ against the model they started from; ``"current"``: the
        server takes g = θ_current − θ_worker.
    outer_lr_scaling : str (default: "none")
        ``"share"``: lr × accepted updates / live workers per step.
    """

    buffer_size: int = 1
    staleness_weighting: bool = False
    staleness_mixing: bool = False
    mixing: float = 0.6
    staleness_exponent: float = 0.5
    grace: bool = False
    grace_s: float = -1.0
    grace_max_s: float = 60.0
    pseudo_grad_base: str = "dispatch"
    outer_lr_scaling: str = "none"

    def __post_init__(self) -> None:
        self.grace = self.grace or self.grace_s >= 0  # a fixed window turns the grace window on
        super().__post_init__()
