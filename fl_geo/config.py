"""One configuration schema for a whole fl-geo run.

Every knob lives in one omegaconf structured config (dataclasses below) so that YAML files in
``configs/``, dotted command-line overrides (``strategy.outer_lr=0.5``) and the Flower run config
all resolve to the same validated object. Unknown keys and wrong types are rejected here, before
any process starts, with a message that names the offending key and the valid ones: a typo in a
long experiment sweep must not silently fall back to a default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_geo.clients.settings import ClientSection
from fl_geo.core.penalty_settings import PenaltySection
from fl_geo.core.streaming_settings import StreamingSection
from fl_geo.data.settings import DataSection
from fl_geo.errors import ConfigError
from fl_geo.halos.settings import HalosSection
from fl_geo.inner.model import ModelConfig
from fl_geo.ps.settings import PsSection
from fl_geo.registry import METHODS
from fl_geo.run_settings import RunSection
from fl_geo.runtime.wire_settings import WireSection
from fl_geo.yaml_safe import load_yaml

WEIGHTINGS = ("uniform", "tokens")

# The strategy tables, derived from the one registry entry per method (fl_geo.registry): which
# outer optimizers a strategy may use (first = default), the outer lr / momentum it gets when the
# config leaves them unset, and which loops checkpoints cover. The rest of a method's defaults
# (`Method.defaults`) is merged under the user's keys by `load_config`.
STRATEGY_OPTIMIZERS: dict[str, tuple[str, ...]] = {m.name: m.optimizers for m in METHODS.values()}
STRATEGY_DEFAULTS: dict[str, tuple[float, float]] = {m.name: (m.outer_lr, m.outer_momentum) for m in METHODS.values()}
NO_CHECKPOINT_STRATEGIES = tuple(m.name for m in METHODS.values() if not m.checkpoints)
ASYNC_STRATEGIES = tuple(m.name for m in METHODS.values() if m.is_async)
STREAMING_STRATEGIES = tuple(m.name for m in METHODS.values() if m.family == "streaming")


@dataclass
class StrategySection:
    """Server side: which synchronous outer loop and its outer optimizer."""

    name: str = "diloco"  # a key of STRATEGY_OPTIMIZERS (diloco, fedavg, ..., dips, edit, a_edit)
    outer_optimizer: str = ""  # "" = the strategy's default (STRATEGY_OPTIMIZERS)
    outer_lr: float | None = None  # None = the strategy's default (STRATEGY_DEFAULTS)
    outer_momentum: float | None = None
    beta1: float = 0.9  # fedadam / fedyogi
    beta2: float = 0.99
    tau: float = 1e-3
    delay_buffer: int = 1  # delayed_nesterov N
    delay_activation: float = 0.0  # delayed_nesterov c
    # asynchronous strategies (docs/algorithms.md §5). A method's own values (FedBuff's K = 2 and
    # staleness weights, FedAsync's mixing, Di-PS's grace window) are its registry defaults.
    buffer_size: int = 1  # accepted updates per outer step (FedBuff K; Di-PS 1_000_000 = no cap)
    staleness_weighting: bool = False  # weight each update by s(tau) = 1/sqrt(1 + tau) (FedBuff)
    # FedAsync: scale each one-update step by alpha_t = mixing (1 + tau)^-staleness_exponent
    staleness_mixing: bool = False
    mixing: float = 0.6  # FedAsync alpha
    staleness_exponent: float = 0.5  # FedAsync a: alpha_t = alpha (1 + tau)^-a
    # close a step once grace_s has passed since the last arrival (Di-PS); grace_s >= 0 turns it on
    grace: bool = False
    grace_s: float = -1.0  # grace window; -1 = ski-rental estimate, >= 0 fixed
    grace_max_s: float = 60.0
    # dispatch: workers send Δ against the model they started from; current: they send parameters
    # and g = θ_current − θ_worker (Di-PS line 10; FedAsync's mixing)
    pseudo_grad_base: str = "dispatch"
    schedule_clock: str = ""  # local | global; "" = local for synchronous, global for asynchronous
    dynupd: bool = False  # H_i = ceil(H * speed_i / max speed) (DyLU / DynUpd)
    # none: every outer step uses outer_lr. share: lr x (accepted updates / live workers), so that
    # N single-update asynchronous steps add up to one synchronous step over N updates (as
    # delayed Nesterov's g/N does); not in the Di-PS paper: an fl-geo option.
    outer_lr_scaling: str = "none"
    weighting: str = "uniform"  # uniform | tokens
    inner_steps: int = 50  # H
    # A-EDiT: each inner loop runs for this long instead of H steps (0 = off). Wall clock: the
    # client trains until the elapsed time reaches it, finishing the step that crosses it, with H
    # as a cap; virtual clock: max(1, ceil(budget / step_time_i)) steps from the scenario.
    time_budget_s: float = 0.0
    # A-EDiT (atorch use_step_weight): w_i = (1 - r) * penalty weight_i + r * steps_i / sum steps
    step_weight_ratio: float = 0.0
    # EDiT warm-up (Algorithm 1, lines 7 and 19-20): the first t_warm inner steps are averaged
    # every step (rounds of one inner step, plain model averaging, no penalty) before the
    # periodic syncs start. Counted in inner steps; these rounds come on top of run.rounds.
    sync_warmup_steps: int = 0
    clients_per_round: int = 0  # 0 = every live node
    min_replies: int = 1  # fewer accepted updates than this: skip the outer step
    round_timeout_s: float = 0.0  # 0 = wait for every selected node (or its error reply)
    # Quorum rounds (synchronous): the round steps once ceil(quorum x selected) nodes replied
    # (0 = wait for all). The others keep training, their nodes busy; their replies come in a
    # later round and are dropped, or folded there with FedBuff's staleness weight 1/sqrt(1 + tau).
    quorum: float = 0.0
    late_replies: str = "drop"  # drop | fold
    # Reject an update whose L2 norm exceeds this multiple of the global model's (at least 1):
    # a broken or hostile update scaled x1e6 is finite and well-shaped. 0 = no bound.
    max_update_ratio: float = 10.0
    # job: a reply may claim at most steps x client.batch_size x client.seq_len x the site's
    # devices tokens (what its job could produce); none: trust the claim (a user's ClientApp
    # whose batches do not follow client.batch_size / seq_len).
    token_cap: str = "job"
    # Bounded influence (fl_geo.core.robust): median_norm rejects an update whose norm is more
    # than robust_factor x the median norm of the round's updates (synchronous; the round's
    # replies are held until it completes) or of the last robust_window updates (asynchronous).
    robust: str = "none"  # none | median_norm
    robust_factor: float = 3.0
    robust_window: int = 16
    # rank: fold replies in partition order (bit-reproducible sums; an early reply may wait in
    # memory for the ones before it); arrival: fold on arrival (never holds a reply).
    fold_order: str = "rank"


@dataclass
class FlGeoConfig:
    """The whole run."""

    run: RunSection = field(default_factory=RunSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    penalty: PenaltySection = field(default_factory=PenaltySection)
    halos: HalosSection = field(default_factory=HalosSection)
    streaming: StreamingSection = field(default_factory=StreamingSection)
    wire: WireSection = field(default_factory=WireSection)
    ps: PsSection = field(default_factory=PsSection)
    model: ModelConfig = field(default_factory=ModelConfig)  # the model's own dataclass
    data: DataSection = field(default_factory=DataSection)
    client: ClientSection = field(default_factory=ClientSection)


def _schema() -> DictConfig:
    cfg = OmegaConf.structured(FlGeoConfig)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _valid_keys(section: str | None) -> str:
    root = FlGeoConfig()
    obj: Any = getattr(root, section) if section else root
    return ", ".join(f.name for f in fields(obj)) if is_dataclass(obj) else ""


def _section_fields() -> dict[str, list[str]]:
    """Top-level keys that are sections, with their keys (for "a scalar where a section belongs")."""
    root = FlGeoConfig()
    return {f.name: [g.name for g in fields(getattr(root, f.name))]
            for f in fields(root) if is_dataclass(getattr(root, f.name))}


def _check_sections(values: Any, where: str) -> None:
    """A section (``data``, ``strategy``, ...) given a scalar or a list is a one-line error that
    lists the section's keys, instead of omegaconf's "int is not a subclass of DataSection"."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: a config is a mapping of sections ({', '.join(_section_fields())}), "
                          f"got {type(values).__name__}")
    for name, keys in _section_fields().items():
        if name in values and not isinstance(values[name], Mapping):
            raise ConfigError(f"{where}: '{name}' is a section, not a value ({values[name]!r}); set its keys, "
                              f"e.g. {name}.{keys[0]}=..., one of: {', '.join(keys)}")


