"""The server's model part: θ, the outer optimizer that steps it, and the running sum of a step.

A loop holds one `ServerModel` instead of three loose attributes, and a loop whose model-sized
state lives elsewhere says so by building a different part, not by replacing the base's buffers
after they were allocated: HALoS steps θ with its global parameter server, the streaming loops
keep one outer optimizer and one sum per fragment, and the sharded Di-PS leader leaves both to its
followers. For them `ServerModel.held_elsewhere` holds θ and a one-element optimizer (its ``lr``
is what the loop reads), so no model-sized buffer is allocated only to be thrown away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fl_geo.config import FlGeoConfig
from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.outer import OuterOptimizer, build_outer_optimizer

__all__ = ["ServerModel", "outer_optimizer_from_config"]


def outer_optimizer_from_config(cfg: FlGeoConfig, numel: int) -> OuterOptimizer:
    """Map the strategy section onto the core outer optimizers (fl_geo.core.outer)."""
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


class ServerModel:
    """θ (one fp32 flat buffer, stepped in place), its outer optimizer and the running sum.

    ``params`` is never replaced, only written in place, so views of it (evaluation, the sharded
    followers' shards) stay valid; ``optimizer`` is replaced whole on resume.
    """

    def __init__(self, cfg: FlGeoConfig, params: torch.Tensor, optimizer: OuterOptimizer,
                 accumulator: WeightedAccumulator, optimizer_numel: int | None = None) -> None:
        self.cfg = cfg
        self.params = params
        self.optimizer = optimizer
        self.accumulator = accumulator
        # the optimizer's size: θ's, or 1 where the loop keeps its outer state itself (`held_elsewhere`)
        self.optimizer_numel = params.numel() if optimizer_numel is None else int(optimizer_numel)

    @classmethod
    def from_config(cls, cfg: FlGeoConfig, params: torch.Tensor) -> ServerModel:
        """The outer optimizer of the strategy section over all of θ, and a model-sized sum."""
        numel = params.numel()
        return cls(cfg, params, outer_optimizer_from_config(cfg, numel), WeightedAccumulator(numel))

    @classmethod
    def held_elsewhere(cls, cfg: FlGeoConfig, params: torch.Tensor) -> ServerModel:
        """θ only: the loop keeps its outer state and sums in its own parts. The one-element
        optimizer carries the strategy's hyper-parameters (``lr``) and no model-sized state."""
        return cls(cfg, params, outer_optimizer_from_config(cfg, 1), WeightedAccumulator(1), optimizer_numel=1)

    def new_optimizer(self) -> OuterOptimizer:
        """A fresh optimizer of this model's kind, for a checkpoint's state to be loaded into
        (the data-parallel loop's model builds its server AdamW instead)."""
        return outer_optimizer_from_config(self.cfg, self.optimizer_numel)

    def state_dict(self) -> dict[str, Any]:
        """``params`` and ``optimizer`` of a server checkpoint."""
        return {"params": self.params, "optimizer": self.optimizer.state_dict()}

    def prepare_load(self, state: dict[str, Any]) -> Callable[[], None]:
        """Validate a checkpoint's ``params`` and ``optimizer`` without changing anything; return
        the function that installs them (called once everything else has validated)."""
        params = state["params"]
        if not torch.is_tensor(params) or params.shape != self.params.shape or params.dtype != torch.float32:
            raise ValueError(f"checkpoint params are not an fp32 tensor of {self.params.numel()} elements")
        if not bool(torch.isfinite(params).all()):
            raise ValueError("checkpoint params hold NaN or Inf")
        optimizer = self.new_optimizer()
        optimizer.load_state_dict(dict(state["optimizer"]))

        def install() -> None:
            self.params.copy_(params)
            self.optimizer = optimizer

        return install
