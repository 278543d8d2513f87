"""Streaming DiLoCo and CoCoDC building blocks (docs/algorithms.md §7): fragments, per-fragment outer
optimizers, the merge rules and the two sync schedules.

Streaming DiLoCo synchronises the model one *fragment* (a strided subset of the transformer
blocks) at a time, so each sync moves 1/P of the model and overlaps with τ inner steps of
training. This module and its two siblings hold the pieces that do not depend on how messages
travel:

* `Fragments` maps fragment p to ranges of the flat fp32 buffer (`fl_geo.core.state`) and gathers /
  scatters a fragment as one contiguous 1-D tensor, so everything downstream (outer optimizer,
  merge, wire payload) works on plain fragment-shaped tensors.
* `FragmentOuterOptimizers` keeps one outer optimizer state per fragment: fragments are stepped
  at different times and possibly at different rates (CoCoDC), so they cannot share a momentum
  buffer or step counter.
* `streaming_merge` (Streaming DiLoCo's mixing) and `cocodc_compensate` (CoCoDC's delay
  compensation, Algorithm 1) turn a freshly arrived global fragment into the worker's new
  fragment. Both return **new tensors** and never modify their inputs; the caller scatters the
  result back with `Fragments.scatter_`.
* `fixed_schedule` (torchft's round-robin) and `AdaptiveSchedule` (CoCoDC Algorithm 2) decide
  *which* fragment syncs *when*.

This module holds the per-fragment outer step and the merge rules; the fragment layout lives in
`fl_geo.core.streaming_fragments` and the schedules in `fl_geo.core.streaming_schedule`, both
re-exported here (the names' historical home, which callers and the docs import from).

Sign convention (docs/algorithms.md, Notation): the pseudo-gradient is Δ = base − local, so the outer
step θ ← θ − η·Δ̄ moves the global fragment toward the workers. Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fl_geo.core.outer import OuterOptimizer, build_outer_optimizer
from fl_geo.core.streaming_fragments import Fragments, Ranges, fragment_record, fragment_spec
from fl_geo.core.streaming_schedule import AdaptiveSchedule, FixedSchedule, fixed_schedule

__all__ = [
    "AdaptiveSchedule",
    "FragmentOuterOptimizers",
    "Fragments",
    "Ranges",
    "cocodc_compensate",
    "FixedSchedule",
    "fixed_schedule",
    "fragment_record",
    "fragment_spec",
    "streaming_merge",
]


# ---------------------------------------------------------------------------------------------
# Per-fragment outer optimizers
# ---------------------------------------------------------------------------------------------


class FragmentOuterOptimizers:
    """One outer optimizer (docs/algorithms.md §2) per fragment, on fragment-shaped tensors.

    Each fragment is stepped only when its own sync completes, so its momentum, moments and
    step counter (FedAdam's bias correction) must be its own: sharing one full-model state would
    decay fragment q's momentum whenever fragment p steps. Because all outer optimizers are
    elementwise, stepping every fragment once with the gathered pieces of a full Δ̄ gives the
    same numbers as one full-model step.
    """

    def __init__(self, fragments: Fragments, name: str, **kwargs: Any) -> None:
        self.fragments = fragments
        self.name = name
        self._kwargs = dict(kwargs)
        self._opts: list[OuterOptimizer] = self._build()

    def _build(self) -> list[OuterOptimizer]:
        return [build_outer_optimizer(self.name, self.fragments.numel(p), **self._kwargs)
                for p in range(self.fragments.num_fragments)]

    @property
    def num_fragments(self) -> int:
        return self.fragments.num_fragments

    def optimizer(self, p: int) -> OuterOptimizer:
        """Fragment p's optimizer (for inspection; step through `step`)."""
        return self._opts[self.fragments._check_p(p)]

    def step(self, p: int, global_fragment: torch.Tensor, mean_delta: torch.Tensor) -> None:
        """One outer step of fragment p: ``global_fragment`` ← step(``mean_delta``), in place.

        ``global_fragment`` is the server's stored copy of the fragment (1-D fp32, contiguous,
        `Fragments.numel` (p) elements) and ``mean_delta`` the mean Δ_p = base − local over the
        workers of this sync. Other fragments' states are untouched.
        """
        self._opts[self.fragments._check_p(p)].step(global_fragment, mean_delta)

    def state_dict(self) -> dict[str, Any]:
        """``name``, ``num_fragments``, and one optimizer `state_dict` per fragment.

        Like `OuterOptimizer.state_dict`, buffers are live references (clone to snapshot).
        """
        return {
            "name": self.name,
            "num_fragments": self.num_fragments,
            "fragments": [opt.state_dict() for opt in self._opts],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every fragment's state, or raise ValueError and change nothing.

        Each state is loaded into a freshly built optimizer first (which validates it); only if
        all P load cleanly are the fresh ones swapped in, so a bad state for fragment 3 cannot
        leave fragments 0–2 restored and the rest stale.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state)}")
        if set(state) != {"name", "num_fragments", "fragments"}:
            raise ValueError(f"state keys must be name, num_fragments, fragments; got "
                             f"{sorted(state)}")
        if state["name"] != self.name:
            raise ValueError(f"state is for outer optimizer {state['name']!r}, this is "
                             f"{self.name!r}")
        per_fragment = state["fragments"]
        if (state["num_fragments"] != self.num_fragments
                or not isinstance(per_fragment, (list, tuple))
                or len(per_fragment) != self.num_fragments):
            raise ValueError(f"state must hold {self.num_fragments} fragment states")
        fresh = self._build()
        for p, (opt, sub) in enumerate(zip(fresh, per_fragment, strict=True)):
            try:
                opt.load_state_dict(sub)
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"fragment {p}: {exc}") from exc
        self._opts = fresh