def _load_yaml(p: Path) -> DictConfig:
    """A YAML config file, read with `fl_geo.yaml_safe.load_yaml` (plain data only, duplicate keys
    refused); every problem is one line with the file (and line, column): not valid YAML, a
    ``!!python`` tag, a key given twice, an empty file (it would run the defaults while the user
    meant something else), or a top level that is not a mapping of sections."""
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc})") from None
    values = load_yaml(text, str(p))
    if values is None:
        raise ConfigError(f"{p}: the file is empty (or only comments); a config is a mapping of sections "
                          f"({', '.join(_section_fields())}); leave the file out to run the defaults")
    _check_sections(values, str(p))
    try:
        return OmegaConf.create(values)
    except OmegaConfBaseException as exc:
        raise _wrap(exc, str(p)) from None


def _wrap(exc: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    section = key.split(".")[0] if "." in key else None
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hint = f" Valid keys here: {_valid_keys(section)}." if "not in" in first_line else ""
    return ConfigError(f"{where}: invalid config key or value '{key}': {first_line}{hint}")


def _merge_sources(base: DictConfig, path: str | Path | None, overrides: list[str] | None,
                   values: Mapping[str, Any] | None = None) -> DictConfig:
    cfg = base
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        loaded = _load_yaml(p)
        try:
            cfg = OmegaConf.merge(cfg, loaded)
        except OmegaConfBaseException as exc:
            raise _wrap(exc, str(p)) from None
    if values:
        _check_sections(values, "strategy arguments")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(dict(values)))
        except OmegaConfBaseException as exc:
            raise _wrap(exc, "strategy arguments") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. strategy.outer_lr=0.5)")
        key = item.partition("=")[0].strip()
        if key in _section_fields():
            keys = _section_fields()[key]
            raise ConfigError(f"override '{item}': '{key}' is a section, not a value; set its keys, "
                              f"e.g. {key}.{keys[0]}=..., one of: {', '.join(keys)}")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise _wrap(exc, f"override '{item}'") from None
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                values: Mapping[str, Any] | None = None, *, own_model: bool = False) -> FlGeoConfig:
    """Merge schema defaults, an optional YAML file and ``key=value`` overrides, then validate.

    The strategy's own defaults (`Method.defaults` in fl_geo.registry: EDiT's and Di-PS's penalty,
    FedBuff's staleness weights, CoCoDC's merge rule, ...) are the base the file and overrides are
    merged onto, so ``strategy.name=edit`` alone is full EDiT and any key the user sets still wins.
    ``values``: nested plain values (``{"strategy": {"outer_lr": 0.5}}``) merged after the file and
    before the overrides; how the public strategy classes build their config from keyword
    arguments. ``own_model``: see `validate`.
    """
    cfg = _merge_sources(_schema(), path, overrides, values)
    if cfg.strategy.name in METHODS and METHODS[cfg.strategy.name].defaults:
        try:
            base = OmegaConf.merge(_schema(), dict(METHODS[cfg.strategy.name].defaults))
        except OmegaConfBaseException as exc:  # a registry entry naming a key the schema lacks
            raise _wrap(exc, f"fl_geo.registry defaults of '{cfg.strategy.name}'") from None
        cfg = _merge_sources(base, path, overrides, values)
    out: FlGeoConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(out, own_model=own_model)
    return out


