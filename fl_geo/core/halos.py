"""HALoS local and global parameter servers as framework-free objects (docs/algorithms.md §6).

HALoS (Kim et al., ICML 2025) runs two tiers of asynchronous servers so that the slow WAN is
crossed rarely and never waited on:

* A **local parameter server** (LPS) per region serves the workers of its region. Each worker
  pseudo-gradient Δ_i = base − local is applied at once with one delayed-Nesterov step of the
  local model θ_k (``version += 1``) and the worker gets the new θ_k back, so workers never wait
  for the WAN. Once K updates have been applied since the last merge
  (``version == merged_version + K``) the LPS sends its net change ``U_k = θ_k^merged − θ_k`` to
  the global server and keeps serving workers. At most one send is outstanding: updates applied
  between a send and its merge are not sent (they reach the global model only through the merge).
* The **global parameter server** (GPS) applies each U_k as the gradient of one delayed-Nesterov
  step of θ_g and replies θ_g to that LPS, which mixes it in:
  ``θ_k ← (1 − α)·θ_k + α·θ_g`` (α = weight of the global model), then
  ``θ_k^merged ← θ_k`` and ``merged_version ← version``.

Both tiers share one interface, `ParameterServer`: ``params`` (the live flat fp32 model),
``version``, ``apply(update)``, ``snapshot()``/``restore(state)``. Only the transport differs
between a simulation (all servers in one process) and a deployment (docs/flower.md, "Two
tiers (HALoS) on Flower"), so nothing here imports Flower. Both optimizers keep their state (t, m, acc) across
merges and use a constant learning rate, as the HALoS code does.

Memory: the GPS holds θ_g plus the optimizer's momentum and accumulator (3 model-sized fp32
buffers, allocated lazily by the optimizer); the LPS adds θ_k^merged (4 buffers).
`LocalParameterServer.make_global_update` returns one new model-sized tensor, owned by the
caller; the merge is done in place.

**Compressed sends** (``halos.compress``, docs/compression.md): `make_compressed_update` sends U_k
as a `fl_geo.core.compress` payload with error feedback, the LPS being the client of the GPS:
U_k + e is compressed and e' = U_k + e − Û_k is kept by the LPS (one more model-sized fp32
buffer), in its `snapshot` with the rest of its state. A new LPS, or one restored from a
snapshot without it, starts from a zero residual, by rule. Inputs are validated before anything changes, so a
rejected update or snapshot leaves a server exactly as it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from fl_geo.core.accumulate import describe_non_finite
from fl_geo.core.compress import Compressor, Payload
from fl_geo.core.outer import DelayedNesterov, build_outer_optimizer
from fl_geo.core.state import chunk_ranges

__all__ = [
    "HALOS_DEFAULTS",
    "check_count",
    "GlobalParameterServer",
    "LocalParameterServer",
    "ParameterServer",
]

# Defaults of HALoS's run_halos.sh (docs/algorithms.md §6). The learning rates are the code's
# ``base_lr × N``: delayed Nesterov divides each gradient by N, so lr/N is the per-update step.
HALOS_DEFAULTS: dict[str, Any] = {
    "local_steps": 8,  # H: worker steps per job (before DynUpd rescaling)
    "accumulate": 32,  # K: LPS updates per global update
    "alpha": 0.25,  # weight of the global model in the LPS merge
    "global_lr": 0.15 * 2,
    "global_momentum": 0.5,  # 0 turns global momentum off (paper §5.4, non-IID data)
    "global_buffer_size": 2,
    "global_activation": 0.0,
    "local_lr": 0.2 * 16,
    "local_momentum": 0.9,
    "local_buffer_size": 16,
    "local_activation": 0.0,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (bool refused); ValueError naming ``name`` otherwise. Also
    the deployment's global checkpoint reader's check (`fl_geo.halos.apps`)."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_alpha(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"alpha must be a number in [0, 1], got {value!r}")
    try:
        alpha = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return alpha


def _check_flat(name: str, value: Any, numel: int, device: torch.device | None) -> torch.Tensor:
    """``value`` as a 1-D fp32 tensor of ``numel`` elements (on ``device`` unless None)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {value.dtype}")
    if tuple(value.shape) != (numel,):
        raise ValueError(f"{name} must have shape ({numel},), got {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, the server's model on {device}")
    return value


