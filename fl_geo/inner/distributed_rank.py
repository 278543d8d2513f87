"""The body of one rank process of the data-parallel job: rendezvous, DDP training, results.

`fl_geo.inner.distributed` spawns one process per device with :func:`_rank_main` and a pickled
:class:`_Job`. Each rank joins the process group, builds its replica from the shared parameters,
trains on its rows ``[rank·b, (rank+1)·b)`` of the global batch (:class:`_RankBatches`) through
DDP, and rank 0 writes the trained state and the rank-averaged metrics into the
`SharedTrainState`. This is the code that runs inside the children, kept apart from the
parent's launching, joining and error handling. It must stay importable without Flower: every
rank process imports it.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fl_geo.core.state import load_flat_into
from fl_geo.fork_server import die_with
from fl_geo.inner.distributed_state import ModelFactory, SharedTrainState
from fl_geo.inner.training import (
    BatchSource,
    InnerConfig,
    InnerTrainer,
    LossFn,
    ScheduleFn,
    TokensFn,
    lr_at,
)

__all__: list[str] = []


def _rows(obj: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of a batch part: a tensor, or tuples / lists / dicts of tensors."""
    if isinstance(obj, torch.Tensor):
        return obj[lo:hi]
    if isinstance(obj, tuple | list):
        return type(obj)(_rows(o, lo, hi) for o in obj)
    if isinstance(obj, Mapping):
        return {k: _rows(v, lo, hi) for k, v in obj.items()}
    raise TypeError(f"cannot split a batch part of type {type(obj).__name__} across ranks")


def _num_rows(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return int(obj.shape[0])
    if isinstance(obj, tuple | list) and obj:
        return _num_rows(obj[0])
    if isinstance(obj, Mapping) and obj:
        return _num_rows(next(iter(obj.values())))
    raise TypeError(f"cannot split a batch part of type {type(obj).__name__} across ranks")


class _RankBatches:
    """Rank ``rank``'s rows ``[rank·b, (rank+1)·b)`` of the global batch of ``world·b`` rows.

    Every rank draws the whole global batch (a gather of window indices, negligible next to a
    step) so the data is exactly what one process with batch ``world·b`` would see, noise
    included, and stays a pure function of ``(seed, stream, step)``. A user's batch source
    yields the global batch itself, whose rows must divide evenly among the ranks.
    """

    def __init__(self, sampler: BatchSource, rank: int, world: int) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world = world

    def batch(self, step: int) -> tuple[Any, Any]:
        x, y = self.sampler.batch(step)
        rows = _num_rows(y)
        if rows % self.world:
            raise ValueError(f"a batch of {rows} rows cannot be split evenly across {self.world} ranks")
        b = rows // self.world
        lo = self.rank * b
        return _rows(x, lo, lo + b), _rows(y, lo, lo + b)


def _ddp_options() -> dict[str, bool]:
    """DDP flags that skip work this job never needs, spelled for the installed torch.

    No buffer broadcasts: the only buffers are the RoPE tables, derived from the config. No init
    sync: every rank loaded the same shared parameters. Gradients as bucket views: the gradient
    all-reduce works on the gradients themselves instead of a second model-sized copy per step.
    """
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    options = {"gradient_as_bucket_view": True}
    if "forward_sync_buffers" in names:  # torch >= 2.13 (broadcast_buffers is deprecated there)
        options["forward_sync_buffers"] = False
    else:
        options["broadcast_buffers"] = False
    if "init_sync" in names:
        options["init_sync"] = False
    return options


class _RankTrainer(InnerTrainer):
    """``InnerTrainer`` whose forward/backward go through DDP and whose time budget is collective.

    Gradients stay allocated between steps (zeroed, not freed): with ``gradient_as_bucket_view``
    they are the all-reduce buckets, and freeing them would bring back a copy per step.
    """

    zero_grad_to_none = False

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, *,
                 replica: DistributedDataParallel | None = None, **options: Any) -> None:
        super().__init__(model, cfg, **options)
        device_ids = [self.device] if self.device.type == "cuda" else None
        # A persistent rank (fl_geo.inner.site_rank) passes the replica it keeps: one DDP wrapper
        # (and reducer) per model for the life of the process, whatever the job's settings.
        self.replica = replica or DistributedDataParallel(self.model, device_ids=device_ids, **_ddp_options())
        self.forward_module = self.replica  # forward (and so backward) through DDP
        self._flag = torch.zeros(1, device=self.device)

    def _stop(self, budget_reached: bool) -> bool:
        # Stop when any rank's clock crossed the budget: every rank then leaves after this step.
        self._flag.fill_(1.0 if budget_reached else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item() > 0)


@dataclass
class _Job:
    """Everything a rank needs; pickled once per rank (shared tensors travel as handles)."""

    model_factory: ModelFactory
    inner: InnerConfig
    shared: SharedTrainState
    sampler: BatchSource  # the global batch: world · b rows
    steps: int
    start_step: int
    time_budget_s: float
    devices: list[str]
    backend: str
    store_path: str
    timeout_s: float
    threads: int
    rank_setup: Callable[[int, int], None] | None
    loss_fn: LossFn | None = None
    lr_schedule: ScheduleFn | None = lr_at
    tokens_fn: TokensFn | None = None
    parallel: str = "ddp"  # client.parallel: ddp | fsdp
    # The process that started the ranks (a ClientApp): a rank ends when it does, also mid-collective
    # (its parent is the fork server, which outlives it: fl_geo.fork_server.die_with).
    owner_pid: int = 0