# Keys a resumed run may change without becoming another run (`run_identity` leaves them out):
# extending the budget (run.rounds, run.max_tokens; with client.total_steps=0 the inner LR
# schedule's length follows the new budget, so an extended run is not bit-identical to one
# started with the longer budget), where files go and how the run is watched (directories, run
# name, loggers, progress), how often checkpoints are written and kept, and the process and
# waiting settings of this machine (backend, threads, CPUs, node waits, the client device:
# a restart may land on another host). Everything else - strategy, optimizers, penalty, model,
# data, inner loop, wire precision, seeds, evaluation - shapes the model or its metrics history,
# so a checkpoint written under other values is another run's.
RESUME_MAY_CHANGE = frozenset({
    "run.resume", "run.rounds", "run.max_tokens", "run.name", "run.out_dir", "run.progress",
    "run.tensorboard", "run.loggers", "run.checkpoint_every", "run.checkpoint_keep", "run.checkpoint_dir",
    "run.client_state_dir", "run.backend", "run.sim_cpus", "run.server_threads", "run.threads_per_client",
    "run.ray_address", "run.client_cpus", "run.client_gpus",
    "run.min_nodes", "run.wait_nodes_timeout_s", "run.min_live_nodes", "run.min_live_wait_s",
    "client.device", "data.data_dir", "ps.workdir", "ps.retry_s", "ps.heartbeat_s", "ps.host",
    "ps.tls_certs_dir", "ps.allow_insecure_remote",
})