def _check_finite(name: str, value: torch.Tensor) -> None:
    """Raise ValueError if any element is NaN or ±Inf (chunked: no model-sized temporary)."""
    for b, e in chunk_ranges(0, value.numel()):
        if not bool(torch.isfinite(value[b:e]).all()):
            raise ValueError(f"{name} rejected: {describe_non_finite(value)}")


def _clone_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class ParameterServer(ABC):
    """One tier of HALoS: a flat fp32 model updated by delayed-Nesterov steps.

    ``params`` is the live model (1-D fp32, contiguous, updated in place; callers that keep it
    across a later `apply` must copy it). ``version`` counts the updates applied. An update
    follows the pseudo-gradient convention Δ = base − local, so a step ``θ ← θ − lr·(…Δ…)``
    moves θ toward the sender's model. `snapshot` returns copies of the whole state (model,
    version, optimizer state and hyperparameters, the subclass's extra state); `restore`
    validates a snapshot completely before changing anything and copies it (never aliases).
    Hyperparameters are part of the state and are restored with it, as with ``torch.optim``.
    """

    kind: ClassVar[str]
    _extra_keys: ClassVar[frozenset[str]] = frozenset()
    _optional_keys: ClassVar[frozenset[str]] = frozenset()  # may be missing from a snapshot

    def __init__(
        self,
        params0: torch.Tensor,
        *,
        lr: float,
        momentum: float,
        buffer_size: int,
        activation: float = 0.0,
    ) -> None:
        if not isinstance(params0, torch.Tensor) or not params0.is_floating_point():
            raise ValueError("params0 must be a floating-point torch.Tensor")
        if params0.dim() != 1 or params0.numel() == 0:
            raise ValueError(f"params0 must be 1-D and non-empty, got {tuple(params0.shape)}")
        _check_finite("params0", params0)
        # Own an fp32 copy: the caller's tensor is never updated or aliased.
        self._params = params0.detach().to(dtype=torch.float32, copy=True).contiguous()
        optimizer = build_outer_optimizer(
            "delayed_nesterov",
            self._params.numel(),
            lr=lr,
            momentum=momentum,
            buffer_size=buffer_size,
            activation=activation,
        )
        assert isinstance(optimizer, DelayedNesterov)
        self._optimizer: DelayedNesterov = optimizer
        self._version = 0

    # -- read-only views ---------------------------------------------------------------------

    @property
    def params(self) -> torch.Tensor:
        """The current model (live, updated in place)."""
        return self._params

    @property
    def version(self) -> int:
        """Number of updates applied (`apply` calls that succeeded)."""
        return self._version

    @property
    def numel(self) -> int:
        return self._params.numel()

    @property
    def device(self) -> torch.device:
        return self._params.device

    @property
    def optimizer(self) -> DelayedNesterov:
        """The delayed-Nesterov optimizer (a new object after `restore`)."""
        return self._optimizer

    # -- updates -----------------------------------------------------------------------------

    def apply(self, update: torch.Tensor) -> None:
        """One delayed-Nesterov step with ``update`` (Δ = base − local) as the gradient.

        ``update`` must be a 1-D fp32 tensor of `numel` finite values on the model's device and
        must not be ``params`` itself; otherwise ValueError and nothing changes.
        """
        self._check_can_apply()
        self._check_input("update", update)
        self._optimizer.step(self._params, update)
        self._version += 1

    def _check_input(self, name: str, value: Any) -> torch.Tensor:
        tensor = _check_flat(name, value, self.numel, self.device)
        if tensor.data_ptr() == self._params.data_ptr():
            raise ValueError(f"{name} must not be the server's own params")
        _check_finite(name, tensor)
        return tensor

    def _check_can_apply(self) -> None:
        """Hook: raise if the protocol forbids an update now (nothing has changed yet)."""
        return None

    # -- snapshot / restore ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Copies of the full state: tensors, ints, floats, bools and a string (torch.save-able)."""
        state: dict[str, Any] = {
            "kind": self.kind,
            "params": self._params.clone(),
            "version": self._version,
            "optimizer": _clone_state(self._optimizer.state_dict()),
        }
        state.update(self._extra_state())
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        """Load a `snapshot`: everything is validated first; ValueError leaves the server as is."""
        if not isinstance(state, Mapping):
            raise ValueError(f"snapshot must be a mapping, got {type(state).__name__}")
        required = {"kind", "params", "version", "optimizer", *self._extra_keys}
        if missing := sorted(required - set(state)):
            raise ValueError(f"snapshot lacks keys {missing}")
        if unexpected := sorted(set(state) - required - self._optional_keys):
            raise ValueError(f"snapshot has unexpected keys {unexpected}")
        if state["kind"] != self.kind:
            raise ValueError(f"snapshot is of a {state['kind']!r} server, this is {self.kind!r}")
        params = _check_flat("snapshot 'params'", state["params"], self.numel, None)
        version = check_count("snapshot 'version'", state["version"])
        optimizer = self._load_optimizer(state["optimizer"])
        if optimizer.steps != version:
            # Every update is exactly one optimizer step at both tiers.
            raise ValueError(
                f"snapshot optimizer has {optimizer.steps} steps but version is {version}"
            )
        commit_extra = self._prepare_extra(state, version)
        # Commit: nothing below can fail on validated input.
        with torch.no_grad():
            self._params.copy_(params)
        self._optimizer = optimizer
        self._version = version
        commit_extra()

    def _load_optimizer(self, state: Any) -> DelayedNesterov:
        """A fresh optimizer holding a copy of ``state`` (the live one is not touched)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"snapshot 'optimizer' must be a mapping, got {type(state).__name__}")
        optimizer = build_outer_optimizer("delayed_nesterov", self.numel)
        assert isinstance(optimizer, DelayedNesterov)
        try:
            optimizer.load_state_dict(dict(state))
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"snapshot 'optimizer' is invalid: {exc}") from exc
        return optimizer

    def _extra_state(self) -> dict[str, Any]:
        """Hook: the subclass's extra state (copies) for `snapshot`."""
        return {}

    @abstractmethod
    def _prepare_extra(self, state: Mapping[str, Any], version: int) -> Callable[[], None]:
        """Hook: validate the extra state; return a commit function that cannot fail."""


