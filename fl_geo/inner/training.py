"""The inner loop of a datacenter client (docs/algorithms.md §1).

AdamW with weight decay on matrices only (or, with ``optimizer="muon"``, Muon on the hidden
matrices and AdamW on the rest: fl_geo.inner.muon), linear warm-up then cosine decay, gradient
clipping and bf16 autocast on accelerators. The optimizer state must survive across outer rounds (DiLoCo) even
when the client process does not, so it can be exported as a flat ``name → tensor`` dict that a
Flower ``ArrayRecord`` stores, and loaded back. The schedule position is passed in by the caller
(``start_step``): under ``schedule_clock: global`` the server, not the worker, decides it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from fl_geo.inner.blocks import set_activation_checkpointing
from fl_geo.inner.device import autocast_dtype, pick_device
from fl_geo.inner.muon import LR_SCALE, MuonAdamW, muon_optimizer

__all__ = [
    "BatchSource",
    "InnerConfig",
    "InnerTrainer",
    "LossFn",
    "OptimizerFn",
    "ScheduleFn",
    "TokensFn",
    "TrainResult",
    "check_train_args",
    "default_optimizer",
    "evaluate_loss",
    "lr_at",
    "next_token_loss",
    "state_keys",
    "target_tokens",
    "to_device",
]

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class InnerConfig:
    """Inner-optimizer settings; defaults follow the HALoS code (see docs/algorithms.md §1)."""

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
    # client.optimizer: adamw | muon (Muon on the hidden matrices, AdamW on the rest; fl_geo.inner.muon)
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_weight_decay: float = 0.01
    muon_adjust_lr: str = "original"
    # client.activation_checkpointing: recompute each repeated block's forward in backward
    # (fl_geo.inner.blocks): activations of one tensor per block instead of all of them
    activation_checkpointing: bool = False


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


class BatchSource(Protocol):
    """Where an inner loop draws its training batches: ``batch(step) -> (inputs, targets)``.

    Indexed by the schedule position rather than iterated, so the data order continues across
    rounds (and across a restarted process) without any sampler state. ``inputs`` is whatever
    the model's ``forward`` takes (a tensor, or a tuple / dict of tensors); ``targets`` is what
    the loss function compares the output with.
    """

    def batch(self, step: int) -> tuple[Any, Any]: ...


# (model output, targets) -> scalar loss; computed outside autocast, on the output as produced.
LossFn = Callable[[Any, Any], torch.Tensor]
# (model on its device, inner settings) -> the inner optimizer over the model's parameters.
OptimizerFn = Callable[[torch.nn.Module, "InnerConfig"], torch.optim.Optimizer]
# (schedule position, inner settings) -> the learning rate every parameter group gets (times the
# group's `LR_SCALE` entry where it has one: Muon's groups under client.optimizer=muon).
ScheduleFn = Callable[[int, "InnerConfig"], float]
# (inputs, targets) -> tokens in the batch: what token-weighted aggregation counts.
TokensFn = Callable[[Any, Any], int]


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``target`` (B, T), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def target_tokens(inputs: Any, target: Any) -> int:
    """Tokens of a batch for accounting: the number of target elements (B·T for a language model)."""
    return int(target.numel())


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` moved to ``device``: a tensor, or tuples / lists / dicts of them (others as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def default_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    """fl-geo's inner optimizer: AdamW with weight decay on matrices only; with
    ``cfg.optimizer == "muon"``, `muon_optimizer` (Muon on the hidden matrices, this AdamW on the rest).

    Decay matrices (embeddings, projections) only: decaying norm gains towards zero only fights
    the normalisation. Matrices come first in the optimizer's order.
    """
    if cfg.optimizer == "muon":
        return muon_optimizer(model, cfg)
    if cfg.optimizer != "adamw":
        raise ValueError(f"unknown inner optimizer {cfg.optimizer!r}; valid: adamw, muon")
    named = list(model.named_parameters())
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(0, cfg),
        betas=tuple(cfg.betas),
        eps=cfg.eps,
    )


def state_keys(names: Iterable[str], matrices: frozenset[str] = frozenset()) -> set[str]:
    """The keys of a complete `InnerTrainer.optimizer_state` of the default optimizer over the
    parameters ``names``: Muon's ``momentum_buffer`` for ``matrices``, AdamW's `STATE_KEYS` else."""
    return {f"{name}.{key}" for name in names for key in (("momentum_buffer",) if name in matrices else STATE_KEYS)}


def check_train_args(steps: int, start_step: int, time_budget_s: float) -> None:
    """The arguments of one inner training call (single process or data-parallel job): at least
    one step, a schedule position >= 0 and a time budget >= 0 (0: none); ValueError otherwise."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    if not time_budget_s >= 0:
        raise ValueError(f"time_budget_s must be >= 0, got {time_budget_s}")


