"""The strategy registry: every method's facts in one entry.

Adding a method is one `Method` entry here plus its public class and settings dataclass
(``fl_geo.strategies``). The config schema (`fl_geo.config`) derives its tables from `METHODS`
(which outer optimizers a method may use and which it defaults to, its outer lr and momentum,
whether server checkpoints cover it); ``load_config`` merges the entry's ``defaults`` and the
settings dataclass's defaults (FedBuff's K and staleness weights, Di-PS's grace window, CoCoDC's
merge rule, ...) under every config that names it, and checks its ``strategy:`` keys against
that dataclass; ``fl-geo run`` / ``flwr run .`` build the public class (`Method.strategy_class`)
from a config through `fl_geo.strategies.build_strategy`. So the CLI and a Flower user's own
ServerApp run one code path, and the loops read settings, never the method's name.

This module is plain data: it imports nothing from fl-geo or Flower at import time (the class and
settings are looked up on first use), so the lowest layers (the config schema) can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The outer loop a method runs on (fl_geo.strategies: SyncOuterLoop, AsyncOuterLoop, HalosLoop,
# StreamingLoop, DataParallelLoop; ps.followers turns an asynchronous Di-PS into ShardedDiPSLoop).
FAMILIES = ("sync", "async", "halos", "streaming", "data_parallel")


@dataclass(frozen=True)
class Method:
    """One method: its config name, public class and defaults.

    ``optimizers``: the outer optimizers it may use, the first being its default.
    ``outer_lr`` / ``outer_momentum``: the paper's defaults, used when a config leaves them unset.
    ``defaults``: ``{section: {key: value}}``, the settings the method implies that are not fields
    of its settings dataclass (the penalty's rule, granularity and keying), merged under the
    user's keys by ``load_config`` together with the dataclass's own defaults (`settings`); so a
    config naming only ``strategy.name`` and the public class built without arguments resolve to
    the same settings (tests/test_method_defaults.py pins it, docs/algorithms.md "Defaults").
    ``checkpoints``: whether server checkpoints (run.checkpoint_every / run.resume) cover it.
    ``section``: the config section of its own knobs besides ``strategy`` (or None).
    """

    name: str
    class_name: str
    family: str
    optimizers: tuple[str, ...]
    outer_lr: float
    outer_momentum: float
    checkpoints: bool = True
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    section: str | None = None
    summary: str = ""

    @property
    def penalty(self) -> dict[str, Any]:
        """The penalty-section defaults the method implies (EDiT's, Di-PS's; empty: none)."""
        return dict(self.defaults.get("penalty", {}))

    @property
    def strategy_class(self) -> Any:
        """The public class (``fl_geo.strategies``), imported on first use: the strategies import
        the config schema, which reads this module, so this module cannot import them first."""
        import fl_geo.strategies as strategies

        return strategies.strategy_class(self.name)

    @property
    def settings(self) -> Any:
        """The method's settings dataclass (`fl_geo.strategies.settings.MethodSettings`): its fields,
        defaults and checks; what the public class takes and a config's ``strategy:`` section may set."""
        return self.strategy_class.Settings

    @property
    def is_async(self) -> bool:
        """Asynchronous dispatch (the HALoS two-tier loop counts: its workers never wait)."""
        return self.family in ("async", "halos")


# EDiT's penalty (EDiT §3.2 / Algorithm 2): per-module z-score outlier test, norm-softmax
# weights, clip 10.
EDIT_PENALTY: dict[str, Any] = {
    "enabled": True, "granularity": "module", "rule": "zscore", "threshold": 3.0,
    "keying": "node", "weighting": "norm_softmax", "temperature": 1.0, "clip": 10.0,
}

# Di-PS's penalty (Di-PS §4.2, docs/algorithms.md §4-5): one global norm, the relative-max rule
# on pooled statistics, token weights, clip φ = 1; warm-up 5 (short runs; configs/dips.yaml).
DIPS_PENALTY: dict[str, Any] = {
    "enabled": True, "granularity": "global", "rule": "relative_max", "threshold": 3.0, "warmup": 5,
    "keying": "pooled", "weighting": "tokens", "clip": 1.0,
}

_ENTRIES = (
    # Outer momentum 0.5, not the paper's 0.9: on fl-geo's long-budget study (docs/benchmarks.md,
    # 20 tokens per parameter, 3 seeds) 0.7 / 0.5 ended below both FedAvg and 0.7 / 0.9 on every
    # seed at H = 25 (two model sizes) and at the default H = 50; 0.9 ended above FedAvg on all.
    Method("diloco", "DiLoCo", "sync", ("nesterov", "delayed_nesterov"), 0.7, 0.5,
           summary="synchronous DiLoCo: H inner steps, Nesterov outer step on the mean pseudo-gradient"),
    Method("fedavg", "FedAvg", "sync", ("avg",), 1.0, 0.0, summary="FedAvg: the mean of the local models"),
    # FedAvgM at 0.7 / 0.5, not Hsu et al.'s lr 1 / momentum 0.9 (a cross-device setting: many clients,
    # short local training): in the long-budget study (H = 25, 3 seeds) 1 / 0.9 ended 15-20 % above
    # FedAvg on every seed and 0.7 / 0.5 level with it (-0.5 % +- 2.3), 15.4 % +- 3.4 below 1 / 0.9.
    Method("fedavgm", "FedAvgM", "sync", ("sgdm",), 0.7, 0.5, summary="FedAvg with server momentum"),
    Method("fedadam", "FedAdam", "sync", ("fedadam",), 0.1, 0.0, summary="FedOpt with Adam at the server"),
    Method("fedyogi", "FedYogi", "sync", ("fedyogi",), 0.01, 0.0, summary="FedOpt with Yogi at the server"),
    Method("edit", "EDiT", "sync", ("nesterov",), 0.8, 0.85, defaults={"penalty": EDIT_PENALTY},
           summary="EDiT: DiLoCo with the per-module pseudo-gradient penalty"),
    Method("a_edit", "AEDiT", "sync", ("nesterov",), 0.8, 0.85, defaults={"penalty": EDIT_PENALTY},
           summary="A-EDiT: EDiT with a time budget per inner loop instead of H steps"),
    # FedBuff (Nguyen et al. 2022): K = 2, staleness weights (FedBuffSettings).
    Method("fedbuff", "FedBuff", "async", ("avg",), 1.0, 0.0,
           summary="FedBuff: step after K buffered asynchronous updates"),
    # FedAsync (Xie et al. 2019): workers send parameters, each mixed in at α·(1 + τ)^−a (FedAsyncSettings).
    Method("fedasync", "FedAsync", "async", ("avg",), 1.0, 0.0,
           summary="FedAsync: mix each update in with a staleness-decayed weight"),
    Method("async_diloco", "AsyncDiLoCo", "async", ("nesterov",), 0.7, 0.9,
           summary="naive asynchronous DiLoCo: a Nesterov step per update"),
    # Async-Local-SGD (Liu et al. 2024) as the HALoS harness runs it: delayed Nesterov, lr 0.05 × N,
    # β 0.9, N = 32 (the lr is written lr × N, so it only means 0.05 per update with N = 32).
    Method("async_local_sgd", "AsyncLocalSGD", "async", ("delayed_nesterov",), 0.05 * 32, 0.9,
           summary="Async-Local-SGD: delayed Nesterov, one update per step"),
    # Di-PS: no buffer cap, the grace window, token weights (DiPSSettings) and its penalty's rule.
    Method("dips", "DiPS", "async", ("nesterov", "delayed_nesterov"), 0.7, 0.8,
           defaults={"penalty": DIPS_PENALTY},
           summary="Di-PS: buffered asynchronous steps closed by a grace window, z-score outlier rejection"),
    # HALoS's global server: delayed Nesterov lr 0.15 × N, β 0.5, N = 2 (run_halos.sh; HALoSSettings).
    Method("halos", "HALoS", "halos", ("delayed_nesterov",), 0.15 * 2, 0.5, section="halos",
           summary="HALoS: local parameter servers per region under one global server"),
    Method("streaming_diloco", "StreamingDiLoCo", "streaming", ("nesterov",), 0.7, 0.9,
           section="streaming", summary="Streaming DiLoCo: fragments synced in turn, overlapped with training"),
    # CoCoDC: the delay-compensated merge and the adaptive schedule (Algorithms 1 and 2; CoCoDCSettings).
    Method("cocodc", "CoCoDC", "streaming", ("nesterov",), 0.7, 0.9, section="streaming",
           summary="CoCoDC: Streaming DiLoCo with delay compensation and adaptive transmission"),
    # The data-parallel reference: every step the sites' gradients are averaged and the server takes
    # one inner AdamW step (client section's lr, schedule, clip); outer lr / momentum are unused
    # (1, 0 only to be valid). run.rounds counts inner steps (DDPSettings).
    Method("ddp", "DDP", "data_parallel", ("adamw",), 1.0, 0.0,
           summary="data-parallel reference: every inner step, one AdamW step on the mean of every site's gradient"),
)

METHODS: dict[str, Method] = {m.name: m for m in _ENTRIES}
assert all(m.family in FAMILIES for m in _ENTRIES)


def method(name: str) -> Method:
    """The registry entry for ``name``; a one-line error listing the valid names otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown strategy '{name}'; valid: {', '.join(METHODS)}") from None