class LocalParameterServer(ParameterServer):
    """A regional HALoS server: applies worker updates, sends its net change every K of them.

    Protocol (docs/algorithms.md §6), in the order events arrive at the LPS:

    * worker Δ_i → `apply` (then reply `params` to the worker);
      if `ready_to_send` → `make_global_update` and ship U_k to the GPS;
    * θ_g from the GPS → `merge`.

    `apply` refuses (RuntimeError) while a send is due but not made: if one more update were
    applied, ``version`` would pass ``merged_version + K`` and the LPS would never send again.
    The optimizer state is never reset by a merge.

    ``alpha`` is the weight of the **global** model in the merge (α = 1 adopts θ_g, α = 0 keeps
    θ_k); the HALoS code's CLI help states the opposite convention, its value 0.25 is used
    with this meaning. ``accumulate`` is K.
    """

    kind = "local"
    _extra_keys = frozenset(
        {"merged_params", "merged_version", "outstanding", "sends", "accumulate", "alpha"}
    )
    _optional_keys = frozenset({"residual"})  # absent: a zero residual (a restarted LPS starts from zero)

    def __init__(
        self,
        params0: torch.Tensor,
        *,
        lr: float,
        momentum: float,
        buffer_size: int,
        activation: float = 0.0,
        accumulate: int = 32,
        alpha: float = 0.25,
    ) -> None:
        self._accumulate = check_count("accumulate", accumulate, minimum=1)
        self._alpha = _check_alpha(alpha)
        super().__init__(
            params0, lr=lr, momentum=momentum, buffer_size=buffer_size, activation=activation
        )
        self._merged = self._params.clone()
        self._merged_version = 0
        self._outstanding = False
        self._sends = 0
        self._residual: torch.Tensor | None = None  # error feedback of compressed sends (None: zero)

    @property
    def accumulate(self) -> int:
        """K: updates applied between two sends."""
        return self._accumulate

    @property
    def alpha(self) -> float:
        """Weight of the global model in `merge`."""
        return self._alpha

    @property
    def merged_params(self) -> torch.Tensor:
        """θ_k^merged: the model right after the last merge (initially params0). Live; read only."""
        return self._merged

    @property
    def merged_version(self) -> int:
        """`version` at the last merge (0 before the first)."""
        return self._merged_version

    @property
    def outstanding(self) -> bool:
        """True between `make_global_update` and the `merge` of the GPS's reply."""
        return self._outstanding

    @property
    def sends(self) -> int:
        """Number of global updates made."""
        return self._sends

    @property
    def residual(self) -> torch.Tensor | None:
        """The error-feedback residual of `make_compressed_update` (None: zero). Live; read only."""
        return self._residual

    def ready_to_send(self) -> bool:
        """K updates applied since the last merge and no send outstanding."""
        return not self._outstanding and self._version == self._merged_version + self._accumulate

    def _check_can_apply(self) -> None:
        if self.ready_to_send():
            raise RuntimeError(
                f"{self._accumulate} updates since the last merge are due to be sent; call "
                "make_global_update() before applying more"
            )

    def make_global_update(self) -> torch.Tensor:
        """U_k = θ_k^merged − θ_k (a new tensor) and mark the send outstanding.

        The sign is the pseudo-gradient convention (base − local), so the GPS's descent step
        moves θ_g toward θ_k. RuntimeError if `ready_to_send` is False.
        """
        self._check_ready()
        update = torch.sub(self._merged, self._params)
        self._outstanding = True
        self._sends += 1
        return update

    def make_compressed_update(self, compressor: Compressor) -> Payload:
        """U_k as ``compressor``'s payload, with this LPS's error feedback (when the compressor's
        settings have it): U_k + e is compressed and the residual becomes U_k + e − Û_k. Marks the
        send outstanding like `make_global_update`; the GPS applies the decoded Û_k. RuntimeError
        if not `ready_to_send`; ValueError (non-finite U_k + e) leaves the LPS as it was."""
        self._check_ready()
        update = torch.sub(self._merged, self._params)
        residual = self._residual if compressor.settings.error_feedback else None
        payload, new_residual = compressor.compress(update, residual)
        self._residual = new_residual
        self._outstanding = True
        self._sends += 1
        return payload

    def _check_ready(self) -> None:
        if not self.ready_to_send():
            why = "a send is outstanding" if self._outstanding else (
                f"{self._version - self._merged_version} of {self._accumulate} updates applied "
                "since the last merge")
            raise RuntimeError(f"LPS not ready to send: {why}")

    def merge(self, global_params: torch.Tensor) -> None:
        """θ_k ← (1 − α)·θ_k + α·θ_g in place; θ_k^merged ← θ_k; merged_version ← version.

        ``global_params`` is validated like an update (ValueError, nothing changes). Uses
        ``lerp_``, which is exact at the ends: α = 1 yields θ_g and α = 0 θ_k bit for bit.
        RuntimeError without an outstanding send: the GPS replies once per send, so a second
        merge would be a duplicated or stale reply mixed in twice.
        """
        if not self._outstanding:
            raise RuntimeError("merge without an outstanding send (duplicate or stale reply?)")
        theta_g = _check_flat("global_params", global_params, self.numel, self.device)
        _check_finite("global_params", theta_g)
        with torch.no_grad():
            self._params.lerp_(theta_g, self._alpha)
            self._merged.copy_(self._params)
        self._merged_version = self._version
        self._outstanding = False

    def resync(self, global_params: torch.Tensor, adopt: bool = False) -> None:
        """Merge θ_g whatever the send state: one of the tiers of the two-tier deployment
        (`fl_geo.halos.apps`) restarted from a checkpoint, and the global server sends this
        region its θ_g as a resync.

        θ_k ← (1 − α)·θ_k + α·θ_g as in `merge`, and the send window starts again at this
        version: an update that was outstanding (or made and not yet sent) is given up, as the
        restarted global server never saw it or lost it; its effect stays in θ_k. The optimizer
        state and the error-feedback residual are kept. ``adopt``: θ_k ← θ_g (weight 1), for a
        local server that starts afresh in a running deployment (a regional run restarted without a
        checkpoint): its own model holds only updates from θ_0, and every local server of a run
        starts from the global model. ValueError (nothing changes) for a θ_g of the wrong shape
        or with non-finite values."""
        theta_g = _check_flat("global_params", global_params, self.numel, self.device)
        _check_finite("global_params", theta_g)
        with torch.no_grad():
            self._params.lerp_(theta_g, 1.0 if adopt else self._alpha)  # exact at 1: θ_g bit for bit
            self._merged.copy_(self._params)
        self._merged_version = self._version
        self._outstanding = False

    def _extra_state(self) -> dict[str, Any]:
        return {
            "merged_params": self._merged.clone(),
            "merged_version": self._merged_version,
            "outstanding": self._outstanding,
            "sends": self._sends,
            "accumulate": self._accumulate,
            "alpha": self._alpha,
            "residual": None if self._residual is None else self._residual.clone(),
        }

    def _prepare_extra(self, state: Mapping[str, Any], version: int) -> Callable[[], None]:
        merged = _check_flat("snapshot 'merged_params'", state["merged_params"], self.numel, None)
        merged_version = check_count("snapshot 'merged_version'", state["merged_version"])
        outstanding = state["outstanding"]
        if not isinstance(outstanding, bool):
            raise ValueError(f"snapshot 'outstanding' must be a bool, got {outstanding!r}")
        sends = check_count("snapshot 'sends'", state["sends"], minimum=int(outstanding))
        accumulate = check_count("snapshot 'accumulate'", state["accumulate"], minimum=1)
        alpha = _check_alpha(state["alpha"])
        residual = state.get("residual")
        if residual is not None:
            residual = _check_flat("snapshot 'residual'", residual, self.numel, None)
            _check_finite("snapshot 'residual'", residual)
        since = version - merged_version
        # A send is made when `since` reaches K: before it `since` <= K, after it `since` >= K.
        if since < 0 or (since > accumulate and not outstanding) or (
                since < accumulate and outstanding):
            raise ValueError(
                f"inconsistent snapshot: version {version}, merged_version {merged_version}, "
                f"K {accumulate}, outstanding {outstanding}"
            )

        def commit() -> None:
            with torch.no_grad():
                self._merged.copy_(merged)
            self._merged_version = merged_version
            self._outstanding = outstanding
            self._sends = sends
            self._accumulate = accumulate
            self._alpha = alpha
            self._residual = None if residual is None else residual.detach().to(self.device, copy=True)

        return commit


class GlobalParameterServer(ParameterServer):
    """The HALoS global server: one delayed-Nesterov step of θ_g per LPS update U_k.

    After `apply`, `params` is the reply to the LPS that sent U_k (the caller copies it or
    ships it before the next `apply`). ``momentum=0`` is allowed and turns global momentum off
    (paper §5.4, non-IID data): with β = 0 every coefficient on m vanishes and each step is
    plain SGD ``θ_g ← θ_g − (lr/N)·U_k``, whatever N and c (N and lr then only set the
    step size lr/N). The optimizer still keeps its momentum and accumulator buffers then.
    """

    kind = "global"

    def _prepare_extra(self, state: Mapping[str, Any], version: int) -> Callable[[], None]:
        return lambda: None