def run_identity(cfg: FlGeoConfig) -> dict[str, Any]:
    """The run identity a checkpoint carries (`fl_geo.core.checkpoint`): every resolved config
    value as ``{"section.key": value}`` except `RESUME_MAY_CHANGE`. Two configs with the same
    identity train the same model (strategy, model layout, data, seeds), so a resume may use
    the other's checkpoints; any difference makes them different runs."""
    flat: dict[str, Any] = {}
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in RESUME_MAY_CHANGE:
                flat[name] = value
    return flat


def config_from_yaml_string(text: str) -> FlGeoConfig:
    """Rebuild a config from :func:`to_yaml` output (how the ServerApp receives it)."""
    try:
        cfg = OmegaConf.merge(_schema(), OmegaConf.create(text))
    except OmegaConfBaseException as exc:
        raise _wrap(exc, "run config") from None
    out: FlGeoConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(out)
    return out


def to_yaml(cfg: FlGeoConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def section_to_json(section: Any) -> str:
    """Serialise one section for a Flower ConfigRecord (whose values must be scalars)."""
    return json.dumps(to_dict(section), sort_keys=True)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _require_finite(cfg: FlGeoConfig) -> None:
    """Every float of every section is a finite number: no key of the schema means anything by
    ``.inf`` or ``.nan`` (0 is the "off" / "no bound" value where there is one), and a NaN would
    slip through range checks written as ``x > 0`` (any comparison with NaN is false) only to
    poison the run later."""
    for section in fields(cfg):
        values = getattr(cfg, section.name)
        if not is_dataclass(values):
            continue
        for f in fields(values):
            value = getattr(values, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section.name}.{f.name} must be a finite number, got {value}")


def validate(cfg: FlGeoConfig, *, own_model: bool = False) -> None:
    """Cross-field checks that a schema of types cannot express.

    ``own_model``: the model that runs is the caller's (a public strategy class is handed it in
    ``start(grid, initial_arrays)``), not the one the ``model`` section describes, so the checks
    of other settings against that section's shape (streaming fragments against its blocks) are
    left to where the real model is known (the streaming loop checks its fragments there).
    """
    _require_finite(cfg)
    r, s, w, d, c, m = cfg.run, cfg.strategy, cfg.wire, cfg.data, cfg.client, cfg.model
    r.check()
    _require(not (r.checkpoint_every or r.resume) or s.name not in NO_CHECKPOINT_STRATEGIES,
             f"run.checkpoint_every / run.resume are not supported for strategy '{s.name}' yet: HALoS and the "
             "streaming loops keep in-flight transfers and fragment syncs that checkpoints do not hold")
    _require(
        s.name in STRATEGY_OPTIMIZERS,
        f"strategy.name '{s.name}' is unknown; valid: {', '.join(STRATEGY_OPTIMIZERS)}",
    )
    allowed = STRATEGY_OPTIMIZERS[s.name]
    # Fill strategy defaults in place so the resolved config written with the run is explicit.
    s.outer_optimizer = s.outer_optimizer or allowed[0]
    default_lr, default_mom = STRATEGY_DEFAULTS[s.name]
    s.outer_lr = default_lr if s.outer_lr is None else s.outer_lr
    s.outer_momentum = default_mom if s.outer_momentum is None else s.outer_momentum
    _require(
        s.outer_optimizer in allowed,
        f"strategy '{s.name}' uses outer_optimizer {' or '.join(allowed)}, got '{s.outer_optimizer}'",
    )
    _require(s.weighting in WEIGHTINGS, f"strategy.weighting must be one of {WEIGHTINGS}, got '{s.weighting}'")
    _require(s.inner_steps >= 1, f"strategy.inner_steps must be >= 1, got {s.inner_steps}")
    _require(s.outer_lr > 0, f"strategy.outer_lr must be > 0, got {s.outer_lr}")
    _require(0 <= s.outer_momentum < 1, f"strategy.outer_momentum must be in [0, 1), got {s.outer_momentum}")
    _require(s.delay_buffer >= 1, "strategy.delay_buffer must be >= 1")
    _require(s.buffer_size >= 1, f"strategy.buffer_size must be >= 1 (leave it out for the strategy's default), "
                                 f"got {s.buffer_size}")
    is_async = s.name in ASYNC_STRATEGIES
    buffered = METHODS[s.name].family == "async"  # the asynchronous buffered loop (not HALoS)
    _require(not s.staleness_mixing or (buffered and s.buffer_size == 1),
             "strategy.staleness_mixing (FedAsync) mixes one update at a time: it needs an asynchronous "
             f"buffered strategy and strategy.buffer_size=1, got '{s.name}' with buffer_size={s.buffer_size}")
    s.grace = s.grace or s.grace_s >= 0  # a fixed window turns the grace window on (resolved explicitly)
    _require(s.pseudo_grad_base in ("dispatch", "current"), "strategy.pseudo_grad_base must be dispatch or current")
    _require(not (s.pseudo_grad_base == "current" and not is_async), "strategy.pseudo_grad_base=current is for asynchronous strategies")
    s.schedule_clock = s.schedule_clock or ("global" if is_async else "local")
    _require(s.schedule_clock in ("local", "global"), "strategy.schedule_clock must be local or global")
    _require(s.grace_s >= 0 or s.grace_s == -1, "strategy.grace_s must be >= 0 or -1 (auto)")
    _require(0 < s.mixing <= 1, "strategy.mixing must be in (0, 1]")
    _require(s.outer_lr_scaling in ("none", "share"), "strategy.outer_lr_scaling must be none or share")
    _require(s.outer_lr_scaling == "none" or is_async, "strategy.outer_lr_scaling=share is for asynchronous strategies")
    p = cfg.penalty
    p.check()
    if buffered and p.enabled:
        _check_penalised_weights(s, p)
    _require(s.time_budget_s >= 0, f"strategy.time_budget_s must be >= 0, got {s.time_budget_s}")
    _require(not (s.time_budget_s > 0 and is_async), "strategy.time_budget_s is for synchronous strategies (A-EDiT)")
    _require(s.name != "a_edit" or s.time_budget_s > 0, "strategy a_edit needs strategy.time_budget_s > 0 (seconds of inner training per round)")
    _require(0 <= s.step_weight_ratio <= 1, f"strategy.step_weight_ratio must be in [0, 1], got {s.step_weight_ratio}")
    _require(s.step_weight_ratio == 0 or (p.enabled and not is_async),
             "strategy.step_weight_ratio mixes step weights into the penalty's weights: it needs penalty.enabled and a synchronous strategy")
    _require(s.sync_warmup_steps >= 0, f"strategy.sync_warmup_steps must be >= 0, got {s.sync_warmup_steps}")
    _require(s.sync_warmup_steps == 0 or not is_async, "strategy.sync_warmup_steps (EDiT warm-up) is for synchronous strategies")
    _require(not s.dynupd or r.clock == "virtual", "strategy.dynupd needs run.clock=virtual (worker speeds come from the scenario)")
    h = cfg.halos
    h.check()
    _require(not (s.name == "halos" and p.enabled), "penalty at the HALoS global server is not supported yet (penalty.enabled=false)")
    _validate_streaming(cfg, own_model)
    _require(s.clients_per_round >= 0, "strategy.clients_per_round must be >= 0")
    _require(s.min_replies >= 1, "strategy.min_replies must be >= 1")
    _require(s.round_timeout_s >= 0, "strategy.round_timeout_s must be >= 0")
    _require(s.max_update_ratio >= 0, f"strategy.max_update_ratio must be >= 0, got {s.max_update_ratio}")
    _require(0 <= s.quorum <= 1, f"strategy.quorum must be in [0, 1] (a share of the selected nodes; 0 = all), got {s.quorum}")
    _require(s.quorum == 0 or not is_async, "strategy.quorum is for synchronous strategies (asynchronous ones never wait)")
    _require(s.quorum == 0 or (s.name not in STREAMING_STRATEGIES and s.name != "halos"),
             f"strategy.quorum is for the synchronous DiLoCo-style loop, not for strategy '{s.name}'")
    _require(s.late_replies in ("drop", "fold"), f"strategy.late_replies must be drop or fold, got '{s.late_replies}'")
    _require(s.late_replies == "drop" or s.robust == "none",
             "strategy.late_replies=fold with strategy.robust=median_norm is not supported: a late reply is folded "
             "outside the round whose median it would be judged against; use late_replies=drop")
    _require(s.late_replies == "drop" or not p.enabled,
             "strategy.late_replies=fold with the penalty (EDiT) is not supported; use late_replies=drop")
    _require(s.quorum == 0 or not r.checkpoint_every,
             "strategy.quorum with run.checkpoint_every is not supported yet: a checkpoint between rounds "
             "would miss the late jobs still in flight")
    _require(s.token_cap in ("job", "none"), f"strategy.token_cap must be job or none, got '{s.token_cap}'")
    _require(s.robust in ("none", "median_norm"), f"strategy.robust must be none or median_norm, got '{s.robust}'")
    _require(s.robust_factor >= 1, f"strategy.robust_factor must be >= 1, got {s.robust_factor}")
    _require(s.robust_window >= 3, f"strategy.robust_window must be >= 3, got {s.robust_window}")
    _require(s.robust == "none" or (s.name != "halos" and s.name not in STREAMING_STRATEGIES and not cfg.ps.followers),
             f"strategy.robust={s.robust} is for the synchronous and single-server asynchronous loops, "
             f"not for strategy '{s.name}'{' with ps.followers' if cfg.ps.followers else ''}")
    _require(0 <= s.beta1 < 1 and 0 <= s.beta2 < 1 and s.tau > 0,
             f"strategy.beta1 and beta2 must be in [0, 1) and strategy.tau > 0, got {s.beta1}, {s.beta2}, {s.tau}")
    _require(s.delay_activation >= 0 and s.staleness_exponent >= 0 and s.grace_max_s >= 0,
             "strategy.delay_activation, staleness_exponent and grace_max_s must be >= 0, got "
             f"{s.delay_activation}, {s.staleness_exponent}, {s.grace_max_s}")
    ps = cfg.ps
    ps.check()
    if ps.followers:
        _require(s.name == "dips", f"ps.followers (the sharded parameter server) is for strategy dips, not '{s.name}'")
        _require(not p.enabled or p.granularity == "global",
                 "ps.followers needs penalty.granularity=global (the leader decides on whole updates, Di-PS)")
        _require(ps.transport == "local" or not r.checkpoint_every or ps.checkpoint_keep > r.checkpoint_every,
                 f"ps.checkpoint_keep={ps.checkpoint_keep} must exceed run.checkpoint_every={r.checkpoint_every}: a "
                 "resumed leader needs every follower's checkpoint of the leader's last checkpointed step")
        _require(s.outer_optimizer in ("nesterov", "delayed_nesterov"), "ps.followers supports the nesterov outer optimizers")
    _require(s.fold_order in ("rank", "arrival"), f"strategy.fold_order must be rank or arrival, got '{s.fold_order}'")
    w.check()
    d.check()
    out_of_range = [p for p in d.noise_partitions if not 0 <= p < r.num_clients]
    _require(not out_of_range, f"data.noise_partitions {out_of_range} out of range [0, run.num_clients={r.num_clients})")
    _resolve_vocab(d, m)
    c.check()
    if m.kind == "hf":
        _validate_hf(m, c.seq_len)
    else:
        _require(c.seq_len <= m.max_seq_len, f"client.seq_len ({c.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    try:
        m.validate()
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None


def _check_penalised_weights(s: StrategySection, p: PenaltySection) -> None:
    """The asynchronous buffered loop with the penalty on weights updates by ``penalty.weighting``
    alone (docs/algorithms.md §4, step 4), so a ``strategy.weighting`` or
    ``strategy.staleness_weighting`` that says otherwise would be ignored: a one-line error."""
    parts = p.weighting.split("*")
    _require((s.weighting == "tokens") == ("tokens" in parts),
             f"strategy.weighting={s.weighting} disagrees with penalty.weighting={p.weighting}: with the penalty on, "
             "updates are weighted by penalty.weighting; set both to the weighting you mean (Di-PS: tokens)")
    _require(not s.staleness_weighting or "staleness" in parts,
             f"strategy.staleness_weighting=true has no effect with the penalty on; add it to the penalty's weights "
             f"(penalty.weighting={p.weighting}*staleness) or set strategy.staleness_weighting=false")


def _resolve_vocab(d: DataSection, m: ModelConfig) -> None:
    """``model.vocab_size`` from ``data.tokenizer`` when it is not ``byte``: ``bpe`` gives
    ``data.bpe_vocab_size`` (the trainer may stop short of it on a tiny corpus; the unused rows are
    never a target), a directory its tokenizer's size. The schema default 256 counts as unset; any
    other value that differs is a config error (the model could not embed every token id)."""
    if d.tokenizer == "byte":
        return
    if d.tokenizer == "bpe":
        from fl_geo.data.bpe import MIN_BPE_VOCAB, require_tokenizers

        require_tokenizers()  # a missing optional extra is one line now, not a failure in every ClientApp
        _require(MIN_BPE_VOCAB <= d.bpe_vocab_size <= 1 << 24,
                 f"data.bpe_vocab_size must be in [{MIN_BPE_VOCAB}, {1 << 24}] (256 byte symbols, the "
                 f"end-of-text token and at least one merge), got {d.bpe_vocab_size}")
        size = d.bpe_vocab_size
    else:
        from fl_geo.data.partition import make_tokenizer

        size = make_tokenizer(d.tokenizer, None, d.val_fraction, d.bpe_vocab_size, None).vocab_size
    vocab = getattr(m, "vocab_size", None)
    if vocab is None:
        return
    _require(vocab in (256, size), f"model.vocab_size={vocab} does not match data.tokenizer={d.tokenizer} "
                                   f"(vocabulary {size}); leave model.vocab_size unset")
    m.vocab_size = size


def _model_layers(m: ModelConfig) -> tuple[int, str]:
    """The model's number of transformer blocks and how to name it in a message."""
    if m.kind == "hf":
        from fl_geo.inner.hf import hf_shape

        shape = hf_shape(m)
        return shape.layers, f"the layers of the model ({shape.source})"
    return m.n_layers, "model.n_layers"


def _validate_hf(m: ModelConfig, seq_len: int) -> None:
    """``model.kind: hf``: the package is there, a known preset or a readable local checkpoint
    whose vocabulary covers the tokenizer's, and room for client.seq_len positions (read
    without importing ``transformers``; fl_geo.inner.hf)."""
    from fl_geo.inner.hf import HF_EXTRA_HINT, hf_shape, transformers_available

    _require(transformers_available(), HF_EXTRA_HINT)
    shape = hf_shape(m)
    _require(shape.max_positions is None or seq_len <= shape.max_positions,
             f"client.seq_len ({seq_len}) exceeds the {shape.max_positions} positions of the model ({shape.source})")


def _validate_streaming(cfg: FlGeoConfig, own_model: bool) -> None:
    """The ``streaming`` section: ranges always (the defaults pass); the schedule and the
    strategy knobs the streaming loop does not implement only for streaming_diloco / cocodc.
    P against the model's blocks only when the ``model`` section is the model that runs (not
    ``own_model``: the streaming loop checks the real model at start)."""
    st, s = cfg.streaming, cfg.strategy
    st.check()
    if s.name not in STREAMING_STRATEGIES:
        return
    _require(st.quantize == "none" or cfg.wire.up == "fp32",
             f"streaming.quantize={st.quantize} replaces wire.up for the fragment updates; leave "
             f"wire.up at fp32 (got {cfg.wire.up})")
    P, H = st.fragments, s.inner_steps
    if not own_model:
        layers, where = _model_layers(cfg.model)
        _require(layers >= P,
                 f"streaming.fragments (P={P}) must be <= {where} ({layers}): "
                 "every fragment needs at least one transformer block")
    _require(st.adaptive or H % P == 0,
             f"streaming.fragments (P={P}) must divide strategy.inner_steps (H={H}) for the fixed "
             "schedule (or set streaming.adaptive=true)")
    _require(st.overlap * P < H,
             f"streaming.overlap (tau={st.overlap}) must be < strategy.inner_steps / streaming.fragments "
             f"(H/P = {H / P:g}) so that a fragment's sync ends before the next one starts")
    for key, bad in (("penalty.enabled", cfg.penalty.enabled), ("strategy.time_budget_s", s.time_budget_s > 0),
                     ("strategy.dynupd", s.dynupd), ("strategy.sync_warmup_steps", s.sync_warmup_steps > 0),
                     ("strategy.clients_per_round", s.clients_per_round > 0)):
        _require(not bad, f"{key} is not supported by strategy {s.name} (every worker trains every "
                          "message and keeps its own model between them)")


def schedule_length(cfg: FlGeoConfig) -> int:
    """Inner LR schedule length, in the units the schedule position counts.

    Explicit ``client.total_steps`` wins. Synchronous (``schedule_clock: local``): each worker's
    own steps, rounds x H (or each worker's share of ``run.max_tokens`` when that is smaller).
    Asynchronous (``global``, docs/algorithms.md §1): the position is the number
    of worker steps dispatched to all workers before a job plus its local step index, so the length
    is every worker's steps together: the token budget / (batch x seq) when one is set, else the
    outer steps times the updates each one takes times H.
    """
    if cfg.client.total_steps:
        return cfg.client.total_steps
    s, r = cfg.strategy, cfg.run
    # tokens one worker step consumes: client.batch_size is per process, a site runs client.devices
    step_tokens = cfg.client.batch_size * cfg.client.devices * cfg.client.seq_len
    if s.schedule_clock == "local":
        steps = r.rounds * s.inner_steps
        if r.max_tokens:  # the budget ends the run first: each worker's share of it
            steps = min(steps, max(1, r.max_tokens // (step_tokens * r.num_clients)))
        return steps + s.sync_warmup_steps
    if r.max_tokens:
        return max(1, r.max_tokens // step_tokens)
    return max(1, r.rounds * s.inner_steps * min(s.buffer_size, r.num_clients))


def warmup_length(cfg: FlGeoConfig) -> int:
    """Warm-up in the schedule's units: under the global clock all workers' steps count, so the
    same per-worker warm-up spans num_clients times as many positions."""
    scale = cfg.run.num_clients if cfg.strategy.schedule_clock == "global" else 1
    return cfg.client.warmup_steps * scale
