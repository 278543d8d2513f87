"""What every outer loop holds and does the same way, synchronous or asynchronous.

The global model (one fp32 flat buffer, stepped in place), the outer optimizer, the one running
sum, the counters a run summary reports, the profile-aware node bookkeeping, rejection logging and
server-side evaluation. The loops differ only in when they step and whom they send work to.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch

from fl_geo.accumulate import WeightedAccumulator
from fl_geo.config import FlGeoConfig, schedule_length, section_to_json, to_dict, warmup_length
from fl_geo.dispatch import Dispatcher, NodeProfile
from fl_geo.evaluation import GlobalEvaluator
from fl_geo.metrics import MetricsLogger
from fl_geo.outer import OuterOptimizer, build_outer_optimizer
from fl_geo.state import ParamSpec
from fl_geo.strategies.replies import Tally

log = logging.getLogger("fl_geo")


def outer_optimizer_from_config(cfg: FlGeoConfig, numel: int) -> OuterOptimizer:
    """Map the strategy section onto the core outer optimizers (fl_geo.outer)."""
    s = cfg.strategy
    name = s.outer_optimizer
    if name == "nesterov":
        kwargs: dict[str, Any] = {"lr": s.outer_lr, "momentum": s.outer_momentum}
    elif name == "delayed_nesterov":
        kwargs = {"lr": s.outer_lr, "momentum": s.outer_momentum, "buffer_size": s.delay_buffer, "activation": s.delay_activation}
    elif name in ("avg", "sgdm"):
        kwargs = {"lr": s.outer_lr} if name == "avg" else {"lr": s.outer_lr, "momentum": s.outer_momentum}
    else:  # fedadam / fedyogi
        kwargs = {"lr": s.outer_lr, "beta1": s.beta1, "beta2": s.beta2, "tau": s.tau}
    return build_outer_optimizer(name, numel, **kwargs)


def client_config_record(cfg: FlGeoConfig) -> dict[str, Any]:
    """The part of the run config every ClientApp needs, as ConfigRecord scalars.

    The server is the single source of truth: clients never read config files, so a deployment
    across sites cannot drift out of sync with the experiment definition.
    """
    return {
        "inner_steps": cfg.strategy.inner_steps,
        "schedule_total": schedule_length(cfg),
        "wire_up": cfg.wire.up,
        "wire_down": cfg.wire.down,
        # inline clients run one at a time in this process and may use every core
        "threads": cfg.run.sim_cpus if cfg.run.backend == "inline" else cfg.run.threads_per_client,
        "seed": cfg.run.seed,
        "client": json.dumps({**to_dict(cfg.client), "warmup_steps": warmup_length(cfg)}, sort_keys=True),
        "model": section_to_json(cfg.model),
        "data": section_to_json(cfg.data),
    }


class OuterLoop:
    """Shared state and helpers of `SyncOuterLoop` and `AsyncOuterLoop`."""

    def __init__(
        self,
        cfg: FlGeoConfig,
        spec: ParamSpec,
        global_params: torch.Tensor,
        dispatcher: Dispatcher,
        profiles: dict[int, NodeProfile],
        logger: MetricsLogger,
        evaluator: GlobalEvaluator | None,
        scenario: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.global_params = global_params  # fp32 flat buffer, updated in place by the outer step
        self.dispatcher = dispatcher
        self.profiles = profiles
        self.logger = logger
        self.evaluator = evaluator
        self.scenario = scenario  # set with a virtual clock (fl_geo.scenario.Scenario)
        self.optimizer = outer_optimizer_from_config(cfg, spec.numel)
        self.accumulator = WeightedAccumulator(spec.numel)
        self.version = 0  # outer steps applied
        self.total_tokens = 0
        self.total_bytes_up = 0
        self.total_bytes_down = 0
        self.total_rejected = 0
        self._client_cfg = client_config_record(cfg)
        self.history: list[dict[str, Any]] = []

    def free_nodes(self, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Live nodes with no job in flight, in rank order; nodes seen for the first time are
        asked for their profile first (Flower's NodeInfo carries no node_config)."""
        live = self.dispatcher.live_nodes()
        unknown = [n for n in live if n not in self.profiles]
        if unknown:
            self.profiles.update(self.dispatcher.query_profiles(unknown))
        busy = self.dispatcher.busy_nodes() | set(exclude)
        nodes = [n for n in live if n in self.profiles and n not in busy]
        return sorted(nodes, key=lambda n: self.profiles[n].rank)

    def _reject(self, tally: Tally, node: int, reason: str) -> None:
        """Log a rejected update with its node, partition and reason, and count it."""
        part = self.profiles[node].partition_id if node in self.profiles else -1
        log.warning("rejected update from node %s (partition %s): %s", node, part, reason)
        tally.rejected += 1

    def _virtual_zero(self) -> dict[str, float]:
        """``time/virtual_s`` = 0 for the step-0 record, only when the run has a virtual clock."""
        return {"time/virtual_s": 0.0} if self.dispatcher.clock.is_virtual else {}

    def _virtual_now(self) -> float:
        clock = self.dispatcher.clock
        return clock.now() if clock.is_virtual else float("nan")

    def evaluate(self) -> dict[str, float]:
        """Server-side validation loss of the global model on the held-out text."""
        if self.evaluator is None:
            return {}
        loss = self.evaluator.evaluate(self.global_params)
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}

    def log_initial(self) -> None:
        """The step-0 record: the untrained model's validation loss."""
        first = self.evaluate()
        if first:
            self.logger.log(0, {**first, "outer/step": 0, "train/tokens": 0, **self._virtual_zero()})
