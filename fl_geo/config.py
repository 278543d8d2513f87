"""One configuration schema for a whole fl-geo run.

Every knob lives in one omegaconf structured config (`FlGeoConfig`, one dataclass per section) so
that YAML files in ``configs/``, dotted command-line overrides (``strategy.outer_lr=0.5``) and the
Flower run config all resolve to the same validated object. Unknown keys and wrong types are
rejected here, before any process starts, with a message that names the offending key and the
valid ones: a typo in a long experiment sweep must not silently fall back to a default.

Each section's dataclass lives beside the code that reads it and checks its own keys
(``check()``): ``run_settings``, ``strategy_settings``, ``core/penalty_settings``, ``halos/settings``,
``core/streaming_settings``, ``runtime/wire_settings``, ``ps/settings``, ``data/settings``,
``clients/settings`` (``fl_geo.clients.settings``) and ``inner/model`` (``ModelConfig``);
``config_schema`` composes them into `FlGeoConfig`, and ``config_files`` reads and merges YAML
files, overrides and keyword values and writes a config back as text. This module puts a run
together (`load_config`: the method's defaults under what the user gave) and holds the checks
that read more than one section (`validate`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_geo.clients.settings import ClientSection
from fl_geo.config_files import (
    merge_sources,
    read_sources,
    schema,
    section_to_json,
    to_dict,
    to_yaml,
    user_strategy,
    wrap_error,
)
from fl_geo.config_schema import FlGeoConfig
from fl_geo.copy_cache import CopyCache
from fl_geo.core.penalty_settings import PenaltySection
from fl_geo.core.streaming_settings import StreamingSection
from fl_geo.data.settings import DataSection
from fl_geo.errors import ConfigError, require
from fl_geo.halos.settings import HalosSection
from fl_geo.inner.model_config import ModelConfig
from fl_geo.ps.settings import PsSection
from fl_geo.registry import METHODS
from fl_geo.run_identity import RESUME_MAY_CHANGE, run_identity  # noqa: F401  (re-exported: its historical home)
from fl_geo.run_settings import RunSection
from fl_geo.runtime.wire_settings import WIRE_PRECISIONS, WireSection
from fl_geo.strategy_settings import (
    ASYNC_STRATEGIES,
    NO_CHECKPOINT_STRATEGIES,
    STRATEGY_DEFAULTS,
    STRATEGY_OPTIMIZERS,
    STREAMING_STRATEGIES,
    WEIGHTINGS,
    StrategySection,
)

# The section classes and strategy tables are defined beside the code that owns them and
# re-exported here, so ``from fl_geo.config import StrategySection`` keeps working.
__all__ = [
    "ASYNC_STRATEGIES", "NO_CHECKPOINT_STRATEGIES", "RESUME_MAY_CHANGE", "STRATEGY_DEFAULTS",
    "STRATEGY_OPTIMIZERS", "STREAMING_STRATEGIES", "WEIGHTINGS", "WIRE_PRECISIONS",
    "ClientSection", "ConfigError", "DataSection", "FlGeoConfig", "HalosSection", "ModelConfig",
    "PenaltySection", "PsSection", "RunSection", "StrategySection", "StreamingSection",
    "WireSection", "config_from_yaml_string", "load_config", "run_identity", "schedule_length",
    "section_to_json", "to_dict", "to_yaml", "uplink_wire", "validate", "warmup_length"
]


# Finished configs by their inputs (the file's bytes, the overrides, the values, own_model): a load
# merges ~20 OmegaConf sources into the structured schema (16-37 ms); a copy of a finished one takes
# 0.1 ms. The public strategy classes load a config on every construction, and callers that build
# the same method again (sweeps, seed groups, tests: 70 % of loads repeated) get a copy instead.
_cache: CopyCache[FlGeoConfig] = CopyCache(256)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                values: Mapping[str, Any] | None = None, *, own_model: bool = False) -> FlGeoConfig:
    """Merge schema defaults, the method's defaults, an optional YAML file and ``key=value``
    overrides, then validate.

    The strategy's own defaults (its settings dataclass, `Method.settings` in fl_geo.registry,
    and `Method.defaults`: EDiT's and Di-PS's penalty, FedBuff's staleness weights, CoCoDC's
    merge rule, ...) are the base the file and overrides are merged onto, so
    ``strategy.name=edit`` alone is full EDiT and any key the user sets still wins.
    ``values``: nested plain values (``{"strategy": {"outer_lr": 0.5}}``) merged after the file and
    before the overrides; how the public strategy classes build their config from keyword
    arguments. ``own_model``: see `validate`.

    Each call returns a config of its own (a copy of a cached one where the same inputs were
    loaded before: validation reads nothing but its inputs, so equal inputs give equal configs).
    """
    key = _cache_key(path, overrides, values, own_model)
    if key is not None and (hit := _cache.get(key)) is not None:
        return hit
    out = _load_config(path, overrides, values, own_model)
    if key is not None:
        _cache.put(key, out)
    return out


def _cache_key(path: str | Path | None, overrides: list[str] | None, values: Mapping[str, Any] | None,
               own_model: bool) -> tuple[Any, ...] | None:
    """What a load depends on, exactly (types included: ``1`` and ``1.0`` and ``True`` differ), or
    None where it cannot be told (a missing file, a value that is not plain data): no caching."""
    content = None
    if path:
        try:
            content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            return None
    try:
        plain_values = _plain_key(values) if values else None
    except TypeError:
        return None
    if overrides is not None and not all(isinstance(o, str) for o in overrides):
        return None
    return (str(path) if path else None, content, tuple(overrides or ()), plain_values, bool(own_model))


def _plain_key(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return (type(value).__name__, repr(value))
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((_plain_key(k), _plain_key(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_plain_key(v) for v in value))
    raise TypeError(f"not plain data: {type(value).__name__}")


def _load_config(path: str | Path | None, overrides: list[str] | None, values: Mapping[str, Any] | None,
                 own_model: bool) -> FlGeoConfig:
    sources = read_sources(path, overrides, values)
    name, user_keys = user_strategy(sources)
    name = StrategySection.name if name is None else name
    if name in METHODS:  # under the user's sources; a default naming a key the schema lacks is named as such
        defaults = OmegaConf.merge(OmegaConf.create(dict(METHODS[name].defaults)),
                                   OmegaConf.create(METHODS[name].settings.default_values()))
        sources = [(f"the defaults of strategy '{name}'", defaults), *sources]
    cfg = merge_sources(schema(), sources)
    out: FlGeoConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(out, own_model=own_model)
    _check_strategy_keys(out.strategy, user_keys)  # the keys the file, the values and the overrides set
    return out


def _check_strategy_keys(strategy: StrategySection, keys: set[str]) -> None:
    """A config's ``strategy:`` section may set the fields of the method's settings dataclass only
    (`fl_geo.registry.Method.settings`): a key that the method has no use for (``grace_s`` for
    DiLoCo, ``time_budget_s`` for Di-PS) would otherwise be accepted and ignored. A key left at
    the section's default changes nothing and passes: a run's own ``config.yaml`` lists every key
    of the section, and ``fl-geo eval`` / ``resume`` read it back."""
    settings = METHODS[strategy.name].settings
    default = StrategySection()
    unused = sorted(k for k in keys - settings.strategy_keys()
                    if not hasattr(default, k) or getattr(strategy, k) != getattr(default, k))
    require(not unused, f"strategy.{unused[0] if unused else ''} is not a setting of strategy '{strategy.name}' "
                        f"({settings.__name__}); its strategy keys: {', '.join(sorted(settings.strategy_keys()))}")


def config_from_yaml_string(text: str) -> FlGeoConfig:
    """Rebuild a config from :func:`to_yaml` output (how the ServerApp receives it)."""
    try:
        cfg = OmegaConf.merge(schema(), OmegaConf.create(text))
    except OmegaConfBaseException as exc:
        raise wrap_error(exc, "run config") from None
    out: FlGeoConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(out)
    return out


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

    Each section checks its own keys (``cfg.<section>.check()``, in the module that owns the
    section); the checks that read two sections are the ``_check_*`` functions here. Defaults that
    depend on the strategy (outer optimizer, lr and momentum, grace window, schedule clock) and
    the model's vocabulary are filled in place before the checks that read them.

    ``own_model``: the model that runs is the caller's (a public strategy class is handed it in
    ``start(grid, initial_arrays)``), not the one the ``model`` section describes, so the checks
    of other settings against that section's shape (streaming fragments against its blocks) are
    left to where the real model is known (the streaming loop checks its fragments there).
    """
    _require_finite(cfg)
    cfg.run.check()
    _check_checkpoints(cfg)
    cfg.strategy.check()
    cfg.penalty.check()
    _check_strategy(cfg)
    cfg.halos.check()
    _check_halos(cfg)
    cfg.streaming.check()
    _check_streaming(cfg, own_model)
    cfg.ps.check()
    _check_sharded_ps(cfg)
    cfg.wire.check()
    _check_wire(cfg)
    cfg.data.check()
    _check_data(cfg)
    cfg.client.check()
    _check_model(cfg, own_model)
    METHODS[cfg.strategy.name].settings.from_config(cfg)  # the method's own checks (its settings' check())


