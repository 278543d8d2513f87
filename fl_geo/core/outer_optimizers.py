"""The outer optimizers (docs/algorithms.md §2): `Nesterov`, `DelayedNesterov`, `SGD` (``avg``,
``sgdm``), `FedAdam` and `FedYogi`, each an `fl_geo.core.outer_base.OuterOptimizer` on a flat fp32
parameter buffer.

Elementwise results do not depend on the chunking of the kernels. Where a reference exists the
rounding order follows it operation for operation: torch's SGD for `Nesterov`/`DelayedNesterov`,
Flower 1.41's strategies for `SGD`, `FedAdam` and `FedYogi` (see each class). Callers build them by
config name with ``fl_geo.core.outer.build_outer_optimizer``, which also re-exports every class.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any

import torch

from fl_geo.core.outer_base import OuterOptimizer, StateValue
from fl_geo.core.state import chunk_ranges

__all__ = ["SGD", "DelayedNesterov", "FedAdam", "FedYogi", "Nesterov"]


def _check_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def _check_non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


class _MomentumOptimizer(OuterOptimizer):
    """An outer optimizer with a learning rate (>= 0) and one momentum buffer (momentum in [0, 1])."""

    _hyper = ("lr", "momentum")
    _buffers = ("momentum_buffer",)
    lr: float
    momentum: float

    def __init__(self, numel: int, lr: float, momentum: float) -> None:
        super().__init__(numel)
        self._set_hyper(lr=lr, momentum=momentum)

    def _validate_hyper(self, key: str, value: Any) -> float:
        if key == "momentum":
            return _check_unit_interval(key, value)
        return _check_non_negative(key, value)


class Nesterov(_MomentumOptimizer):
    """DiLoCo's outer optimizer: ``torch.optim.SGD(lr, momentum, nesterov=True)`` on Δ̄.

    buf ← μ·buf + g;  θ ← θ − lr·(g + μ·buf). Operation order and rounding are those of torch's
    SGD (``buf.mul_(μ).add_(g)``, ``g.add(buf, alpha=μ)``, ``θ.add_(·, alpha=−lr)``), so results
    are bit-identical to it; the first-step ``buf = g`` of torch equals μ·0 + g here.
    """

    name = "nesterov"

    def __init__(self, numel: int, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__(numel, lr, momentum)

    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        mu, lr = self.momentum, self.lr
        if mu == 0.0:
            params.add_(grad, alpha=-lr)  # torch SGD without momentum: θ.add_(g, alpha=−lr)
            return
        buf = self._buffer("momentum_buffer", params)
        (tmp,) = self._scratches(params)
        for b, e in chunk_ranges(0, self.numel):
            g, m, t = grad[b:e], buf[b:e], tmp[: e - b]
            m.mul_(mu).add_(g)
            torch.add(g, m, alpha=mu, out=t)
            params[b:e].add_(t, alpha=-lr)


class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov (Liu et al. 2024, HALoS), docs/algorithms.md §2, state (t, m, acc)::

        acc += g
        if (t+1) % N == 0:  m = β·m + acc/N;  θ -= lr·((1 − c·N + c)·β·m + g/N);  acc = 0
        else:               θ -= lr·(c·β·m + g/N)
        t += 1

    ``t`` is `steps`. With N = 1 the accumulator is never allocated (acc/1 = g exactly), and with
    N = 1, c = 0 the kernel performs torch SGD-Nesterov's exact operations. The products
    ``k·β·m + g/N`` use a fused multiply-add like torch's ``add(alpha=...)``, so a literal
    transcription with separate roundings agrees to fp32 rounding, not bit for bit.
    """

    name = "delayed_nesterov"
    _hyper = ("lr", "momentum", "buffer_size", "activation")
    _buffers = ("momentum_buffer", "accumulator")
    _scratch_count = 1
    lr: float
    momentum: float
    buffer_size: int
    activation: float

    def __init__(
        self,
        numel: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        buffer_size: int = 1,
        activation: float = 0.0,
    ) -> None:
        super().__init__(numel)
        self._set_hyper(lr=lr, momentum=momentum, buffer_size=buffer_size, activation=activation)

    def _validate_hyper(self, key: str, value: Any) -> Any:
        if key == "momentum":
            return _check_unit_interval(key, value)
        if key == "buffer_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"buffer_size must be an int >= 1, got {value!r}")
            return value
        if key == "activation":
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"activation must be finite, got {value}")
            return value
        return _check_non_negative(key, value)

    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        n, beta, c, lr = self.buffer_size, self.momentum, self.activation, self.lr
        if beta == 0.0:
            # Both momentum terms vanish (θ -= lr·g/N every step): keep no model-sized buffers
            # (HALoS's global server without momentum, paper §5.4).
            (tmp,) = self._scratches(params)
            for b, e in chunk_ranges(0, self.numel):
                g_over_n = grad[b:e] if n == 1 else torch.div(grad[b:e], n, out=tmp[: e - b])
                params[b:e].add_(g_over_n, alpha=-lr)
            return
        boundary = (self.steps + 1) % n == 0
        coef = (1 - c * n + c) * beta if boundary else c * beta
        m_all = self._buffer("momentum_buffer", params)
        acc_all = self._buffer("accumulator", params) if n > 1 else None
        (tmp,) = self._scratches(params)
        for b, e in chunk_ranges(0, self.numel):
            g, m, t, p = grad[b:e], m_all[b:e], tmp[: e - b], params[b:e]
            if acc_all is None:  # N == 1: acc = 0 + g = g, acc/1 = g
                m.mul_(beta).add_(g)
            else:
                acc = acc_all[b:e]
                acc.add_(g)
                if boundary:
                    m.mul_(beta).add_(acc.div_(n))
                    acc.zero_()
            g_over_n = g if n == 1 else torch.div(g, n, out=t)
            if coef != 0.0:
                torch.add(g_over_n, m, alpha=coef, out=t)
                p.add_(t, alpha=-lr)
            else:
                p.add_(g_over_n, alpha=-lr)


