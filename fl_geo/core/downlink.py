"""The compressed downlink: a server's "public model" x̂ and the compressed deltas that move it.

Every site trains from the model it *received*, so the server keeps one model-sized buffer x̂,
the public model: what every up-to-date site holds, and a version that counts its changes. When
the server's model x has moved since x̂ was last advanced (`PublicModel.advance`, once per change
of x, however many sites are then sent work):

    P = C(x − x̂),    x̂ ← g(x̂ + D(P)),    version += 1,

with C / D a `fl_geo.core.compress.Compressor` (the ``wire.compress_down`` codec, its own error
feedback off) and g the rounding to the ``wire.down`` grid (identity for fp32; bf16 / fp16 round
to nearest even). A site that holds x̂ at the version P starts from applies the same
g(x̂ + D(P)) and holds the new x̂ bit for bit: the decode is elementwise (the inverse DCT a matrix
product) and both ends run it on the CPU in fp32. Error feedback is implicit: what a payload did
not carry stays in x − x̂ and goes out with a later one; nothing else is kept.

Why x̂ lives on the ``wire.down`` grid: a site whose held version is not the one a delta starts
from (a new or rejoining site, one that missed versions, every site after a server resume) gets
x̂ itself, whole, in ``wire.down`` precision. g(x̂) = x̂, so that site then holds exactly what a
site that followed the deltas holds, and every site of a version trains from the same point.

Sites that are behind by a few versions get the chain of the deltas they missed rather than the
whole model while the chain is cheaper: the last payloads are kept while their bytes sum to less
than one whole model at ``wire.down`` (`PublicModel.plan`), so the history never costs more than
one more model's wire bytes, and a chain that would cost more than the model is never sent.

Framework-free (torch only): the strategies wrap it (`fl_geo.strategies.downlink`) and a site
applies deltas with `apply_delta` (`fl_geo.clients.downlink`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from fl_geo.core.compress import Compressor, Payload

__all__ = ["DeltaStep", "PublicModel", "apply_delta", "max_chain", "on_grid"]

_GRID = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def on_grid(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` (fp32) rounded to the values a ``precision`` wire carries exactly, as fp32 (a new tensor
    for bf16 / fp16, ``x`` itself for fp32)."""
    if precision not in _GRID:
        raise ValueError(f"unknown wire precision {precision!r}; expected one of {sorted(_GRID)}")
    dtype = _GRID[precision]
    return x if dtype is None else x.to(dtype).to(torch.float32)


def apply_delta(base: torch.Tensor, delta_hat: torch.Tensor, precision: str) -> torch.Tensor:
    """g(x̂ + D(P)): the public model after one delta, as a new fp32 tensor (both ends call this)."""
    return on_grid(base + delta_hat, precision)


def max_chain(delta_nbytes: int, full_nbytes: int) -> int:
    """The most deltas of ``delta_nbytes`` each that a `PublicModel` of ``full_nbytes`` keeps (the
    last payloads while their bytes sum below one whole model): the longest chain it sends."""
    return max(0, math.ceil(full_nbytes / delta_nbytes) - 1) if delta_nbytes > 0 else 0


@dataclass(frozen=True)
class DeltaStep:
    """One advance of x̂: the payload that takes version ``version − 1`` to ``version``."""

    version: int
    payload: Payload
    nbytes: int


class PublicModel:
    """x̂, its version, and the deltas of the last versions (bounded by one model's wire bytes).

    ``params``: x̂ (fp32, 1-D, on the ``precision`` grid). ``version`` starts at 0 with x̂ = g(x_0)
    (what an uncompressed downlink would deliver, so the first round is the same either way).
    ``full_nbytes``: the bytes of a whole model at ``precision`` (the history's budget).
    """

    def __init__(self, compressor: Compressor, x0: torch.Tensor, precision: str, full_nbytes: int) -> None:
        if compressor.settings.error_feedback:
            raise ValueError("the downlink's error feedback is x − x̂ itself: build its compressor with it off")
        self.compressor = compressor
        self.precision = precision
        self.full_nbytes = int(full_nbytes)
        self.params = on_grid(x0.detach().to(torch.float32).clone(), precision).clone()
        self.version = 0
        self.history: deque[DeltaStep] = deque()

    @property
    def numel(self) -> int:
        return self.params.numel()

    def advance(self, x: torch.Tensor) -> DeltaStep:
        """Move x̂ towards ``x`` by one compressed delta; call once per change of x. A non-finite
        x (or x̂) raises ValueError from the compressor and leaves everything as it was."""
        payload, _ = self.compressor.compress(x.detach().to(torch.float32) - self.params)
        delta_hat = self.compressor.decompress(payload, numel=self.numel)
        new = apply_delta(self.params, delta_hat, self.precision)
        if not bool(torch.isfinite(new).all()):
            raise ValueError(f"the public model leaves the {self.precision} range; nothing changed")
        self.params = new
        self.version += 1
        step = DeltaStep(self.version, payload, payload.nbytes)
        self.history.append(step)
        while self.history and sum(s.nbytes for s in self.history) >= self.full_nbytes:
            self.history.popleft()
        return step

    def plan(self, held: int | None) -> list[DeltaStep] | None:
        """What a site holding version ``held`` (None: nothing, or unknown) is sent: ``[]`` when it
        is up to date, the deltas from ``held`` to `version` in order when they are all kept (so
        their bytes sum below one whole model), else None: the whole x̂."""
        if held is None or held > self.version or held < 0:
            return None
        if held == self.version:
            return []
        chain = [s for s in self.history if s.version > held]
        if len(chain) != self.version - held:
            return None  # an older delta was dropped: the chain would cost more than the model
        return chain

    def state_dict(self) -> dict[str, object]:
        """x̂ and its version (the history is not kept: after a resume every site gets x̂ whole)."""
        return {"params": self.params.clone(), "version": self.version}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore a `state_dict` (ValueError, nothing changed, when it does not fit)."""
        params, version = state.get("params"), state.get("version")
        if not isinstance(params, torch.Tensor) or params.dtype != torch.float32 or params.shape != self.params.shape:
            raise ValueError(f"downlink public model must be fp32 of {self.numel} elements")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"downlink public model version must be an int >= 0, got {version!r}")
        if not bool(torch.isfinite(params).all()) or not torch.equal(on_grid(params, self.precision), params):
            raise ValueError(f"downlink public model is not finite or not on the {self.precision} grid")
        self.params, self.version = params.clone(), version
        self.history.clear()