def _check_wire(cfg: FlGeoConfig) -> None:
    """``wire.compress`` / ``wire.compress_down`` (after `WireSection.check`): the uplink is wired
    for the pseudo-gradient replies of the synchronous and asynchronous loops (the sharded
    parameter server's data path included), of HALoS's workers and of the streaming fragments;
    the downlink for the synchronous and asynchronous loops (the sharded parameter server's
    followers included) and HALoS's workers (docs/compression.md)."""
    w, s = cfg.wire, cfg.strategy
    family = METHODS[s.name].family
    for key, codec, families, where in (
            ("wire.compress", w.compress, ("sync", "async", "halos", "streaming"),
             "the synchronous, asynchronous and streaming loops and HALoS's workers"),
            ("wire.compress_down", w.compress_down, ("sync", "async", "halos"),
             "the synchronous and asynchronous loops and HALoS's workers")):
        if codec == "none":
            continue
        require(family in families, f"{key}={codec} is wired for {where} only, not strategy '{s.name}' ({family}); "
                                    f"use {key}=none")
        # down: a site trains from x̂ while g = θ_current − θ_site would be taken against x
        require(s.pseudo_grad_base != "current", f"{key}={codec} works with pseudo-gradients: "
                                                  "strategy.pseudo_grad_base=current has the sites send their parameters")