class SGD(_MomentumOptimizer):
    """Server SGD with heavy-ball momentum: ``avg`` (FedAvg) and ``sgdm`` (FedAvgM).

    v ← μ·v + g (first step v = g, as μ·0 + g);  θ ← θ − lr·v, rounded as Flower 1.41's FedAvgM
    (``μ*v + g`` then ``old − lr*v``) so that, given the same Δ̄, the numbers are identical.
    With lr = 1 and μ = 0 this is θ ← θ − Δ̄, i.e. plain model averaging up to the rounding of
    θ − (θ − mean).
    """

    def __init__(self, numel: int, lr: float = 1.0, momentum: float = 0.0) -> None:
        super().__init__(numel, lr, momentum)

    @property
    def name(self) -> str:  # type: ignore[override]
        """``avg`` without momentum, ``sgdm`` with it (the factory names)."""
        return "avg" if self.momentum == 0.0 else "sgdm"

    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        mu, lr = self.momentum, self.lr
        if mu == 0.0:
            direction = grad
            if lr == 1.0:
                params.sub_(grad)
                return
        else:
            direction = self._buffer("momentum_buffer", params)
        (tmp,) = self._scratches(params)
        for b, e in chunk_ranges(0, self.numel):
            d = direction[b:e]
            if mu != 0.0:
                d.mul_(mu).add_(grad[b:e])
            if lr == 1.0:
                params[b:e].sub_(d)
            else:
                params[b:e].sub_(torch.mul(d, lr, out=tmp[: e - b]))


