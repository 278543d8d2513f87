"""The data-parallel reference loop (``ddp``): one inner step of the whole federation per round.

Every step, every selected site computes the gradient of its own batch at the current θ (a train
job with ``send="grad"``: no local optimizer step, no clip, no inner state; fl_geo.clients.api)
and replies it; the server folds the replies into the synchronous loop's weighted running sum
(token weights by default: a site's batch mean gradient weighted by its tokens is the gradient of
the mean loss over the concatenation of every site's batch) and applies ONE step of the inner
optimizer to the mean (`fl_geo.inner.large_batch.LargeBatchAdamW`: torch's AdamW with the client
section's lr, betas, eps and matrix-only weight decay, the `lr_at` warm-up / cosine schedule and
the inner loop's gradient clip, applied to the mean). So a run is single-process training on a
batch num_sites times a site's, up to the order of float sums (tests/test_ddp.py checks it against
one process to fp32 rounding): the quality ceiling and communication floor DiLoCo-style methods
are measured against.

``run.rounds`` counts these steps, and ``strategy.inner_steps`` is 1: a DiLoCo run of R rounds of
H inner steps trains on as many tokens as ``ddp`` with ``run.rounds = R × H``. The batch a site
draws at round r (1-based) is its batch r − 1, the step's schedule position the number of steps
the optimizer has taken.

Virtual clock (docs/algorithms.md §8): a step costs one inner step on the slowest site selected,
then one ring all-reduce of a gradient (the model's size in ``wire.up`` precision) among the sites
that replied: ``T = max_i step_time_i + 2(M−1)·latency + 2(M−1)/M · bytes·8 / bandwidth``, with
the slowest link and largest latency of the best ring (`Scenario.allreduce_time`, the all-reduce
the synchronous loop already charges per round). Unlike DiLoCo's rounds no server message is
charged: data-parallel replicas hold θ and start the next step from the all-reduce's result, so
the job is timed against the site's own region (intra-region latency, 0 in most scenarios). The
``comm/bytes_*`` metrics still count the messages the simulation sends (θ down, a gradient up).

Replies are validated as every synchronous reply is (strategies/replies.py: declared payload
``grad``, keys, shapes, precision, metrics, finite values, ``strategy.max_update_ratio``); a bad
one is logged, counted in ``outer/rejected`` and touches neither θ nor the AdamW moments. A plain
Flower ClientApp cannot compute a gradient job, so this loop refuses it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from flwr.app import Message

from fl_geo.config import FlGeoConfig, schedule_length, to_dict, warmup_length
from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.state import ParamSpec
from fl_geo.inner.large_batch import LargeBatchAdamW
from fl_geo.runtime.builders import inner_config
from fl_geo.runtime.dispatch import JobTiming
from fl_geo.strategies.server_model import ServerModel
from fl_geo.strategies.sync import SyncOuterLoop

__all__ = ["DataParallelLoop", "DataParallelModel"]


class DataParallelModel(ServerModel):
    """θ, the server's `LargeBatchAdamW` (the inner optimizer, stepped once per federation step)
    and the running sum of the step's gradients. The optimizer is built from the client section
    the sites are sent (with the schedule length and warm-up ``client_config_record`` gives them)."""

    def __init__(self, cfg: FlGeoConfig, params: torch.Tensor, spec: ParamSpec) -> None:
        self.spec = spec
        # the client section as the sites receive it (`client_config_record`)
        self.inner = inner_config({**to_dict(cfg.client), "warmup_steps": warmup_length(cfg)}, schedule_length(cfg))
        super().__init__(cfg, params, self.new_optimizer(), WeightedAccumulator(params.numel()))

    def new_optimizer(self) -> OuterOptimizer:
        return LargeBatchAdamW(self.spec, self.inner)


class DataParallelLoop(SyncOuterLoop):
    """`SyncOuterLoop` with gradient jobs and the server AdamW step (see the module docstring)."""

    supports_plain_clients: ClassVar[bool] = False
    plain_clients_refusal: ClassVar[str] = ("its sites reply the gradient of one batch (a job only fl-geo's ClientApp "
                                            "computes)")
    reply_payloads: ClassVar[tuple[str, ...]] = ("grad",)

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        return DataParallelModel(cfg, global_params, self.spec)

    def _inner_steps(self, node: int, warm: bool) -> int:
        return 1

    def _message(self, node: int, arrays: Any, rnd: int, mtype: str, **extra: Any) -> Message:
        # round r (1-based) draws each site's batch r - 1: the data order of single-process training
        return super()._message(node, arrays, rnd, mtype, **{**extra, "send": "grad", "start_step": rnd - 1})

    def _job_timing(self, slot: int, steps: int) -> JobTiming:
        """One inner step on the site, timed against its own region: no server message is charged
        (replicas start each step from the all-reduce's result)."""
        region = self.scenario.node_region(slot) if self.scenario is not None else None
        return JobTiming(slot, steps, peer_region=region)

    def train_round(self, rnd: int) -> dict[str, float]:
        metrics = super().train_round(rnd)
        opt = self.optimizer
        assert isinstance(opt, LargeBatchAdamW)
        metrics["train/lr"] = opt.last_lr
        metrics["outer/clip_scale"] = opt.last_clip_scale
        return metrics