def uplink_wire(cfg: FlGeoConfig) -> WireSection:
    """The ``wire`` section the sites' uplink follows: ``cfg.wire``, or for a streaming method with
    the old ``streaming.quantize: int8 | int4`` the section it is an alias of (``wire.compress`` of
    that codec, ``wire.compress_block = streaming.quantize_block``, no error feedback: the bytes
    and the decoded values of the old fragment quantiser, docs/compression.md)."""
    st = cfg.streaming
    if cfg.strategy.name not in STREAMING_STRATEGIES or st.quantize == "none":
        return cfg.wire
    return replace(cfg.wire, compress=st.quantize, compress_block=st.quantize_block, error_feedback=False)


def _check_checkpoints(cfg: FlGeoConfig) -> None:
    """Checkpoints and resume only for the loops whose state a checkpoint holds."""
    r, s = cfg.run, cfg.strategy
    require(not (r.checkpoint_every or r.resume) or s.name not in NO_CHECKPOINT_STRATEGIES,
            f"run.checkpoint_every / run.resume are not supported for strategy '{s.name}' yet: HALoS's "
            "local parameter servers keep in-flight transfers and state that checkpoints do not hold")


def _check_strategy(cfg: FlGeoConfig) -> None:
    """The strategy's settings that depend on the penalty, the clock, checkpoints or the sharded
    parameter server (after `StrategySection.check` has filled its defaults)."""
    r, s, p = cfg.run, cfg.strategy, cfg.penalty
    is_async = s.name in ASYNC_STRATEGIES
    if METHODS[s.name].family == "async" and p.enabled:  # the asynchronous buffered loop (not HALoS)
        _check_penalised_weights(s, p)
    require(s.step_weight_ratio == 0 or (p.enabled and not is_async),
            "strategy.step_weight_ratio mixes step weights into the penalty's weights: it needs penalty.enabled and a synchronous strategy")
    require(not s.dynupd or r.clock == "virtual", "strategy.dynupd needs run.clock=virtual (worker speeds come from the scenario)")
    require(s.late_replies == "drop" or not p.enabled,
            "strategy.late_replies=fold with the penalty (EDiT) is not supported; use late_replies=drop")
    require(s.quorum == 0 or not r.checkpoint_every,
            "strategy.quorum with run.checkpoint_every is not supported yet: a checkpoint between rounds "
            "would miss the late jobs still in flight")
    require(s.robust not in ("trimmed_mean", "median") or not p.enabled,
            f"strategy.robust={s.robust} replaces the weighted mean by a coordinate rule, which the penalty's "
            "per-module weights cannot fold into; with the penalty use strategy.robust=cosine or centered_clip")
    if METHODS[s.name].family == "data_parallel":  # ddp: the server steps AdamW on one-process gradients
        require(not p.enabled, "the penalty (penalty.enabled) judges pseudo-gradients: strategy ddp averages gradients "
                               "and takes no penalty")
        require(cfg.client.devices == 1, f"strategy ddp computes each site's gradient in one process: client.devices "
                                         f"must be 1, got {cfg.client.devices}")
        require(cfg.client.optimizer == "adamw", "strategy ddp steps the inner AdamW at the server, which holds the flat "
                                                 "parameters, not the model, so cannot tell Muon's hidden matrices from "
                                                 "embeddings and the head: client.optimizer must be adamw")
    require(s.robust == "none" or (s.name != "halos" and s.name not in STREAMING_STRATEGIES and not cfg.ps.followers),
            f"strategy.robust={s.robust} is for the synchronous and single-server asynchronous loops, "
            f"not for strategy '{s.name}'{' with ps.followers' if cfg.ps.followers else ''}")