def rank_trainer(parallel: str, model: torch.nn.Module, cfg: InnerConfig, replica: Any = None,
                 **options: Any) -> InnerTrainer:
    """The rank trainer of ``parallel``: DDP over a whole replica, or FSDP2 over shards
    (`fl_geo.inner.fsdp_rank`; imported only then). ``replica``: a persistent rank's DDP wrapper."""
    if parallel == "fsdp":
        from fl_geo.inner.fsdp_rank import FsdpRankTrainer

        return FsdpRankTrainer(model, cfg, **options)
    if parallel != "ddp":
        raise ValueError(f"client.parallel must be ddp or fsdp, got {parallel!r}")
    return _RankTrainer(model, cfg, replica=replica, **options)


def load_params(trainer: InnerTrainer, shared: SharedTrainState) -> None:
    """The shared parameters into the rank's model: its shards (FSDP) or the whole replica (DDP)."""
    load = getattr(trainer, "load_params", None)
    if load is not None:
        load(shared.params, shared.spec)
    else:
        load_flat_into(trainer.model, shared.params, shared.spec)


def join_process_group(rank: int, devices: Sequence[str], backend: str, store_path: str, timeout_s: float,
                       threads: int, *, store: dist.Store | None = None, rank_offset: int = 0,
                       world: int = 0) -> torch.device:
    """Set this rank's threads and device and join the job's process group; returns the rank's device.

    ``rank`` indexes ``devices`` (this process's device). One machine: a file store at
    ``store_path``, one rank per entry of ``devices``. A site of several nodes
    (`fl_geo.inner.site_rank`): ``store`` (the site's TCP store, under this generation's prefix),
    global rank ``rank_offset + rank`` of ``world``. Shared by the ranks spawned per message and a
    site group's resident ranks."""
    torch.set_num_threads(threads)
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init: dict[str, Any] = {"store": store} if store is not None else {"init_method": f"file://{store_path}"}
    dist.init_process_group(
        backend,
        rank=rank_offset + rank,
        world_size=world or len(devices),
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **init,
    )
    return device


def _rank_main(rank: int, job: _Job) -> None:
    """Body of one rank process (``torch.multiprocessing`` calls it with the rank first)."""
    world = len(job.devices)
    if job.owner_pid:
        die_with(job.owner_pid, name="fl-geo-rank-owner-watch")
    device = join_process_group(rank, job.devices, job.backend, job.store_path, job.timeout_s, job.threads)
    if job.rank_setup is not None:
        job.rank_setup(rank, world)
    _train_rank(rank, world, device, job)
    # The DDP reducer must be gone before its process group: one that outlives it leaves a gloo
    # thread behind that aborts the interpreter at exit (SIGABRT, "terminate called without an
    # active exception"; about one run in five with torch 2.13 before this collect).
    gc.collect()
    dist.destroy_process_group()


def _train_rank(rank: int, world: int, device: torch.device, job: _Job) -> None:
    """Train this rank's replica; rank 0 then writes the results into the shared buffers."""
    shared = job.shared
    with torch.device(device):  # built on its device: no host copy to move there
        model = job.model_factory()  # its random init is overwritten by the shared parameters
    trainer = rank_trainer(job.parallel, model, replace(job.inner, device=str(device)), loss_fn=job.loss_fn,
                           lr_schedule=job.lr_schedule, tokens_fn=job.tokens_fn)
    if set(trainer.param_names) != set(shared.spec.names):
        raise RuntimeError("the model's parameters and its state dict differ; cannot share state")
    if trainer.matrix_names != shared.matrices:
        raise RuntimeError("this rank's Muon matrices differ from the job's; cannot share state")
    load_params(trainer, shared)
    if int(shared.has_moments[0]):
        trainer.load_optimizer_state(shared.optimizer_state())
    _train_and_store(trainer, shared, _RankBatches(job.sampler, rank, world), job.steps, job.start_step,
                     job.time_budget_s, rank, world)


def _train_and_store(trainer: InnerTrainer, shared: SharedTrainState, batches: _RankBatches, steps: int,
                     start_step: int, time_budget_s: float, rank: int, world: int) -> None:
    """Train the loaded replica; rank 0 writes the trained state and the rank-averaged metrics
    into ``shared`` (the spawned job and the persistent site group share this end of a job)."""
    result = trainer.train(batches, steps, start_step, time_budget_s)
    totals = torch.tensor(
        [result.steps, result.tokens, result.mean_loss, result.step_time_s, result.final_loss],
        dtype=torch.float64,
        device=trainer._flag.device,  # type: ignore[attr-defined]
    )
    dist.all_reduce(totals)  # sums; steps and losses are averaged below
    totals = totals.cpu()
    if totals[0] != result.steps * world:
        raise RuntimeError(f"ranks took different numbers of steps (rank {rank}: {result.steps})")
    store_into = getattr(trainer, "store_into", None)  # FSDP: every rank gathers, rank 0 writes
    if store_into is not None:
        store_into(shared, rank == 0)
    elif rank == 0:
        shared._store_from(trainer)
    if rank == 0:
        shared.result.copy_(
            torch.stack([totals[0] / world, totals[1], totals[2] / world, totals[3] / world,
                         totals[4] / world])
        )
