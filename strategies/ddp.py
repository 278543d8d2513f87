"""The data-parallel reference method ``ddp`` as a Flower strategy, with its settings dataclass.

Single-site large-batch training spread over the federation: every inner step each site computes
its batch's gradient, the server averages them and takes one step of the inner AdamW (the loop:
`fl_geo.strategies.data_parallel`). It is the baseline the DiLoCo-family papers (DiLoCo,
arXiv:2311.08105; Streaming DiLoCo, arXiv:2501.18512) report their methods against: the quality
ceiling for a token budget, at the cost of one ring all-reduce of the gradient per step, which a
scenario's virtual clock charges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fl_geo.errors import ConfigError, require
from fl_geo.strategies.settings import SyncSettings
from fl_geo.strategies.strategy import FlGeoStrategy


@dataclass(kw_only=True)
class DDPSettings(SyncSettings):
    """``ddp``: one federation-wide inner step per round, the inner AdamW at the server.

    The step's optimizer is the client section's (``inner=`` / ``client.*``: lr, betas, eps,
    weight decay on matrices, warm-up and cosine schedule, grad clip), applied to the mean
    gradient; ``outer_optimizer`` is ``adamw`` and ``outer_lr`` / ``outer_momentum`` are unused.
    ``run.rounds`` (a class's ``num_rounds``) counts inner steps: to train on the tokens of a
    DiLoCo run of R rounds with H inner steps, run R × H rounds. The rest of the fields are
    `SyncSettings`' and `MethodSettings`' (``clients_per_round``, ``min_replies``, ``robust``,
    ``max_update_ratio``, ``fold_order``, the wire precisions, ...); those that shape an inner
    loop of several steps or late replies (``time_budget_s``, ``step_weight_ratio``,
    ``sync_warmup_steps``, ``dynupd``, ``quorum``) are refused.

    Parameters
    ----------
    inner_steps : int (default: 1)
        Must be 1: each job is one batch's gradient.
    weighting : str (default: "tokens")
        ``"tokens"``: each site's mean gradient weighted by its batch's tokens, which is the
        gradient of the mean loss over the concatenated batch (``"uniform"`` is the same when
        every site's batch holds as many tokens).
    """

    method = "ddp"

    inner_steps: int = 1
    weighting: str = "tokens"

    def check(self) -> None:
        super().check()
        require(self.inner_steps == 1,
                f"strategy ddp takes one gradient per site per step: strategy.inner_steps must be 1, got "
                f"{self.inner_steps} (run.rounds counts the inner steps; DiLoCo's R rounds x H = {self.inner_steps} "
                "are R x H ddp rounds)")
        unsupported = [(key, value) for key, value in (("time_budget_s", self.time_budget_s),
                                                        ("step_weight_ratio", self.step_weight_ratio),
                                                        ("sync_warmup_steps", self.sync_warmup_steps),
                                                        ("dynupd", self.dynupd), ("quorum", self.quorum)) if value]
        require(not unsupported, f"strategy ddp does not support strategy.{unsupported[0][0]}={unsupported[0][1]!r} "
                                 "(every step takes every selected site's gradient at the same model)"
                if unsupported else "")


class DDP(FlGeoStrategy):
    """Data-parallel reference (``ddp``): every step each site replies the gradient of one batch at
    θ; the server averages them (token-weighted) and applies one step of the inner AdamW with its
    schedule and gradient clip: single-process training on the concatenated batch. On a scenario's
    virtual clock each step costs one inner step on the slowest site plus a ring all-reduce of the
    gradient. Needs fl-geo's ClientApp on every node (a plain Flower ClientApp cannot compute a
    gradient job): ``clients="flower"`` is refused."""

    Settings = DDPSettings

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("clients") == "flower":
            raise ConfigError("DDP needs fl-geo's ClientApp on every node (its sites reply one batch's gradient, which "
                              "a plain Flower ClientApp cannot compute): clients='flower' is not supported")
        super().__init__(**kwargs)