def _check_halos(cfg: FlGeoConfig) -> None:
    """The HALoS global server takes no penalty yet."""
    require(not (cfg.strategy.name == "halos" and cfg.penalty.enabled),
            "penalty at the HALoS global server is not supported yet (penalty.enabled=false)")


def _check_penalised_weights(s: StrategySection, p: PenaltySection) -> None:
    """The asynchronous buffered loop with the penalty on weights updates by ``penalty.weighting``
    alone (docs/algorithms.md §4, step 4), so a ``strategy.weighting`` or
    ``strategy.staleness_weighting`` that says otherwise would be ignored: a one-line error."""
    parts = p.weighting.split("*")
    require((s.weighting == "tokens") == ("tokens" in parts),
            f"strategy.weighting={s.weighting} disagrees with penalty.weighting={p.weighting}: with the penalty on, "
            "updates are weighted by penalty.weighting; set both to the weighting you mean (Di-PS: tokens)")
    require(not s.staleness_weighting or "staleness" in parts,
            f"strategy.staleness_weighting=true has no effect with the penalty on; add it to the penalty's weights "
            f"(penalty.weighting={p.weighting}*staleness) or set strategy.staleness_weighting=false")


def _check_sharded_ps(cfg: FlGeoConfig) -> None:
    """With ``ps.followers`` > 0: what the sharded parameter server needs of the strategy, the penalty
    and the run's checkpoints."""
    r, s, p, ps = cfg.run, cfg.strategy, cfg.penalty, cfg.ps
    if not ps.followers:
        return
    require(s.name == "dips", f"ps.followers (the sharded parameter server) is for strategy dips, not '{s.name}'")
    require(not p.enabled or p.granularity == "global",
            "ps.followers needs penalty.granularity=global (the leader decides on whole updates, Di-PS)")
    require(ps.transport == "local" or not r.checkpoint_every or ps.checkpoint_keep > r.checkpoint_every,
            f"ps.checkpoint_keep={ps.checkpoint_keep} must exceed run.checkpoint_every={r.checkpoint_every}: a "
            "resumed leader needs every follower's checkpoint of the leader's last checkpointed step")
    require(s.outer_optimizer in ("nesterov", "delayed_nesterov"), "ps.followers supports the nesterov outer optimizers")


