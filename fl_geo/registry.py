"""The strategy registry: every method's facts in one entry.

Adding a method is one `Method` entry here plus its public class (``fl_geo.strategies``): the
config schema (`fl_geo.config`) derives its tables from `METHODS` (which outer optimizers a method
may use and which it defaults to, its outer lr and momentum, its penalty defaults, whether server
checkpoints cover it), and ``fl-geo run`` / ``flwr run .`` build the public class named by
``class_name`` from a config through `fl_geo.strategies.build_strategy`. So the CLI and a Flower user's
own ServerApp run one code path.

This module is plain data: it imports nothing from fl-geo or Flower, so the lowest layers (the
config schema) can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The outer loop a method runs on (fl_geo.strategies: SyncOuterLoop, AsyncOuterLoop, HalosLoop,
# StreamingLoop; ps.followers turns an asynchronous Di-PS into ShardedDiPSLoop).
FAMILIES = ("sync", "async", "halos", "streaming")


@dataclass(frozen=True)
class Method:
    """One method: its config name, public class and defaults.

    ``optimizers``: the outer optimizers it may use, the first being its default.
    ``outer_lr`` / ``outer_momentum``: the paper's defaults, used when a config leaves them unset.
    ``penalty``: penalty-section defaults the method implies (EDiT), merged under the user's keys.
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
    penalty: dict[str, Any] = field(default_factory=dict)
    section: str | None = None
    summary: str = ""

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

_ENTRIES = (
    Method("diloco", "DiLoCo", "sync", ("nesterov", "delayed_nesterov"), 0.7, 0.9,
           summary="synchronous DiLoCo: H inner steps, Nesterov outer step on the mean pseudo-gradient"),
    Method("fedavg", "FedAvg", "sync", ("avg",), 1.0, 0.0, summary="FedAvg: the mean of the local models"),
    Method("fedavgm", "FedAvgM", "sync", ("sgdm",), 1.0, 0.9, summary="FedAvg with server momentum"),
    Method("fedadam", "FedAdam", "sync", ("fedadam",), 0.1, 0.0, summary="FedOpt with Adam at the server"),
    Method("fedyogi", "FedYogi", "sync", ("fedyogi",), 0.01, 0.0, summary="FedOpt with Yogi at the server"),
    Method("edit", "EDiT", "sync", ("nesterov",), 0.8, 0.85, penalty=EDIT_PENALTY,
           summary="EDiT: DiLoCo with the per-module pseudo-gradient penalty"),
    Method("a_edit", "AEDiT", "sync", ("nesterov",), 0.8, 0.85, penalty=EDIT_PENALTY,
           summary="A-EDiT: EDiT with a time budget per inner loop instead of H steps"),
    Method("fedbuff", "FedBuff", "async", ("avg",), 1.0, 0.0,
           summary="FedBuff: step after K buffered asynchronous updates"),
    Method("fedasync", "FedAsync", "async", ("avg",), 1.0, 0.0,
           summary="FedAsync: mix each update in with a staleness-decayed weight"),
    Method("async_diloco", "AsyncDiLoCo", "async", ("nesterov",), 0.7, 0.9,
           summary="naive asynchronous DiLoCo: a Nesterov step per update"),
    Method("async_local_sgd", "AsyncLocalSGD", "async", ("delayed_nesterov",), 0.05 * 32, 0.9,
           summary="Async-Local-SGD: delayed Nesterov, one update per step"),
    Method("dips", "DiPS", "async", ("nesterov", "delayed_nesterov"), 0.7, 0.8,
           summary="Di-PS: buffered asynchronous steps closed by a grace window, z-score outlier rejection"),
    Method("halos", "HALoS", "halos", ("delayed_nesterov",), 0.15 * 2, 0.5, checkpoints=False, section="halos",
           summary="HALoS: local parameter servers per region under one global server"),
    Method("streaming_diloco", "StreamingDiLoCo", "streaming", ("nesterov",), 0.7, 0.9, checkpoints=False,
           section="streaming", summary="Streaming DiLoCo: fragments synced in turn, overlapped with training"),
    Method("cocodc", "CoCoDC", "streaming", ("nesterov",), 0.7, 0.9, checkpoints=False, section="streaming",
           summary="CoCoDC: Streaming DiLoCo with delay compensation and adaptive transmission"),
)

METHODS: dict[str, Method] = {m.name: m for m in _ENTRIES}
assert all(m.family in FAMILIES for m in _ENTRIES)


def method(name: str) -> Method:
    """The registry entry for ``name``; a one-line error listing the valid names otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown strategy '{name}'; valid: {', '.join(METHODS)}") from None
