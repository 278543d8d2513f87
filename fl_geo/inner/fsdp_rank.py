"""FSDP2 inside a site's ranks (``client.parallel: fsdp``): each rank holds 1/N of the model.

With DDP every rank holds the whole model, its gradients and its AdamW moments; a model that does
not fit one device cannot train. `FsdpRankTrainer` shards it with FSDP2 (``fully_shard``): each
repeated block (every entry of the model's ``nn.ModuleList`` s: fl-geo's decoder ``blocks``, a
Hugging Face model's ``layers``) is one unit, the rest of the model (embeddings, final norm, a tied
head) the root unit. Parameters, gradients and AdamW moments are then dim-0 shards (DTensors) of
the full tensors; a unit's full parameters exist only while it runs forward or backward. On an
accelerator with bf16 precision the units compute in bf16 and reduce gradients in fp32
(``MixedPrecisionPolicy``); the fp32 master parameters and moments stay sharded.

The site's contract is unchanged (`SharedTrainState`: full fp32 parameters and moments in the
flat layout): every rank loads its rows of the full tensors from the shared buffers
(`FsdpRankTrainer.load_params`, `load_optimizer_state`), and after training all ranks gather the
full tensors (a collective) while rank 0 writes them back (`store_into`). So the pseudo-gradient
is assembled from the shards for the wire, and the node's ``context.state`` holds the same records
as with DDP. The arithmetic is DDP's: the gradient of the mean loss over the global batch, the
same clip, the same AdamW step; only float summation order differs (the gradient norm is summed
over shards).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fl_geo.core.state import ParamSpec, unflatten
from fl_geo.inner.blocks import block_lists
from fl_geo.inner.device import autocast_dtype, pick_device
from fl_geo.inner.distributed_state import SharedTrainState
from fl_geo.inner.training import InnerConfig, InnerTrainer

__all__ = ["FsdpRankTrainer", "shard_model"]


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> None:
    """``fully_shard`` each listed block, then the root; ``compute_dtype`` (bf16) for mixed precision."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype is not None else MixedPrecisionPolicy()
    for blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _local_rows(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's dim-0 rows of ``full`` as FSDP2 lays them out (``torch.chunk`` over the ranks;
    a rank past the last chunk holds none)."""
    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    chunks = torch.chunk(full, world, dim=0)
    local = chunks[rank] if rank < len(chunks) else full[:0]
    if tuple(local.shape) != tuple(like.to_local().shape):
        raise RuntimeError(f"FSDP shard of shape {tuple(like.to_local().shape)} on rank {rank}, but rows "
                           f"{tuple(local.shape)} of the full tensor {tuple(full.shape)}")
    return local


class FsdpRankTrainer(InnerTrainer):
    """``InnerTrainer`` over an FSDP2-sharded model; the time-budget stop is collective (as DDP's)."""

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, **options: Any) -> None:
        if not isinstance(model, FSDPModule):  # a persistent rank's model is sharded once
            device = pick_device(cfg.device)
            shard_model(model.to(device), autocast_dtype(device, cfg.precision))
        super().__init__(model, cfg, **options)
        self._flag = torch.zeros(1, device=self.device)
        self._params = dict(self.model.named_parameters())

    def _stop(self, budget_reached: bool) -> bool:
        self._flag.fill_(1.0 if budget_reached else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item() > 0)

    def load_params(self, flat: torch.Tensor, spec: ParamSpec) -> None:
        """Copy this rank's rows of the full parameters in ``flat`` into its shards."""
        full = unflatten(flat, spec)
        with torch.no_grad():
            for name, param in self._params.items():
                param.to_local().copy_(_local_rows(full[name], param))

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        """`InnerTrainer.load_optimizer_state` from full moments: each becomes this rank's shard."""
        sharded: dict[str, torch.Tensor] = {}
        for key, value in flat.items():
            name, _, field = key.rpartition(".")
            param = self._params.get(name)
            if field in ("exp_avg", "exp_avg_sq") and param is not None and tuple(value.shape) == tuple(param.shape):
                local = _local_rows(value, param).to(param.device, param.dtype)
                value = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            sharded[key] = value
        super().load_optimizer_state(sharded)

    def store_into(self, shared: SharedTrainState, writer: bool) -> None:
        """Gather the full parameters and moments (every rank must call: collectives); the
        ``writer`` (rank 0) writes them into ``shared`` in the flat layout."""
        spec = shared.spec
        views = {"params": unflatten(shared.params, spec), "exp_avg": unflatten(shared.exp_avg, spec),
                 "exp_avg_sq": unflatten(shared.exp_avg_sq, spec)}
        with torch.no_grad():
            for name in spec.names:
                param = self._params[name]
                full = param.full_tensor()
                if writer:
                    views["params"][name].copy_(full)
                state = self.optimizer.state[param]
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = state[key].full_tensor()
                    if writer:
                        views[key][name].copy_(moment)
                if writer:
                    shared.steps[spec.index(name)] = float(torch.as_tensor(state["step"]))
        if writer:
            shared.has_moments.fill_(1)