class _AdaptiveBase(OuterOptimizer):
    """Shared FedOpt machinery (Reddi et al. 2021), following Flower 1.41's `FedOpt`.

    Flower works with Δ_flower = aggregated − current = −Δ̄; we keep m in our sign convention
    (m = −m_flower) and subtract, which is the same arithmetic up to exact negations. v starts
    at 0 as in Flower (the paper's v₀ ≥ τ² is not used).
    """

    _hyper = ("lr", "beta1", "beta2", "tau")
    _buffers = ("exp_avg", "exp_avg_sq")
    _scratch_count = 2
    lr: float
    beta1: float
    beta2: float
    tau: float

    def __init__(self, numel: int, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__(numel)
        self._set_hyper(lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    def _validate_hyper(self, key: str, value: Any) -> Any:
        if key in ("beta1", "beta2"):
            return _check_unit_interval(key, value)
        if key == "tau":
            value = float(value)
            if not (value > 0.0 and math.isfinite(value)):
                raise ValueError(f"tau must be finite and > 0, got {value}")
            return value
        return _check_non_negative(key, value)

    def _step_size(self) -> float:
        return self.lr

    @abstractmethod
    def _update_second_moment(self, g: torch.Tensor, v: torch.Tensor, t1: torch.Tensor,
                              t2: torch.Tensor) -> None:
        """v ← f(v, g) on one chunk, with two chunk-sized scratches."""

    def _step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        b1, tau, eta = self.beta1, self.tau, self._step_size()
        m_all = self._buffer("exp_avg", params)
        v_all = self._buffer("exp_avg_sq", params)
        s1, s2 = self._scratches(params)
        for b, e in chunk_ranges(0, self.numel):
            g, m, v = grad[b:e], m_all[b:e], v_all[b:e]
            t1, t2 = s1[: e - b], s2[: e - b]
            # Flower: m = β1·m + (1 − β1)·Δ  (two roundings, no fused multiply-add)
            m.mul_(b1).add_(torch.mul(g, 1.0 - b1, out=t1))
            self._update_second_moment(g, v, t1, t2)
            # Flower: x + η·m / (sqrt(v) + τ), evaluated left to right
            torch.sqrt(v, out=t1).add_(tau)
            params[b:e].sub_(torch.mul(m, eta, out=t2).div_(t1))


class FedAdam(_AdaptiveBase):
    """FedAdam as Flower 1.41's ``FedAdam`` strategy.

    v ← β2·v + (1 − β2)·Δ̄²;  θ ← θ − η_t·m / (√v + τ), with Flower's bias-corrected step
    η_t = η·√(1 − β2^(r+1)) / (1 − β1^(r+1)) where r = Flower's ``server_round`` (1 on the first
    round), i.e. r = the 1-based index of this step. Kingma & Ba's correction would use exponent
    r; Flower's is one step ahead, and we keep Flower's (``bias_correction="flower"``, default).
    ``"adam"`` uses exponent r, ``"none"`` uses η unchanged.

    Deviation from Flower: Flower computes η_t in float64 and, under NumPy 2 promotion rules,
    its float64 scalar makes the new model float64 from the first round on. We keep θ and the
    state in fp32 (docs/algorithms.md §8); the numbers agree to fp32 rounding (test_outer pins it).
    """

    name = "fedadam"
    _hyper = ("lr", "beta1", "beta2", "tau", "bias_correction")
    _BIAS = ("flower", "adam", "none")
    bias_correction: str

    def __init__(
        self,
        numel: int,
        lr: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        bias_correction: str = "flower",
    ) -> None:
        super().__init__(numel, lr, beta1, beta2, tau)
        self._set_hyper(bias_correction=bias_correction)

    def _validate_hyper(self, key: str, value: Any) -> Any:
        if key == "bias_correction":
            if value not in self._BIAS:
                raise ValueError(f"bias_correction must be one of {self._BIAS}, got {value!r}")
            return value
        return super()._validate_hyper(key, value)

    def state_dict(self) -> dict[str, StateValue]:
        """As the base, with the string ``bias_correction`` stored as its index (int)."""
        out = super().state_dict()
        out["bias_correction"] = self._BIAS.index(self.bias_correction)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As the base; ``bias_correction`` may be the stored index or the name."""
        state = dict(state)
        value = state.get("bias_correction")
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < len(self._BIAS):
                raise ValueError(f"bias_correction index {value} out of range")
            state["bias_correction"] = self._BIAS[value]
        super().load_state_dict(state)

    def _step_size(self) -> float:
        if self.bias_correction == "none":
            return self.lr
        r = self.steps + 1  # Flower's server_round of this step
        exponent = r + 1.0 if self.bias_correction == "flower" else float(r)
        return self.lr * math.sqrt(1.0 - self.beta2**exponent) / (1.0 - self.beta1**exponent)

    def _update_second_moment(self, g: torch.Tensor, v: torch.Tensor, t1: torch.Tensor,
                              t2: torch.Tensor) -> None:
        # Flower: β2·v + (1 − β2)·Δ²
        v.mul_(self.beta2).add_(torch.mul(g, g, out=t1).mul_(1.0 - self.beta2))


class FedYogi(_AdaptiveBase):
    """FedYogi as Flower 1.41's ``FedYogi`` strategy (no bias correction, as Flower).

    v ← v − (1 − β2)·Δ̄²·sign(v − Δ̄²);  θ ← θ − η·m / (√v + τ). Every operation is fp32 in Flower
    too and the rounding order is Flower's, but the results are not always bit-identical: torch's
    vectorised CPU ``sqrt`` (AVX-512 build) is off by one ulp for some inputs where NumPy's is
    correctly rounded. Agreement is to fp32 rounding (test_outer pins it).
    """

    name = "fedyogi"

    def __init__(
        self,
        numel: int,
        lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
    ) -> None:
        super().__init__(numel, lr, beta1, beta2, tau)

    def _update_second_moment(self, g: torch.Tensor, v: torch.Tensor, t1: torch.Tensor,
                              t2: torch.Tensor) -> None:
        g2 = torch.mul(g, g, out=t1)
        sign = torch.sub(v, g2, out=t2).sign_()
        v.sub_(g2.mul_(1.0 - self.beta2).mul_(sign))
