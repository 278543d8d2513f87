"""The inner loop of a datacenter client (ALGORITHMS.md §1).

AdamW with weight decay on matrices only, linear warm-up then cosine decay, gradient clipping and
bf16 autocast on accelerators. The optimizer state must survive across outer rounds (DiLoCo) even
when the client process does not, so it can be exported as a flat ``name → tensor`` dict that a
Flower ``ArrayRecord`` stores, and loaded back. The schedule position is passed in by the caller
(``start_step``): under ``schedule_clock: global`` the server, not the worker, decides it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fl_geo.data.loader import BatchSampler
from fl_geo.device import autocast_dtype, pick_device
from fl_geo.model import Decoder

__all__ = ["InnerConfig", "InnerTrainer", "TrainResult", "evaluate_loss", "lr_at"]

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class InnerConfig:
    """Inner-optimizer settings; defaults follow the HALoS code (see ALGORITHMS.md §1)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 2000
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 16
    seq_len: int = 128
    precision: str = "auto"
    device: str = "auto"


@dataclass
class TrainResult:
    """What one inner loop did; ``tokens`` feeds token-weighted aggregation."""

    steps: int
    tokens: int
    mean_loss: float
    step_time_s: float
    final_loss: float


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Learning rate at schedule position ``step`` (0-based).

    Warm-up is linear from lr/warmup_steps at step 0 to lr at step warmup_steps - 1 (so no step
    is wasted at lr 0); then cosine decay from lr to min_lr_ratio·lr at step total_steps, and
    constant afterwards, so a run longer than planned keeps training at the floor.
    """
    peak = cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    span = cfg.total_steps - cfg.warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - cfg.warmup_steps) / span)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InnerTrainer:
    """Owns a model on its device and the AdamW state that persists across outer rounds."""

    # Free the gradients after each step (one process: less memory between steps). The
    # data-parallel rank trainer keeps them, because there they are the all-reduce buckets.
    zero_grad_to_none: bool = True

    def __init__(self, model: Decoder, cfg: InnerConfig) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.amp_dtype = autocast_dtype(self.device, cfg.precision)
        self.model = model.to(self.device)
        named = list(self.model.named_parameters())
        # Decay matrices (embeddings, projections) only: decaying norm gains towards zero only
        # fights the normalisation.
        decay = [(name, p) for name, p in named if p.ndim >= 2]
        no_decay = [(name, p) for name, p in named if p.ndim < 2]
        self.param_names = [name for name, _ in decay + no_decay]  # optimizer index order
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for _, p in decay], "weight_decay": cfg.weight_decay},
                {"params": [p for _, p in no_decay], "weight_decay": 0.0},
            ],
            lr=lr_at(0, cfg),
            betas=tuple(cfg.betas),
            eps=cfg.eps,
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(x.to(self.device, non_blocking=True))
        target = y.to(self.device, non_blocking=True)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "npu":
            torch.npu.synchronize()
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def _stop(self, budget_reached: bool) -> bool:
        """Whether a budgeted loop stops after this step; one process simply obeys its own clock.

        A hook because a data-parallel job (fl_geo.distributed) must stop every rank at the same
        step: a rank that stepped once more would wait in its gradient all-reduce until the
        process group times out.
        """
        return budget_reached

    def train(self, sampler: BatchSampler, steps: int, start_step: int, time_budget_s: float = 0.0) -> TrainResult:
        """Run ``steps`` optimizer steps at schedule positions ``start_step …``.

        Batch ``start_step + i`` is drawn for step i, so the data order continues across rounds
        without any sampler state. Losses stay on the device until the end: reading each one
        would force an accelerator sync every step.

        ``time_budget_s > 0`` (A-EDiT): stop after the step during which the elapsed time reached
        the budget (``steps`` is then a cap). Measuring the time needs the device to finish each
        step, so a budgeted loop synchronises the accelerator every step.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if not time_budget_s >= 0:
            raise ValueError(f"time_budget_s must be >= 0, got {time_budget_s}")
        self.model.train()
        losses = []
        self._synchronize()
        started = time.perf_counter()
        for i in range(steps):
            lr = lr_at(start_step + i, self.cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            x, y = sampler.batch(start_step + i)
            loss = self._loss(x, y)
            loss.backward()
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=self.zero_grad_to_none)
            losses.append(loss.detach())
            if time_budget_s > 0:
                self._synchronize()
                if self._stop(time.perf_counter() - started >= time_budget_s):
                    break
        done = len(losses)
        all_losses = torch.stack(losses).cpu()
        self._synchronize()
        elapsed = time.perf_counter() - started
        return TrainResult(
            steps=done,
            tokens=done * sampler.batch_size * sampler.seq_len,
            mean_loss=float(all_losses.mean()),
            step_time_s=elapsed / done,
            final_loss=float(all_losses[-1]),
        )

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean next-token loss in nats per token over ``batches`` (see :func:`evaluate_loss`)."""
        return evaluate_loss(self.model, batches, self.amp_dtype)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW state as ``{"<param>.exp_avg" | ".exp_avg_sq" | ".step": tensor}`` on CPU.

        Flat and keyed by parameter name (not optimizer index) so it survives storage in an
        ``ArrayRecord`` and fails loudly if the model changes. Empty before the first step.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        flat: dict[str, torch.Tensor] = {}
        for name, param in zip(self.param_names, params, strict=True):
            state = self.optimizer.state.get(param)
            if not state:
                continue
            for key in STATE_KEYS:
                value = torch.as_tensor(state[key]).detach()
                flat[f"{name}.{key}"] = value.to("cpu", copy=True).to(
                    torch.float32 if key == "step" else value.dtype
                )
        return flat

    def load_optimizer_state(self, flat: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`optimizer_state`; an empty dict resets the state."""
        expected = {f"{name}.{key}" for name in self.param_names for key in STATE_KEYS}
        given = set(flat)
        if given and given != expected:
            missing = sorted(expected - given)[:5]
            extra = sorted(given - expected)[:5]
            raise ValueError(
                f"optimizer state does not match the model: missing {missing}, unexpected {extra}"
            )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for name, param in zip(self.param_names, params, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                if given and tuple(flat[f"{name}.{key}"].shape) != tuple(param.shape):
                    raise ValueError(
                        f"optimizer state {name}.{key} has shape {tuple(flat[f'{name}.{key}'].shape)}, "
                        f"parameter has {tuple(param.shape)}"
                    )
        state: dict[int, dict[str, torch.Tensor]] = {}
        if given:
            for index, name in enumerate(self.param_names):
                step = torch.as_tensor(flat[f"{name}.step"], dtype=torch.float32)
                state[index] = {
                    "step": step.reshape(()).clone(),
                    "exp_avg": flat[f"{name}.exp_avg"].detach().clone(),
                    "exp_avg_sq": flat[f"{name}.exp_avg_sq"].detach().clone(),
                }
        state_dict = self.optimizer.state_dict()
        state_dict["state"] = state
        # load_state_dict moves the moments to each parameter's device and dtype and places
        # `step` where this optimizer configuration expects it.
        self.optimizer.load_state_dict(state_dict)


@torch.no_grad()
def evaluate_loss(
    model: Decoder,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    amp_dtype: torch.dtype | None = None,
) -> float:
    """Mean next-token loss in nats per token (token-weighted) on the model's own device.

    A free function because the server evaluates the global model without any optimizer, and a
    client evaluates the received model without touching its inner optimizer state.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for x, y in batches:
            ctx = (
                torch.autocast(device_type=device.type, dtype=amp_dtype)
                if amp_dtype is not None
                else contextlib.nullcontext()
            )
            with ctx:
                logits = model(x.to(device, non_blocking=True))
            target = y.to(device, non_blocking=True)
            total += F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum").double()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate_loss() got no batches")
    return float(total) / count
