"""What every outer loop holds and does the same way, synchronous or asynchronous.

The global model (one fp32 flat buffer, stepped in place), the outer optimizer, the one running
sum, the counters a run summary reports, the profile-aware node bookkeeping, rejection logging and
server-side evaluation. The loops differ only in when they step and whom they send work to.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fl_geo.accumulate import WeightedAccumulator
from fl_geo.config import FlGeoConfig, schedule_length, section_to_json, to_dict, warmup_length
from fl_geo.dispatch import Dispatcher, NodeProfile
from fl_geo.evaluation import GlobalEvaluator
from fl_geo.metrics import MetricsLogger
from fl_geo.outer import OuterOptimizer, build_outer_optimizer
from fl_geo.penalty import Penalty
from fl_geo.state import ParamSpec
from fl_geo.strategies.replies import Tally
from fl_geo.wire import encode

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


def penalty_from_config(cfg: FlGeoConfig, spec: ParamSpec) -> Penalty | None:
    """The pseudo-gradient penalty of ALGORITHMS.md §4, or None when ``penalty.enabled`` is off.

    ``penalty.outlier: false`` (an ablation switch) keeps the statistics but never rejects.
    """
    p = cfg.penalty
    if not p.enabled:
        return None
    return Penalty(
        spec, granularity=p.granularity, rule=p.rule,
        threshold=p.threshold, warmup=p.warmup, reject=p.outlier,
        keying=p.keying, weighting=p.weighting.split("*"),
        temperature="auto" if p.temperature == 0 else p.temperature,
        clip=p.clip or None, adaptive_threshold=p.adaptive_threshold,
    )


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
        self.penalty = penalty_from_config(cfg, spec)

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

    def client_eval(self, rnd: int) -> dict[str, float]:
        """Each free node's validation loss of the global model on its own partition,
        token-weighted (``run.client_eval_every``)."""
        nodes = self.free_nodes()
        arrays = encode(self.global_params, self.spec, self.cfg.wire.down)
        config = ConfigRecord(dict(self._client_cfg, round=rnd, base_version=self.version))
        msgs = [Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=n,
                        message_type=MessageType.EVALUATE) for n in nodes]
        total = {"loss": 0.0, "tokens": 0}

        def keep(group: Sequence[tuple[int, Message]]) -> None:
            for node, reply in group:
                m = reply.content.metric_records.get("metrics")
                if m is None or "val_loss" not in m or "val_tokens" not in m:
                    log.warning("evaluate reply from node %s lacks val_loss/val_tokens; ignored", node)
                    continue
                total["loss"] += float(m["val_loss"]) * int(m["val_tokens"])
                total["tokens"] += int(m["val_tokens"])

        self.dispatcher.run_jobs(msgs, on_replies=keep, order=nodes, timeout_s=self.cfg.strategy.round_timeout_s)
        return {"val/client_loss": total["loss"] / total["tokens"]} if total["tokens"] else {}

    def tally_metrics(self, t: Tally) -> dict[str, float]:
        """Add a step's tally to the run totals and return the metrics every loop logs for it."""
        self.total_tokens += t.tokens
        self.total_bytes_up += t.bytes_up
        self.total_rejected += t.rejected
        return {
            "outer/step": self.version,
            "outer/accepted": t.accepted,
            "outer/rejected": t.rejected,
            "outer/rejected_total": self.total_rejected,
            "outer/failed": t.errors,
            "outer/update_norm": t.mean(t.norm_sum),
            "train/loss": t.loss_x_tokens / t.tokens if t.tokens else float("nan"),
            "train/tokens": self.total_tokens,
            "comm/bytes_up": t.bytes_up,
            "comm/bytes_up_total": self.total_bytes_up,
            "comm/bytes_down_total": self.total_bytes_down,
            "time/virtual_s": self._virtual_now(),
        }

    def log_initial(self) -> None:
        """The step-0 record: the untrained model's validation loss."""
        first = self.evaluate()
        if first:
            self.logger.log(0, {**first, "outer/step": 0, "train/tokens": 0, **self._virtual_zero()})

    # ---- the pseudo-gradient penalty (ALGORITHMS.md §4), shared by Di-PS, EDiT and HALoS --------
    def fold_penalised(self, tally: Tally, node: int, update: Any, tokens: int, staleness: float = 0) -> Any:
        """Norms -> outlier test against the step-start statistics -> weighted fold.

        Returns the verdict, or None when every group was rejected (logged with node and score).
        Statistics are keyed by partition id: Flower's node ids change from run to run.
        """
        assert self.penalty is not None
        norms = self.penalty.norms(update)
        if not bool(torch.isfinite(norms).all()):
            self._reject(tally, node, "update holds NaN or Inf values")
            return None
        key = self.profiles[node].partition_id if node in self.profiles else node
        verdict = self.penalty.observe(key, norms, tokens=tokens, staleness=staleness)
        if bool(verdict.scored.any()):
            z = float(verdict.z[verdict.scored].max())
            tally.max_z = z if math.isnan(tally.max_z) else max(tally.max_z, z)
        if not verdict.any_accepted:
            tally.rejected_groups += self.penalty.num_groups
            z = float(verdict.z.max()) if verdict.z.numel() else float("nan")
            self._reject(tally, node, f"outlier (z={z:.2f}, norm={float(norms.norm()):.4g}, rule {self.cfg.penalty.rule})")
            return None
        if not bool(verdict.accepted.all()):
            bad = [n for n, ok in zip(self.penalty.group_names, verdict.accepted.tolist(), strict=True) if not ok]
            zs = [f"{float(z):.2f}" for z, ok in zip(verdict.z.tolist(), verdict.accepted.tolist(), strict=True) if not ok]
            log.warning("node %s (partition %s): modules %s rejected as outliers (z=%s)", node, key, ", ".join(bad), ", ".join(zs))
            tally.rejected_groups += len(bad)
        self.penalty.fold_(self.accumulator, update, verdict)
        return verdict

    def penalised_step(self, buf: torch.Tensor | None = None) -> list[str]:
        """Clip, then the outer step; modules every worker failed on are not stepped (rollback:
        their parameters and outer momentum stay as they were). ``buf`` is the normalised mean
        (``self.accumulator.buffer`` after `Penalty.normalise_` by default). Returns the
        rolled-back module names."""
        assert self.penalty is not None
        if buf is None:
            buf = self.accumulator.buffer
            self.penalty.normalise_(buf)
        self.penalty.clip_(buf)
        rolled = self.penalty.rolled_back
        skip = self.penalty.ranges(rolled)
        live = [t for t in self.optimizer.state_dict().values() if torch.is_tensor(t) and t.numel() == self.spec.numel]
        saved = [(b, e, [x[b:e].clone() for x in (self.global_params, *live)]) for b, e in skip]
        self.optimizer.step(self.global_params, buf)
        for b, e, copies in saved:
            for x, c in zip((self.global_params, *live), copies, strict=True):
                x[b:e].copy_(c)
        if skip:
            log.warning("outer step %d: modules %s had no accepted update and were not stepped",
                        self.version + 1, ", ".join(rolled))
        return rolled
