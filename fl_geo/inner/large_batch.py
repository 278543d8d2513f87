"""The inner optimizer applied once per step to a federation's averaged gradient (the ``ddp`` method).

`LargeBatchAdamW` is what one process training on the concatenated batch of every site would do
in one inner step: fl-geo's inner AdamW (`fl_geo.inner.training.default_optimizer`: weight decay
on matrices only, the client section's lr, betas, eps and weight decay), the learning rate of the
inner schedule (`lr_at`: linear warm-up, cosine decay) at the step's position, and the inner
loop's gradient clipping (``clip_grad_norm_`` to ``grad_clip``) applied to the *averaged*
gradient, as one process clips its one gradient. The step itself is ``torch.optim.AdamW``; its
moments live in two model-sized flat fp32 buffers (views per tensor are handed to torch), so the
state is checkpointed like any outer optimizer's (`fl_geo.core.outer.OuterOptimizer`).

It speaks the outer optimizers' interface, ``step(params, grad)`` on flat fp32 buffers, so the
synchronous loop's server model holds it in place of an outer optimizer: ``grad`` is the mean of
the sites' gradients, never modified (it is copied before the clip).

It does not follow ``client.optimizer: muon``: the server holds flat buffers and a `ParamSpec`, not
the model, so it cannot apply Muon's partition rule (embeddings and the head by module type,
`fl_geo.inner.muon.hidden_matrices`); the config check refuses ``ddp`` with Muon rather than step
another optimizer than the sites declare.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.state import ParamSpec
from fl_geo.inner.training import InnerConfig, ScheduleFn, lr_at

__all__ = ["LargeBatchAdamW"]


class LargeBatchAdamW(OuterOptimizer):
    """One AdamW step of the inner loop per call, on the flat parameter buffer.

    ``spec`` lays out the tensors in the flat buffer: a tensor of two or more dimensions gets
    ``cfg.weight_decay``, the others none (`default_optimizer`'s rule). ``schedule(step, cfg)``
    gives the learning rate of step ``steps`` (0-based: the first step is at position 0, as the
    inner loop's first step is). The hyperparameters and the schedule are the run's client
    section, not part of the state: a checkpoint holds the step count and the two moments.
    """

    name = "adamw"
    _hyper: ClassVar[tuple[str, ...]] = ()
    _buffers: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    def __init__(self, spec: ParamSpec, cfg: InnerConfig, schedule: ScheduleFn = lr_at) -> None:
        super().__init__(spec.numel)
        self.spec = spec
        self.cfg = cfg
        self.schedule = schedule
        self.last_lr = float("nan")  # the learning rate of the last step (logged as train/lr)
        self.last_clip_scale = 1.0  # the clip's factor in the last step (1: it did not bind)
        self._grad: torch.Tensor | None = None  # the clipped copy of the mean gradient

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(shape) for o, n, shape in zip(self.spec.offsets, self.spec.numels, self.spec.shapes,
                                                                  strict=True)]

    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        if self._grad is None or self._grad.device != params.device:
            self._grad = torch.empty(self.numel, dtype=torch.float32, device=params.device)
        self._grad.copy_(grad)  # the caller's mean stays as it was; the clip scales this copy
        exp_avg, exp_avg_sq = self._buffer("exp_avg", params), self._buffer("exp_avg_sq", params)
        views = self._views(params)
        grads, avgs, sqs = self._views(self._grad), self._views(exp_avg), self._views(exp_avg_sq)
        for p, g in zip(views, grads, strict=True):
            p.grad = g
        lr = float(self.schedule(self.steps, self.cfg))
        decay = [p for p in views if p.ndim >= 2]
        no_decay = [p for p in views if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(self.cfg.betas),
                                eps=self.cfg.eps)
        # The moments are views of the flat buffers (torch updates them in place) and the step
        # count is this optimizer's: torch increments it before the bias correction, as in the
        # inner loop's first step (step 1).
        for p, m, v in zip(views, avgs, sqs, strict=True):
            opt.state[p] = {"step": torch.tensor(float(self.steps)), "exp_avg": m, "exp_avg_sq": v}
        self.last_clip_scale = 1.0
        if self.cfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(views, self.cfg.grad_clip))
            self.last_clip_scale = min(1.0, self.cfg.grad_clip / (norm + 1e-6))
        opt.step()
        for p in views:
            p.grad = None
        self.last_lr = lr
