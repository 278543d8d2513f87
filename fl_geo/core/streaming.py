"""Streaming DiLoCo and CoCoDC building blocks (docs/algorithms.md §7): fragments, per-fragment outer
optimizers, the merge rules and the two sync schedules.

Streaming DiLoCo synchronises the model one *fragment* (a strided subset of the transformer
blocks) at a time, so each sync moves 1/P of the model and overlaps with τ inner steps of
training. This module holds the pieces that do not depend on how messages travel:

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

Sign convention (docs/algorithms.md, Notation): the pseudo-gradient is Δ = base − local, so the outer
step θ ← θ − η·Δ̄ moves the global fragment toward the workers. Framework-free (no Flower import).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from fl_geo.core.groups import layer_container, module_group_names
from fl_geo.core.outer import OuterOptimizer, build_outer_optimizer
from fl_geo.core.state import ParamSpec

__all__ = [
    "AdaptiveSchedule",
    "FragmentOuterOptimizers",
    "Fragments",
    "cocodc_compensate",
    "FixedSchedule",
    "fixed_schedule",
    "fragment_record",
    "fragment_spec",
    "streaming_merge",
]

Ranges = list[tuple[int, int]]


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are rejected (they are config slips)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Fragments
# ---------------------------------------------------------------------------------------------


def _blocks_from_names(spec: ParamSpec, blocks: Sequence[Sequence[str]]) -> list[int | None]:
    """Per spec entry, the index of the block listing it (None: in no block); validated."""
    known = set(spec.names)
    block_of: dict[str, int] = {}
    for index, names in enumerate(blocks):
        if isinstance(names, str) or not list(names):
            raise ValueError(f"block {index} must be a non-empty list of parameter names, got {names!r}")
        for name in names:
            if name not in known:
                raise ValueError(f"block {index} names {name!r}, which is not a parameter of the model")
            if name in block_of:
                raise ValueError(f"parameter {name!r} is in blocks {block_of[name]} and {index}")
            block_of[name] = index
    return [block_of.get(name) for name in spec.names]


class Fragments:
    """Strided assignment of transformer blocks to P fragments, as flat-buffer ranges.

    A *block* is one layer of the model's layer list, found in the parameter names at any depth
    (`fl_geo.core.groups.layer_container`: ``blocks.3`` in fl-geo's decoder, ``gpt_neox.layers.3``,
    ``model.layers.3``, ``transformer.h.3`` in Hugging Face models). Blocks are numbered 0 … L−1
    in the order they first appear in the spec (for a model built with ``nn.ModuleList`` that is
    depth order, i.e. the container index), and block i goes to fragment ``i mod P``. The strided pattern (Streaming DiLoCo)
    makes every fragment span the whole depth, so each sync touches shallow and deep layers
    alike and no fragment is "the embedding end" of the network.

    Parameters outside the blocks go with the first or last fragment (docs/algorithms.md §7):

    * those before the first block in the spec (the embedding) go with fragment 0;
    * those after the last block (the final norm, and an untied head if the model has one) go
      with fragment P − 1;
    * those between two blocks (none in our model) go with the fragment of the nearest block
      before them, since they run right after it in the forward pass.

    Our model ties the head to ``embed.weight``, so there is no separate head entry and the
    whole embedding/unembedding matrix lives in fragment 0. If a spec listed a tied head under a
    second name after the last block, the two copies would sit in different fragments and drift
    apart; build the spec from the de-duplicated parameters in that case.

    P must satisfy 1 ≤ P ≤ L so that no fragment is empty of blocks.
    """

    def __init__(self, spec: ParamSpec, num_fragments: int,
                 blocks: Sequence[Sequence[str]] | None = None) -> None:
        if isinstance(num_fragments, bool) or not isinstance(num_fragments, int):
            raise ValueError(f"num_fragments must be an int, got {num_fragments!r}")
        if blocks is None:  # the layers of the model's layer list, in order of appearance
            container = layer_container(spec.names, spec.numels)
            order: dict[str, int] = {}
            units = module_group_names(spec.names, spec.numels, container)
            for unit in units:
                if container and unit.startswith(container + ".") and unit not in order:
                    order[unit] = len(order)
            block_of = [order.get(unit) for unit in units]
            num_blocks = len(order)
            where = f"layers of {container}" if container else "layers (no <list>.<int> layer list in the parameter names)"
        else:
            block_of = _blocks_from_names(spec, blocks)
            num_blocks = len(blocks)
            where = "blocks given"
        if not 1 <= num_fragments <= num_blocks:
            raise ValueError(
                f"num_fragments (streaming.fragments) must be in [1, {num_blocks}]: the model has "
                f"{num_blocks} {where}, got {num_fragments}"
            )
        self.spec = spec
        self.num_fragments = num_fragments
        self.num_blocks = num_blocks

        positions = [i for i, b in enumerate(block_of) if b is not None]
        first, last = positions[0], positions[-1]
        assignment: list[int] = []
        current = 0  # fragment of the nearest block before the current parameter
        for i, block in enumerate(block_of):
            if block is not None:
                current = block % num_fragments
                assignment.append(current)
            elif i < first:
                assignment.append(0)
            elif i > last:
                assignment.append(num_fragments - 1)
            else:
                assignment.append(current)

        names: list[list[str]] = [[] for _ in range(num_fragments)]
        ranges: list[Ranges] = [[] for _ in range(num_fragments)]
        for name, begin, n, p in zip(spec.names, spec.offsets, spec.numels, assignment,
                                     strict=True):
            names[p].append(name)
            if n == 0:  # holds no data: named, but contributes no range
                continue
            own = ranges[p]
            if own and own[-1][1] == begin:  # spec order is offset order: merge neighbours
                own[-1] = (own[-1][0], begin + n)
            else:
                own.append((begin, begin + n))
        self._names = [tuple(n) for n in names]
        self._ranges = [tuple(r) for r in ranges]
        self._numels = [sum(e - b for b, e in r) for r in ranges]

    @classmethod
    def from_spec(cls, spec: ParamSpec, num_fragments: int) -> Fragments:
        """The strided partition of ``spec`` into ``num_fragments`` fragments (see the class)."""
        return cls(spec, num_fragments)

    @classmethod
    def from_blocks(cls, spec: ParamSpec, num_fragments: int,
                    blocks: Sequence[Sequence[str]]) -> Fragments:
        """Like `from_spec`, with the blocks given as parameter-name groups in depth order
        (a user's model: ``[[names of block 0], [names of block 1], …]``). Block i goes to
        fragment ``i mod P``; names in no block follow the class's rules. A name that is not in
        the spec, or in two blocks, raises ValueError."""
        return cls(spec, num_fragments, blocks)

    def _check_p(self, p: int) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_fragments:
            raise ValueError(f"fragment index must be an int in [0, {self.num_fragments}), "
                             f"got {p!r}")
        return p

    def ranges(self, p: int) -> list[tuple[int, int]]:
        """Half-open flat ranges ``(begin, end)`` of fragment p, sorted and merged."""
        return list(self._ranges[self._check_p(p)])

    def numel(self, p: int) -> int:
        """Number of fp32 elements in fragment p (the size of its gathered tensor)."""
        return self._numels[self._check_p(p)]

    def names(self, p: int) -> list[str]:
        """Names of the parameters in fragment p, in spec order (zero-sized ones included)."""
        return list(self._names[self._check_p(p)])

    def of_block(self, i: int) -> int:
        """Fragment of block i (``i mod P``)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_blocks:
            raise ValueError(f"block index must be an int in [0, {self.num_blocks}), got {i!r}")
        return i % self.num_fragments

    def _check_flat(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.spec.numel:
            raise ValueError(f"flat must be 1-D with {self.spec.numel} elements, got shape "
                             f"{tuple(flat.shape)}")

    def gather(self, flat: torch.Tensor, p: int) -> torch.Tensor:
        """A new 1-D tensor with fragment p's elements of ``flat``, concatenated in range order.

        One copy (``torch.cat`` of views); the result never aliases ``flat``, so the caller may
        step or send it while ``flat`` keeps training.
        """
        self._check_flat(flat)
        return torch.cat([flat[b:e] for b, e in self._ranges[self._check_p(p)]])

    def scatter_(self, flat: torch.Tensor, p: int, values: torch.Tensor) -> torch.Tensor:
        """Inverse of `gather`: write ``values`` into fragment p's ranges of ``flat`` (in place).

        Returns ``flat``. Elements outside fragment p are untouched.
        """
        self._check_flat(flat)
        p = self._check_p(p)
        if values.dim() != 1 or values.numel() != self._numels[p]:
            raise ValueError(f"values must be 1-D with {self._numels[p]} elements for fragment "
                             f"{p}, got shape {tuple(values.shape)}")
        with torch.no_grad():
            pos = 0
            for b, e in self._ranges[p]:
                flat[b:e].copy_(values[pos:pos + e - b])
                pos += e - b
        return flat

    def __repr__(self) -> str:
        return (f"Fragments(num_fragments={self.num_fragments}, num_blocks={self.num_blocks}, "
                f"numels={self._numels})")


def fragment_spec(fragments: Fragments, p: int) -> ParamSpec:
    """The `ParamSpec` of fragment p alone: its parameters in spec order, laid out back to back.

    That is exactly the layout of `Fragments.gather` (ranges in offset order = spec order;
    zero-sized parameters are named but hold nothing), so a gathered fragment encodes and decodes
    with `fl_geo.runtime.wire` like a small model, and the decoded pieces' offsets index the gathered
    tensor. With P = 1 it equals the full spec.
    """
    spec = fragments.spec
    keep = set(fragments.names(p))
    idx = [i for i, name in enumerate(spec.names) if name in keep]
    return ParamSpec(tuple(spec.names[i] for i in idx), tuple(spec.shapes[i] for i in idx),
                     tuple(spec.dtypes[i] for i in idx))


def fragment_record(p: int) -> str:
    """Name of the ArrayRecord that carries fragment p in a message (``frag_<p>``): the new
    global fragment server → worker, the pseudo-gradient Δ_p worker → server."""
    return f"frag_{int(p)}"


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


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


def fixed_schedule(P: int, H: int, tau: int) -> list[tuple[int, int, int]]:
    """torchft-style round-robin: ``(p, start, apply)`` per fragment, steps within one period.

    Fragment p starts its sync at (p+1)·H/P − τ and applies the result at (p+1)·H/P, so the
    syncs are spread evenly over H and fragment P − 1 applies at H, where plain DiLoCo would
    sync. P must divide H (torchft's requirement, keeping every offset an integer step) and
    0 ≤ τ < H/P, so a fragment's sync never starts before the previous one was applied.
    """
    P = _check_int("P", P, 1)
    H = _check_int("H", H, 1)
    tau = _check_int("tau", tau, 0)
    if H % P:
        raise ValueError(f"P ({P}) must divide H ({H})")
    step = H // P
    if tau >= step:
        raise ValueError(f"tau must be < H/P = {step}, got {tau}")
    return [(p, (p + 1) * step - tau, (p + 1) * step) for p in range(P)]


class FixedSchedule:
    """The fixed round-robin schedule (`fixed_schedule`) as the loop asks it, over global steps.

    Steps count from 1 across periods of H; the schedule repeats every period. ``starts_at(t)``
    lists the fragments whose sync starts when global step ``t`` ends; ``next_start_after(t)`` is
    the first step after ``t`` at which any sync starts (the loop dispatches work up to it).
    """

    def __init__(self, P: int, H: int, tau: int) -> None:
        self.H = _check_int("H", H, 1)
        self._starts: dict[int, list[int]] = {}  # step within a period (1..H) -> fragments
        for p, start, _ in fixed_schedule(P, H, tau):
            self._starts.setdefault(start, []).append(p)

    def starts_at(self, step: int) -> list[int]:
        """Fragments whose sync starts at global step ``step`` (>= 1)."""
        offset = step - self.H * ((step - 1) // self.H)  # in 1..H
        return list(self._starts.get(offset, []))

    def next_start_after(self, step: int) -> int:
        """The first global step after ``step`` (>= 0) at which a sync starts."""
        base = self.H * (step // self.H)
        return min(b + s for b in (base, base + self.H) for s in self._starts if b + s > step)


def _exact(x: float) -> Fraction:
    """``x`` as the decimal it prints as (0.29 → 29/100), so floors of products of config values
    are not off by one from binary rounding (the float 0.29·100 is 28.999999999999996)."""
    return Fraction(repr(float(x)))


class AdaptiveSchedule:
    """CoCoDC's adaptive fragment selection (Algorithm 2, docs/algorithms.md §7), decided by the
    server alone and told to the workers.

    Bookkeeping per fragment p: t_{p,b}, the step at which p's last sync *completed* (0 at the
    start), and ‖Δ̄_p‖₂ of that sync. At step t the interval is I_p = t − t_{p,b} and the change
    rate R_p = ‖Δ̄_p‖₂ / I_p. `choose` returns the lowest-index idle fragment with I_p ≥ H
    (nothing may go stale for more than a period), else the idle fragment with the largest R_p.

    Conventions (where the paper leaves a gap):

    * R_p = ∞ until p's first sync completes (the paper's initial priority), whatever I_p is;
      ties, ∞ included, go to the lowest index, so the first P choices are 0, 1, …, P−1.
    * I_p = 0 after a first sync (p completed at this very step): R_p = −∞, i.e. ranked below
      every real rate but still eligible. Dividing by zero would make the fragment just synced
      the most urgent one although it has had no training since; skipping it entirely could
      leave `choose` with nothing to return although a fragment is idle.
    * Fragments in ``in_flight`` are skipped in both rules; None only if all are in flight.
    """

    def __init__(self, num_fragments: int, H: int, gamma: float = 0.4) -> None:
        self.num_fragments = _check_int("num_fragments", num_fragments, 1)
        self.H = _check_int("H", H, 1)
        self.gamma = self._check_gamma(gamma)
        self._last_completed = [0] * self.num_fragments
        self._last_norm: list[float | None] = [None] * self.num_fragments

    @staticmethod
    def _check_gamma(gamma: Any) -> float:
        gamma = float(gamma)
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        return gamma

    # -- capacity (Eqs. 9-10) -------------------------------------------------------------

    def syncs_per_period(self, t_c: float, t_s: float) -> int:
        """N = max(P, ⌊γ·H·T_c/T_s⌋): fragment syncs that fit into H inner steps (Eq. 9).

        Following the paper (§III-B): ``t_c`` is the time of one local *computation* step and
        ``t_s`` the time of one fragment *synchronisation*, so H·T_c/T_s syncs could run back
        to back during one period and γ keeps headroom for network variability. N ≥ P keeps
        every fragment synced at least once per period. The floor is taken on the exact
        decimal values (see `_exact`).
        """
        for name, value in (("t_c", t_c), ("t_s", t_s)):
            if not (math.isfinite(float(value)) and float(value) > 0.0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        capacity = _exact(self.gamma) * self.H * _exact(t_c) / _exact(t_s)
        return max(self.num_fragments, math.floor(capacity))

    def interval(self, t_c: float, t_s: float) -> int:
        """h = max(1, ⌊H/N⌋) inner steps between sync starts (Eq. 10; at least one step)."""
        return max(1, self.H // self.syncs_per_period(t_c, t_s))

    # -- selection (Eqs. 11-12, Algorithm 2) ----------------------------------------------

    def _check_p(self, p: Any) -> int:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_fragments:
            raise ValueError(f"fragment index must be an int in [0, {self.num_fragments}), "
                             f"got {p!r}")
        return p

    def rates(self, t_now: int) -> list[float]:
        """R_p at step ``t_now`` for every fragment, with the ∞ / −∞ conventions of the class."""
        t_now = _check_int("t_now", t_now, 0)
        if t_now < max(self._last_completed):
            raise ValueError(f"t_now {t_now} is before a completed sync "
                             f"(step {max(self._last_completed)})")
        out = []
        for t_b, norm in zip(self._last_completed, self._last_norm, strict=True):
            interval = t_now - t_b
            if norm is None:
                out.append(math.inf)
            elif interval == 0:
                out.append(-math.inf)
            else:
                out.append(norm / interval)
        return out

    def choose(self, t_now: int, in_flight: set[int] | frozenset[int]) -> int | None:
        """The fragment to start syncing at step ``t_now``, or None if all are in flight."""
        rates = self.rates(t_now)
        busy = {self._check_p(p) for p in in_flight}
        idle = [p for p in range(self.num_fragments) if p not in busy]
        if not idle:
            return None
        for p in idle:  # ascending: the lowest-index stale fragment
            if t_now - self._last_completed[p] >= self.H:
                return p
        return max(idle, key=lambda p: (rates[p], -p))

    def completed(self, p: int, t_now: int, mean_delta_norm: float) -> None:
        """Record that fragment p's sync completed at step ``t_now`` with ‖Δ̄_p‖₂."""
        p = self._check_p(p)
        t_now = _check_int("t_now", t_now, 0)
        if t_now < self._last_completed[p]:
            raise ValueError(f"fragment {p} completed at {self._last_completed[p]}, cannot "
                             f"complete again at earlier step {t_now}")
        norm = float(mean_delta_norm)
        if not (math.isfinite(norm) and norm >= 0.0):
            raise ValueError(f"mean_delta_norm must be finite and >= 0, got {norm}")
        self._last_completed[p] = t_now
        self._last_norm[p] = norm

    def last_completed(self, p: int) -> int:
        """t_{p,b}: step of fragment p's last completed sync (0 before the first)."""
        return self._last_completed[self._check_p(p)]

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (JSON-serialisable); ``last_norm`` is None before a first sync."""
        return {
            "num_fragments": self.num_fragments,
            "H": self.H,
            "gamma": self.gamma,
            "last_completed": list(self._last_completed),
            "last_norm": list(self._last_norm),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (H and γ included), validating everything before changing
        anything; ``num_fragments`` must match, since the fragments themselves are fixed."""
        expected = {"num_fragments", "H", "gamma", "last_completed", "last_norm"}
        if not isinstance(state, dict) or set(state) != expected:
            raise ValueError(f"state must be a dict with keys {sorted(expected)}")
        if state["num_fragments"] != self.num_fragments:
            raise ValueError(f"state is for {state['num_fragments']} fragments, this schedule "
                             f"has {self.num_fragments}")
        H = _check_int("H", state["H"], 1)
        gamma = self._check_gamma(state["gamma"])
        last_completed, last_norm = state["last_completed"], state["last_norm"]
        if (not isinstance(last_completed, (list, tuple)) or not isinstance(last_norm, (list, tuple))
                or len(last_completed) != self.num_fragments
                or len(last_norm) != self.num_fragments):
            raise ValueError(f"last_completed and last_norm must hold {self.num_fragments} "
                             "entries")
        completed = [_check_int("last_completed entry", t, 0) for t in last_completed]
        norms: list[float | None] = []
        for value in last_norm:
            if value is None:
                norms.append(None)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"last_norm entries must be numbers or None, got {value!r}")
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"last_norm entries must be finite and >= 0, got {value}")
            norms.append(float(value))
        self.H, self.gamma = H, gamma
        self._last_completed, self._last_norm = completed, norms
