"""One rank of a persistent site group: joins the process group once, then trains job after job.

The site-group daemon (`fl_geo.clients.site_daemon`) starts ``world`` of these with
:func:`rank_loop` and hands each job to every rank as pickled bytes over its pipe. A rank keeps
what is expensive to set up for its whole life: the process (its imports, CUDA context), the
process group, the model on its device and its DDP replica. What a round depends on is loaded
afresh from the site's shared files for every job: the parameters and the AdamW state the
coordinator wrote from the message and ``context.state``. So the group holds no state of its own
that could disagree with the node's records: a resumed server that resends a round, or a
rewound inner state, trains exactly as the spawn-per-message path would.

A job that fails in a rank (an exception, or a peer that died) is answered with the traceback
and the rank exits: a process group with a dead or desynchronised member cannot be reused, so
the daemon ends the group and starts a fresh one for the next job.

A site of several nodes (`GroupSetup.rendezvous`): node 0's ranks are the daemon's, the other
nodes' ranks are started by each node's agent (`fl_geo.clients.site_node`); all join one process
group through the site's TCP store (`fl_geo.inner.site_store`) and read their jobs from it. Only
node 0 has the state files: at the start of every job rank 0 broadcasts θ and the optimizer
state to every rank, and at the end writes the trained state into the files as on one node.
Importable without Flower.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import pickle
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from fl_geo.core.state import ParamSpec
from fl_geo.fork_server import die_with
from fl_geo.inner.distributed import _global_sampler
from fl_geo.inner.distributed_rank import (
    _RankBatches,
    _train_and_store,
    join_process_group,
    load_params,
    rank_trainer,
)
from fl_geo.inner.distributed_state import ModelFactory, SharedTrainState
from fl_geo.inner.site_setup import GroupSetup
from fl_geo.inner.training import (
    BatchSource,
    InnerConfig,
    InnerTrainer,
    LossFn,
    ScheduleFn,
    TokensFn,
    lr_at,
)

__all__ = ["GroupJob", "GroupSetup", "rank_loop"]


@dataclass
class GroupJob:
    """One train message for the group; pickled by the coordinator, forwarded unread by the daemon.

    The data travel as ``sampler`` (a small source, pickled as is) or as ``batches``, a picklable
    factory every rank calls for the per-process source (the ClientApp's ``batches_fn(site)``:
    a partition is data-sized, so it is rebuilt in the ranks, where fl-geo's corpus loaders
    memoise it across jobs). Rank r trains on its rows of the global batch, as in the spawned job.
    """

    model_factory: ModelFactory
    inner: InnerConfig
    spec: ParamSpec
    state_dir: str
    steps: int
    start_step: int
    time_budget_s: float = 0.0
    threads: int = 1
    sampler: BatchSource | None = None
    batches: Callable[[], BatchSource] | None = None
    rank_setup: Callable[[int, int], None] | None = None
    loss_fn: LossFn | None = None
    lr_schedule: ScheduleFn | None = lr_at
    tokens_fn: TokensFn | None = None
    parallel: str = "ddp"  # client.parallel: ddp | fsdp (fixed for a group's life: part of its identity)

    def source(self) -> BatchSource:
        if (self.sampler is None) == (self.batches is None):
            raise ValueError("a group job carries exactly one of sampler and batches")
        return self.sampler if self.batches is None else self.batches()


def _die_with_owner(owner_pid: int) -> None:
    """SIGKILL this rank when the process that started it dies, however it dies (no orphaned
    ranks holding a device or blocking in a collective until its timeout). A rank started by
    ``spawn`` is its owner's child (``PR_SET_PDEATHSIG``); one forked by the fork server is the
    server's, which outlives a SIGKILLed owner, so it watches the owner itself (a pidfd)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call above took effect
            os._exit(1)
    if owner_pid:
        die_with(owner_pid, name="fl-geo-rank-owner-watch")