class InnerTrainer:
    """Owns a model on its device and the optimizer state that persists across outer rounds.

    Defaults are fl-geo's inner loop (`default_optimizer`, `lr_at` warm-up / cosine,
    `next_token_loss`); a user's model comes with its own ``optimizer_fn``, ``loss_fn`` and
    ``tokens_fn`` (``fl_geo.clients.make_client_app``). ``lr_schedule=None`` leaves the learning
    rate to the optimizer instead of setting every group's ``lr`` each step.
    """

    # Free the gradients after each step (one process: less memory between steps). The
    # data-parallel rank trainer keeps them, because there they are the all-reduce buckets.
    zero_grad_to_none: bool = True

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: InnerConfig,
        *,
        optimizer_fn: OptimizerFn | None = None,
        loss_fn: LossFn | None = None,
        lr_schedule: ScheduleFn | None = lr_at,
        tokens_fn: TokensFn | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.amp_dtype = autocast_dtype(self.device, cfg.precision)
        self.model = model.to(self.device)
        set_activation_checkpointing(self.model, cfg.activation_checkpointing)  # also off: a kept model
        self.forward_module: torch.nn.Module = self.model  # a DDP replica in a data-parallel rank
        self.loss_fn = loss_fn or next_token_loss
        self.lr_schedule = lr_schedule
        self.tokens_fn = tokens_fn or target_tokens
        self.optimizer = (optimizer_fn or default_optimizer)(self.model, cfg)
        # What kind of state `optimizer_state` holds (tagged on the stored state: a state of another
        # kind is not loaded, fl_geo.clients.persist): the client section's choice, or a user's own.
        self.optimizer_kind = cfg.optimizer if optimizer_fn is None else "custom"
        names = {id(p): name for name, p in self.model.named_parameters()}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        unknown = [i for i, p in enumerate(params) if id(p) not in names]
        if unknown:
            raise ValueError(f"the inner optimizer holds {len(unknown)} tensors that are not "
                             "parameters of the model")
        self.param_names = [names[id(p)] for p in params]  # optimizer index order

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _loss(self, x: Any, y: Any) -> torch.Tensor:
        with self._autocast():
            output = self.forward_module(to_device(x, self.device))
        return self.loss_fn(output, to_device(y, self.device))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "npu":
            torch.npu.synchronize()
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def _stop(self, budget_reached: bool) -> bool:
        """Whether a budgeted loop stops after this step; one process simply obeys its own clock.

        A hook because a data-parallel job (fl_geo.inner.distributed) must stop every rank at the same
        step: a rank that stepped once more would wait in its gradient all-reduce until the
        process group times out.
        """
        return budget_reached

    def train(self, sampler: BatchSource, steps: int, start_step: int, time_budget_s: float = 0.0) -> TrainResult:
        """Run ``steps`` optimizer steps at schedule positions ``start_step …``.

        Batch ``start_step + i`` is drawn for step i, so the data order continues across rounds
        without any sampler state. Losses stay on the device until the end: reading each one
        would force an accelerator sync every step.

        ``time_budget_s > 0`` (A-EDiT): stop after the step during which the elapsed time reached
        the budget (``steps`` is then a cap). Measuring the time needs the device to finish each
        step, so a budgeted loop synchronises the accelerator every step.
        """
        check_train_args(steps, start_step, time_budget_s)
        self.model.train()
        losses = []
        tokens = 0
        self._synchronize()
        started = time.perf_counter()
        for i in range(steps):
            if self.lr_schedule is not None:
                lr = self.lr_schedule(start_step + i, self.cfg)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr * group.get(LR_SCALE, 1.0)
            x, y = sampler.batch(start_step + i)
            tokens += int(self.tokens_fn(x, y))
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
            tokens=tokens,
            mean_loss=float(all_losses.mean()),
            step_time_s=elapsed / done,
            final_loss=float(all_losses[-1]),
        )

    def gradient(self, sampler: BatchSource, step: int, names: Iterable[str], out: torch.Tensor) -> TrainResult:
        """The gradient of the loss of batch ``step`` at the model's current parameters, written
        into the flat fp32 ``out`` in the order of ``names`` (the model's state-dict layout); no
        clip and no optimizer step: the ``ddp`` method's job (the server averages the sites'
        gradients, clips the mean and takes the one AdamW step, `fl_geo.inner.large_batch`).

        The forward and backward pass are `train`'s (autocast, the loss function, token count).
        Every name must be a parameter of the model (a buffer has no gradient to average); a
        parameter the loss does not reach gets a zero gradient. The optimizer state is untouched.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        params = dict(self.model.named_parameters())
        names = list(names)
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"the model's state dict holds tensors that are not parameters ({missing[:3]}): a gradient "
                             "job (strategy ddp) averages parameters' gradients only")
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        self._synchronize()
        started = time.perf_counter()
        x, y = sampler.batch(step)
        tokens = int(self.tokens_fn(x, y))
        loss = self._loss(x, y)
        loss.backward()
        offset = 0
        with torch.no_grad():
            for name in names:
                p = params[name]
                n = p.numel()
                if p.grad is None:
                    out[offset:offset + n].zero_()
                else:
                    out[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
        if offset != out.numel():
            raise ValueError(f"the gradient has {offset} values, the buffer {out.numel()}")
        self.model.zero_grad(set_to_none=True)
        value = float(loss.detach())
        self._synchronize()
        return TrainResult(steps=1, tokens=tokens, mean_loss=value, step_time_s=time.perf_counter() - started,
                           final_loss=value)

    def evaluate(self, batches: Iterable[tuple[Any, Any]]) -> float:
        """Mean loss per token over ``batches`` (see :func:`evaluate_loss`)."""
        custom = None if self.loss_fn is next_token_loss else self.loss_fn
        return evaluate_loss(self.model, batches, self.amp_dtype, loss_fn=custom, tokens_fn=self.tokens_fn)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer state as ``{"<param>.<key>": tensor}`` on CPU (AdamW: ``exp_avg``,
        ``exp_avg_sq``, ``step``; SGD: ``momentum_buffer``; any per-parameter tensor or number).

        Flat and keyed by parameter name (not optimizer index) so it survives storage in an
        ``ArrayRecord`` and fails loudly if the model changes. Empty before the first step.
        AdamW's ``step`` is stored as float32; Python numbers become 0-d float64 tensors.
        """
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        flat: dict[str, torch.Tensor] = {}
        for name, param in zip(self.param_names, params, strict=True):
            state = self.optimizer.state.get(param)
            if not state:
                continue
            for key in sorted(state) if set(state) != set(STATE_KEYS) else STATE_KEYS:
                raw = state[key]
                if raw is None:
                    continue
                value = torch.as_tensor(raw, dtype=None if isinstance(raw, torch.Tensor) else torch.float64)
                value = value.detach()
                flat[f"{name}.{key}"] = value.to("cpu", copy=True).to(
                    torch.float32 if key == "step" else value.dtype
                )
        return flat

    @property
    def matrix_names(self) -> frozenset[str]:
        """The parameters the optimizer steps with Muon (state ``momentum_buffer``); empty unless
        it is a `MuonAdamW`."""
        if not isinstance(self.optimizer, MuonAdamW):
            return frozenset()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        matrices = {id(p) for p in self.optimizer.matrix_params}
        return frozenset(n for n, p in zip(self.param_names, params, strict=True) if id(p) in matrices)

    def _expected_state_keys(self) -> set[str] | None:
        """The complete state's keys for AdamW and `MuonAdamW` (after any step every parameter has
        its state); None for another optimizer, whose state may be partial."""
        if isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            return state_keys(self.param_names)
        if not isinstance(self.optimizer, MuonAdamW):
            return None
        return state_keys(self.param_names, self.matrix_names)

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Inverse of :meth:`optimizer_state`; an empty dict resets the state.

        Checked against the model: every key must name a parameter of the optimizer, and a
        per-parameter moment (AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``)
        must have its parameter's shape. For the default AdamW (and Muon: ``momentum_buffer``
        for its matrices, AdamW's keys for the rest) the key set must be complete.
        """
        given = set(flat)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        index_of = {name: i for i, name in enumerate(self.param_names)}
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key in sorted(given):
            name, _, field = key.rpartition(".")
            if name not in index_of:
                raise ValueError(f"optimizer state {key!r} names no parameter of the model")
            per_param.setdefault(index_of[name], {})[field] = flat[key]
        expected = self._expected_state_keys()
        if given and expected is not None and given != expected:
            missing, extra = sorted(expected - given)[:5], sorted(given - expected)[:5]
            raise ValueError(f"optimizer state does not match the model: missing {missing}, unexpected {extra}")
        for index, fields in per_param.items():
            name, param = self.param_names[index], params[index]
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in fields and tuple(fields[key].shape) != tuple(param.shape):
                    raise ValueError(
                        f"optimizer state {name}.{key} has shape {tuple(fields[key].shape)}, "
                        f"parameter has {tuple(param.shape)}"
                    )
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, fields in per_param.items():
            entry: dict[str, torch.Tensor] = {}
            for key, value in fields.items():
                if key == "step":
                    entry[key] = torch.as_tensor(value, dtype=torch.float32).reshape(()).clone()
                else:
                    entry[key] = torch.as_tensor(value).detach().clone()
            state[index] = entry
        state_dict = self.optimizer.state_dict()
        state_dict["state"] = state
        # load_state_dict moves the moments to each parameter's device and dtype and places
        # `step` where this optimizer configuration expects it.
        self.optimizer.load_state_dict(state_dict)


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    batches: Iterable[tuple[Any, Any]],
    amp_dtype: torch.dtype | None = None,
    *,
    loss_fn: LossFn | None = None,
    tokens_fn: TokensFn | None = None,
) -> float:
    """Mean loss per token (token-weighted) on the model's own device.

    Default: next-token cross-entropy in nats per token, summed exactly over all targets. With a
    user's ``loss_fn`` (a batch mean) each batch's loss is weighted by its ``tokens_fn`` count.
    A free function because the server evaluates the global model without any optimizer, and a
    client evaluates the received model without touching its inner optimizer state.
    """
    device = next(model.parameters()).device
    tokens_of = tokens_fn or target_tokens
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
                output = model(to_device(x, device))
            target = to_device(y, device)
            if loss_fn is None:
                total += F.cross_entropy(output.float().flatten(0, 1), target.flatten(), reduction="sum").double()
                count += y.numel()
            else:
                n = int(tokens_of(x, y))
                total += loss_fn(output, target).detach().double() * n
                count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate_loss() got no batches")
    return float(total) / count
