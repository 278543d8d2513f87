"""A model's repeated blocks, and activation checkpointing over them (``client.activation_checkpointing``).

Both FSDP2's units (`fl_geo.inner.fsdp_rank`) and activation checkpointing work per repeated
block: every entry of the model's outermost ``nn.ModuleList`` s (fl-geo's decoder ``blocks``, a
Hugging Face model's ``layers``, a user's list of layers). One rule, here, so that a model's
checkpointed blocks are its FSDP units.

Activation checkpointing keeps only each block's inputs during the forward pass and recomputes
the block's forward during backward: the activations held for backward drop from every
intermediate tensor of every block to one tensor per block, for about one extra forward pass of
compute. It is what lets a long sequence or a large batch fit a device (torchtitan and
prime-diloco enable it per block the same way). The gradients are the same: the recomputation
replays the same operations on the same inputs (``torch.utils.checkpoint`` without reentrancy
restores the RNG state, so dropout, if any, draws the same mask).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["block_lists", "set_activation_checkpointing"]

_ORIGINAL = "_fl_geo_forward"  # the block's own forward, kept while it is checkpointed


def block_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The outermost ``nn.ModuleList`` s of the model (a list inside a listed block is part of that block)."""
    found: list[torch.nn.ModuleList] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for backward anyway
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> int:
    """Checkpoint (or stop checkpointing) every block of `block_lists`; returns how many blocks.

    The block's module stays what it is (same parameters, names and state dict, FSDP units and
    DDP hooks untouched): only its ``forward`` is routed through ``torch.utils.checkpoint`` as an
    instance attribute, so ``module(...)`` still runs the module's hooks, and the recomputation
    runs inside the hooks' window (FSDP2 has gathered the unit's parameters for its backward by
    then). Idempotent, and reversible, for a persistent rank that keeps its model across jobs.
    """
    count = 0
    for blocks in block_lists(model):
        for block in blocks:
            original = block.__dict__.get(_ORIGINAL)
            if enabled and original is None:
                setattr(block, _ORIGINAL, block.forward)
                block.forward = functools.partial(_checkpointed, block.forward)
            elif not enabled and original is not None:
                del block.__dict__["forward"]
                del block.__dict__[_ORIGINAL]
            count += 1
    return count