# ---------------------------------------------------------------------------------------------
# Merge rules (fragment tensors in, new tensor out)
# ---------------------------------------------------------------------------------------------


def _check_fragments(**tensors: torch.Tensor) -> None:
    """Same shape, dtype and device; floating; finite. A non-finite value here would be written
    into the worker's model by the merge and silently poison every later step."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor")
        if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError(
                f"{name} ({t.dtype} {tuple(t.shape)} on {t.device}) does not match {name0} "
                f"({t0.dtype} {tuple(t0.shape)} on {t0.device})"
            )
    for name, t in items:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has non-finite values")


def streaming_merge(local_now: torch.Tensor, global_new: torch.Tensor,
                    alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's mixing: (1 − α)·θ^m_p(t_l) + α·θ^g_p, as a new tensor.

    α is the weight of the *global* fragment (CoCoDC Eq. 3; torchft's ``fragment_update_alpha``
    is 1 − α). ``torch.lerp`` evaluates this as ``local + α·(global − local)`` for α < 0.5 and
    ``global − (1 − α)·(global − local)`` otherwise, so α = 1 returns the global fragment and
    α = 0 the local one *exactly*, with no rounding from the round trip.
    """
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _check_fragments(local_now=local_now, global_new=global_new)
    with torch.no_grad():
        return torch.lerp(local_now, global_new, alpha)


def cocodc_compensate(local_at_start: torch.Tensor, local_now: torch.Tensor,
                      global_new: torch.Tensor, tau: float, H: float,
                      lam: float = 0.5) -> torch.Tensor:
    """CoCoDC delay compensation (Algorithm 1) in progress form (docs/algorithms.md §7), new tensor.

    With d = θ^m_p(t_l) − θ^m_p(t_p) (local progress during the τ overlapped steps),
    r = d/τ, and D = θ^g_p − θ^m_p(t_p)::

        r_c = r − λ·r⊙r⊙D/H,      result = θ^g_p + τ·r_c.

    θ^g_p here is the **new** global fragment (``global_new``, the outer step on the mean Δ_p of
    the sync started at t_p) in both places: docs/algorithms.md §7 uses the one symbol θ^g_p for
    both, and the paper defines its θ^g_{p,t_p} as the state *after* the outer step (Eq. 2),
    using it in Eq. 5 (D) and Eq. 8 (result) alike. The pre-step global copy is not needed.

    Why the correction has this sign: g = −r behaves like a gradient, and the Taylor step
    g_c = g + λ·g⊙g⊙D/H (Eq. 7, diagonal Fisher approximation of the Hessian) becomes
    r_c = r − λ·r⊙r⊙D/H. Where the new global already lies ahead of the worker's t_p state in
    the direction it was moving (r > 0, D > 0), the local progress is damped; where the global
    moved back (D < 0) it is amplified.

    Evaluated as ``global + (d − (λ/(τ·H))·d⊙d⊙D)``, which equals θ^g + τ·r_c
    (τ·r⊙r = d⊙d/τ) without dividing and re-multiplying by τ, so λ = 0 gives exactly
    ``global_new + (local_now − local_at_start)``.

    ``tau`` ≥ 1 is the measured overlap in inner steps, ``H`` ≥ 1 the local period, ``lam`` ≥ 0
    the compensation strength (the paper uses 0.5). Inputs must be finite with matching shape,
    dtype and device; none is modified.
    """
    tau, H, lam = float(tau), float(H), float(lam)
    if not (math.isfinite(tau) and tau >= 1.0):
        raise ValueError(f"tau must be finite and >= 1, got {tau}")
    if not (math.isfinite(H) and H >= 1.0):
        raise ValueError(f"H must be finite and >= 1, got {H}")
    if not (math.isfinite(lam) and lam >= 0.0):
        raise ValueError(f"lam must be finite and >= 0, got {lam}")
    _check_fragments(local_at_start=local_at_start, local_now=local_now, global_new=global_new)
    with torch.no_grad():
        d = torch.sub(local_now, local_at_start)
        if lam != 0.0:
            correction = torch.mul(d, d)
            correction.mul_(torch.sub(global_new, local_at_start)).mul_(lam / (tau * H))
            d.sub_(correction)
        return d.add_(global_new)