def _check_data(cfg: FlGeoConfig) -> None:
    """The noisy partitions exist, and ``model.vocab_size`` follows the tokenizer (filled in place)."""
    d, r = cfg.data, cfg.run
    out_of_range = [p for p in d.noise_partitions if not 0 <= p < r.num_clients]
    require(not out_of_range, f"data.noise_partitions {out_of_range} out of range [0, run.num_clients={r.num_clients})")
    _resolve_vocab(d, cfg.model)


def _check_model(cfg: FlGeoConfig, own_model: bool = False) -> None:
    """``client.seq_len`` fits the model's positions, then the ``model`` section's own checks. With
    ``own_model`` (a public strategy: the model is the one ``start()`` is handed) the ``model``
    section does not describe the model that runs, so ``client.seq_len`` is not held to its
    ``max_seq_len``; the section is still checked, as fl-geo's built-in ClientApp builds it."""
    c, m = cfg.client, cfg.model
    if m.kind == "hf":  # a model the config names (fl-geo's client builds it): checked either way
        m.check_hf(c.seq_len)
    elif not own_model:
        require(c.seq_len <= m.max_seq_len, f"client.seq_len ({c.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    try:
        m.validate()
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None


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
        require(MIN_BPE_VOCAB <= d.bpe_vocab_size <= 1 << 24,
                f"data.bpe_vocab_size must be in [{MIN_BPE_VOCAB}, {1 << 24}] (256 byte symbols, the "
                f"end-of-text token and at least one merge), got {d.bpe_vocab_size}")
        size = d.bpe_vocab_size
    else:
        from fl_geo.data.partition import make_tokenizer

        size = make_tokenizer(d.tokenizer, None, d.val_fraction, d.bpe_vocab_size, None).vocab_size
    vocab = getattr(m, "vocab_size", None)
    if vocab is None:
        return
    require(vocab in (256, size), f"model.vocab_size={vocab} does not match data.tokenizer={d.tokenizer} "
                                  f"(vocabulary {size}); leave model.vocab_size unset")
    m.vocab_size = size


def _check_streaming(cfg: FlGeoConfig, own_model: bool) -> None:
    """The ``streaming`` section against the others, for streaming_diloco / cocodc only (its
    ranges are `StreamingSection.check`): the schedule against H, the strategy knobs the
    streaming loop does not implement, and P against the model's blocks only when the ``model``
    section is the model that runs (not ``own_model``: the streaming loop checks the real model
    at start)."""
    st, s = cfg.streaming, cfg.strategy
    if s.name not in STREAMING_STRATEGIES:
        return
    require(st.quantize == "none" or cfg.wire.up == "fp32",
            f"streaming.quantize={st.quantize} replaces wire.up for the fragment updates; leave "
            f"wire.up at fp32 (got {cfg.wire.up})")
    require(st.quantize == "none" or cfg.wire.compress == "none",
            f"streaming.quantize={st.quantize} is an alias of wire.compress={st.quantize} "
            f"wire.compress_block={st.quantize_block} wire.error_feedback=false; set wire.compress only")
    P = st.fragments
    if not own_model:
        layers, where = cfg.model.blocks()
        require(layers >= P,
                f"streaming.fragments (P={P}) must be <= {where} ({layers}): "
                "every fragment needs at least one transformer block")
    # P against H and tau: StreamingDiLoCoSettings.check (validate calls it last)
    for key, bad in (("penalty.enabled", cfg.penalty.enabled), ("strategy.time_budget_s", s.time_budget_s > 0),
                     ("strategy.dynupd", s.dynupd), ("strategy.sync_warmup_steps", s.sync_warmup_steps > 0),
                     ("strategy.clients_per_round", s.clients_per_round > 0)):
        require(not bad, f"{key} is not supported by strategy {s.name} (every worker trains every "
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
