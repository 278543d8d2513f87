"""The contract every outer (server-side) optimizer keeps, and the kernel plumbing they share.

An outer optimizer receives the averaged pseudo-gradient Δ̄ = mean(base − local) and updates the
global parameters in place; ``grad`` is never modified. State is fp32 (docs/algorithms.md §8) and
O(1) in the number of workers. Model-sized state buffers are allocated **lazily on the first
step**, on the device of ``params``: constructing an optimizer is free, momentum-free variants
never allocate, and `state_dict` before the first step holds only scalars.

Kernels walk the buffers in `CHUNK_ELEMS` chunks and keep intermediate values in chunk-sized
scratches (`OuterOptimizer._scratches`), so a step needs no model-sized temporary and each buffer
crosses the memory bus once per step (the chunk stays in cache between the ops).

`OuterOptimizer` is apart from the optimizers themselves (``fl_geo.core.outer_optimizers``) so that
those, and the registry in ``fl_geo.core.outer`` that imports them, all build on it without
importing one another in a circle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from fl_geo.core.state import CHUNK_ELEMS

__all__ = ["OuterOptimizer", "StateValue"]

StateValue = torch.Tensor | int | float


class OuterOptimizer(ABC):
    """Common interface: ``step(params, grad)`` in place, plus a checkpointable state.

    Subclasses declare ``name``, the hyperparameters saved in the state (``_hyper``, set by the
    constructor through `_set_hyper`) and their model-sized buffers (``_buffers``), and implement
    ``_step``. `state_dict` returns references to the live buffers (no model-sized copy; clone
    them to snapshot mid-run); `load_state_dict` copies what it is given, so the optimizer never
    aliases caller tensors. Hyperparameters are part of the state and are restored by
    `load_state_dict`, as with ``torch.optim``.
    """

    name: ClassVar[str]
    _hyper: ClassVar[tuple[str, ...]] = ()
    _buffers: ClassVar[tuple[str, ...]] = ()
    _scratch_count: ClassVar[int] = 1

    def __init__(self, numel: int) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise ValueError(f"numel must be a positive int, got {numel!r}")
        self.numel = numel
        self.steps = 0  # completed steps
        self._state: dict[str, torch.Tensor] = {}
        self._scratch: list[torch.Tensor] = []

    # -- public API -------------------------------------------------------------------------

    def step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one outer step to ``params`` (1-D fp32, in place) with ``grad`` = Δ̄."""
        self._check_step_args(params, grad)
        with torch.no_grad():
            self._step(params, grad)
        self.steps += 1

    def state_dict(self) -> dict[str, StateValue]:
        """Scalars (``numel``, ``steps``, hyperparameters) and the allocated buffers."""
        out: dict[str, StateValue] = {"numel": self.numel, "steps": self.steps}
        for key in self._hyper:
            out[key] = getattr(self, key)
        out.update(self._state)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`, validating keys, sizes and dtypes before changing anything."""
        required = {"numel", "steps", *self._hyper}
        allowed = required | set(self._buffers)
        keys = set(state)
        if missing := sorted(required - keys):
            raise ValueError(f"{self.name} state lacks keys {missing}")
        if unexpected := sorted(keys - allowed):
            raise ValueError(
                f"{self.name} state has unexpected keys {unexpected}; valid keys: {sorted(allowed)}"
            )
        if state["numel"] != self.numel:
            raise ValueError(
                f"{self.name} state is for {state['numel']} parameters, this optimizer has "
                f"{self.numel}"
            )
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{self.name} state 'steps' must be an int >= 0, got {steps!r}")
        buffers = {k: state[k] for k in self._buffers if k in state}
        for key, value in buffers.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{self.name} state {key!r} must be a tensor, got {type(value)}")
            if value.dtype != torch.float32 or value.dim() != 1 or value.numel() != self.numel:
                raise ValueError(
                    f"{self.name} state {key!r} must be 1-D float32 of {self.numel} elements, "
                    f"got {value.dtype} {tuple(value.shape)}"
                )
        # Validate every hyperparameter before setting any, so a bad state changes nothing.
        hyper = {key: self._validate_hyper(key, state[key]) for key in self._hyper}
        for key, value in hyper.items():
            setattr(self, key, value)
        self.steps = steps
        self._state = {k: v.detach().clone() for k, v in buffers.items()}

    def _validate_hyper(self, key: str, value: Any) -> Any:
        return float(value)

    def _set_hyper(self, **values: Any) -> None:
        """Validate and set the hyperparameters given, one by one and in order: how a constructor
        takes its arguments (the first invalid one raises)."""
        for key, value in values.items():
            setattr(self, key, self._validate_hyper(key, value))

    # -- kernel plumbing --------------------------------------------------------------------

    def _check_step_args(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        if params.dtype != torch.float32 or params.dim() != 1 or params.numel() != self.numel:
            raise ValueError(
                f"params must be a 1-D float32 tensor of {self.numel} elements, got "
                f"{params.dtype} {tuple(params.shape)}"
            )
        if not params.is_contiguous():
            raise ValueError("params must be contiguous")
        if not grad.is_floating_point() or grad.dim() != 1 or grad.numel() != self.numel:
            raise ValueError(
                f"grad must be a 1-D floating tensor of {self.numel} elements, got "
                f"{grad.dtype} {tuple(grad.shape)}"
            )
        if grad.device != params.device:
            raise ValueError(f"grad on {grad.device}, params on {params.device}")
        if grad.data_ptr() == params.data_ptr():
            raise ValueError("grad must not alias params")

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The state buffer ``key``, allocated as zeros on first use (lazy allocation)."""
        buf = self._state.get(key)
        if buf is None:
            buf = torch.zeros(self.numel, dtype=torch.float32, device=like.device)
            self._state[key] = buf
        elif buf.device != like.device:
            buf = buf.to(like.device)
            self._state[key] = buf
        return buf

    def _scratches(self, like: torch.Tensor) -> list[torch.Tensor]:
        """Chunk-sized fp32 temporaries (cache-resident), reused across steps."""
        if not self._scratch or self._scratch[0].device != like.device:
            size = min(CHUNK_ELEMS, self.numel)
            self._scratch = [
                torch.empty(size, dtype=torch.float32, device=like.device)
                for _ in range(self._scratch_count)
            ]
        return self._scratch

    @abstractmethod
    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        """Update ``params`` in place (validated arguments, inside ``torch.no_grad``)."""