class _Resident:
    """What a rank keeps between jobs: the mapped files, the model and its trainer."""

    def __init__(self, rank: int, world: int, device: torch.device, has_files: bool = True,
                 several_nodes: bool = False) -> None:
        self.rank, self.world, self.device, self.has_files = rank, world, device, has_files
        self.several_nodes = several_nodes  # only node 0 has the files: rank 0 broadcasts the state
        self.shared: SharedTrainState | None = None
        self.files: tuple[str, ParamSpec] | None = None
        self.model: torch.nn.Module | None = None
        self.trainer: InnerTrainer | None = None
        self.parallel = "ddp"
        self.settings: tuple | None = None

    def run(self, job: GroupJob) -> None:
        torch.set_num_threads(job.threads)
        if job.rank_setup is not None:
            job.rank_setup(self.rank, self.world)
        if self.files != (job.state_dir, job.spec):
            # A node without the files (a multi-node site's nodes 1..) keeps private buffers of the
            # same layout, filled by rank 0's broadcast below.
            self.shared = SharedTrainState.map_files(job.spec, job.state_dir) if self.has_files \
                else SharedTrainState.allocate(job.spec)
            self.files = (job.state_dir, job.spec)
        shared = self.shared
        assert shared is not None
        if self.several_nodes:
            _broadcast_state(shared, self.device)
        if self.model is None:
            with torch.device(self.device):  # values come from the shared parameters below
                self.model = job.model_factory()
            self.parallel = job.parallel
        if job.parallel != self.parallel:  # the model is wrapped or sharded for good
            raise RuntimeError(f"this group trains with parallel={self.parallel}, the job asks for {job.parallel}")
        cfg = replace(job.inner, device=str(self.device))
        settings = (cfg, job.loss_fn, job.lr_schedule, job.tokens_fn)
        if self.trainer is None or settings != self.settings:  # a new optimizer, the same replica / shards
            self.trainer = rank_trainer(job.parallel, self.model, cfg, replica=getattr(self.trainer, "replica", None),
                                        loss_fn=job.loss_fn, lr_schedule=job.lr_schedule, tokens_fn=job.tokens_fn)
            self.settings = settings
            if set(self.trainer.param_names) != set(shared.spec.names):
                raise RuntimeError("the model's parameters and its state dict differ; cannot share state")
        load_params(self.trainer, shared)
        # The node's records are the truth: the state of every job is loaded (empty = fresh AdamW).
        self.trainer.load_optimizer_state(shared.optimizer_state() if int(shared.has_moments[0]) else {})
        batches = _RankBatches(_global_sampler(job.source(), self.world), self.rank, self.world)
        _train_and_store(self.trainer, shared, batches, job.steps, job.start_step, job.time_budget_s,
                         self.rank, self.world)


def _broadcast_state(shared: SharedTrainState, device: torch.device) -> None:
    """θ, the optimizer state and its presence flag from rank 0 (which read them from the files) to
    every rank, through the rank's device (NCCL broadcasts device tensors only)."""
    for buffer in (shared.params, shared.exp_avg, shared.exp_avg_sq, shared.steps, shared.has_moments):
        staged = buffer.to(device)
        dist.broadcast(staged, src=0)
        if staged.data_ptr() != buffer.data_ptr():
            buffer.copy_(staged)


def _peak_memory(device: torch.device) -> dict[str, float]:
    """This rank's peak memory so far, in MiB: resident set (Linux reports KiB) and, on CUDA,
    the most the caching allocator held for tensors (``fl-geo bench site`` prints both)."""
    peak = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        peak["peak_device_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return peak


def _join(local_rank: int, setup: GroupSetup) -> tuple[torch.device, Any]:
    """Join this generation's process group; returns the rank's device and, on a node without the
    daemon (a multi-node site's nodes 1..), the store it reads its jobs from."""
    store = None
    if setup.rendezvous:
        from fl_geo.inner.site_store import connect

        store = connect(setup.rendezvous, setup.timeout_s)
    device = join_process_group(local_rank, setup.devices, setup.backend, setup.store_path, setup.timeout_s,
                                setup.threads, rank_offset=setup.rank_offset, world=setup.world_size,
                                store=None if store is None else dist.PrefixStore(f"{setup.generation}/pg", store))
    return device, store


def rank_loop(rank: int, setup: GroupSetup, conn: Connection | None) -> None:
    """Body of one persistent rank: join the group, then answer jobs until told to stop.

    ``rank``: the rank's index on its node (its global rank adds ``setup.rank_offset``). A job is
    pickled `GroupJob` bytes, read from ``conn`` (the daemon's pipe) or, where ``conn`` is None (a
    node of a multi-node site other than node 0), from the site's store (`StoreJobs`); the answer
    is JSON ``{"ok": true, <peak memory>}`` or ``{"error": tb}``.
    Empty bytes or a closed pipe end the loop. After an error the rank exits at once (status 1)
    without leaving the process group: its peers may be blocked in a collective with it.
    """
    _die_with_owner(setup.owner_pid)
    device, store = _join(rank, setup)
    if conn is None:
        from fl_geo.inner.site_store import StoreJobs

        conn = StoreJobs(store, setup.generation, setup.rank_offset + rank)  # type: ignore[assignment]
    assert conn is not None
    resident = _Resident(setup.rank_offset + rank, setup.world_size, device, setup.has_files,
                         several_nodes=bool(setup.rendezvous))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:
            break
        try:
            resident.run(pickle.loads(data))
        except BaseException:  # noqa: BLE001 - every failure is reported, then the rank is gone
            with contextlib.suppress(Exception):  # the daemon may have closed the pipe already
                conn.send_bytes(json.dumps({"error": traceback.format_exc()}).encode())
            os._exit(1)
        conn.send_bytes(json.dumps({"ok": True, **_peak_memory(device)}).encode())
    resident.trainer = None  # the DDP reducer must be gone before its process group (distributed_rank)
    gc.collect()
    dist.destroy_process_group()

