"""One site's inner loop as a data-parallel job across its devices (issue 7; docs/multidevice.md).

A datacenter has several accelerators; one process per device with DistributedDataParallel is how
such a site trains a model it can hold on one device. The ClientApp process stays the owner of
everything Flower sees (the message, ``context.state``, the reply): for one message it starts
``world_size`` rank processes (from a fork server, `fl_geo.fork_server`: safe from inside
a Ray actor or a threaded SuperNode, and torch is imported once rather than by every rank),
hands them the model and the inner optimizer state (AdamW's, or Muon's with AdamW's under
``client.optimizer: muon``) through shared-memory tensors, and waits. Rank 0 writes
the trained parameters and optimizer state back into the *same* shared buffers, so the parent
computes the pseudo-gradient Δ = θ_global − θ_local in place exactly as the single-process path
does, with no model-sized copy through pipes or pickles.

Equivalence: rank r trains on rows ``[r·b, (r+1)·b)`` of the batch that the single-process sampler
draws for the same step with batch ``world_size·b``. DDP averages the gradients of the per-rank
mean losses, which is the gradient of the mean loss over the whole batch, so clipping, the LR
schedule and AdamW see what one process with batch ``world_size·b`` would see (up to float
summation order). Loss metrics are averaged over ranks and tokens summed.

This module is the parent side: device and backend checks, starting and joining the ranks, and
:class:`DataParallelTrainer`. The shared-memory buffers live in `fl_geo.inner.distributed_state`
and the rank processes' code in `fl_geo.inner.distributed_rank`; the public names of both are
re-exported here. This module must stay importable without Flower.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from fl_geo.core.state import ParamSpec
from fl_geo.data.loader import BatchSampler
from fl_geo.errors import ConfigError
from fl_geo.fork_server import process_context
from fl_geo.inner.device import pick_device
from fl_geo.inner.distributed_rank import _Job, _rank_main
from fl_geo.inner.distributed_state import (
    ModelFactory,
    SharedStateTrainer,
    SharedTrainState,
    as_factory,
    config_model,
    matrices_of,
    model_spec,
    spec_of,
)
from fl_geo.inner.model import ModelConfig
from fl_geo.inner.training import (
    BatchSource,
    InnerConfig,
    LossFn,
    ScheduleFn,
    TokensFn,
    TrainResult,
    check_train_args,
    lr_at,
)

__all__ = [
    "DIST_BACKENDS",
    "DataParallelTrainer",
    "DistributedTrainingError",
    "ModelFactory",
    "SharedTrainState",
    "as_factory",
    "config_model",
    "model_spec",
    "resolve_devices",
    "spec_of",
    "train_data_parallel",
]

DIST_BACKENDS = ("auto", "gloo", "nccl")  # client.dist_backend
# Process-group timeout: how long a rank waits in a collective (or the rendezvous) for a peer
# that neither answers nor dies. A rank that dies is noticed at once by the parent's join; this
# only bounds a peer that hangs. It must exceed the longest gap between two collectives, i.e. one
# inner step plus the start-up of the slowest rank.
DEFAULT_TIMEOUT_S = 600.0
# Once a rank failed, the others get this long to exit on their own, then SIGTERM, then as long
# again before SIGKILL. Short: a survivor is normally blocked in a collective and never exits
# by itself, and SIGTERM ends a rank at once (no Python handler is installed in it).
_GRACE_S = 1.0


class DistributedTrainingError(RuntimeError):
    """A rank of the data-parallel inner loop failed; the message carries its traceback."""


# ---------------------------------------------------------------- devices and backend


def _parse_devices(device: str, count: int) -> list[torch.device]:
    """The rank devices: an explicit list ``"cuda:0,cuda:2"``, or ``count`` devices from one name.

    ``cuda`` / ``auto`` on a GPU machine give ``cuda:0 … cuda:{count-1}``; ``cuda:k`` starts at
    ``k`` (a node that shares its machine with another may own GPUs 4-7); ``cpu`` repeats the CPU.
    """
    names = [part.strip() for part in str(device).split(",") if part.strip()]
    if len(names) > 1:
        if len(names) != count:
            raise ConfigError(
                f"device list {device!r} names {len(names)} devices but client.devices "
                f"(or node config devices) is {count}"
            )
        return [pick_device(name) for name in names]
    base = pick_device(names[0] if names else "auto")
    if base.type == "cuda":
        first = base.index or 0
        return [torch.device("cuda", first + r) for r in range(count)]
    return [base] * count


def resolve_devices(device: str, count: int, backend: str = "auto") -> tuple[list[torch.device], str]:
    """Check a site's multi-device settings on the machine that runs them; return devices, backend.

    Called by the ClientApp on the site itself, not by config validation: the server that
    validates a run's config may have no GPU at all while its SuperNodes have eight each, so only
    the static part (``fl_geo.config.validate``) can be checked there. Errors name the keys.
    """
    if int(count) < 1:
        raise ConfigError(f"client.devices (or node config devices) must be >= 1, got {count}")
    if backend not in DIST_BACKENDS:
        raise ConfigError(f"client.dist_backend must be one of {DIST_BACKENDS}, got {backend!r}")
    if not dist.is_available():
        raise ConfigError("client.devices > 1 needs torch.distributed, which this torch build lacks")
    try:
        devices = _parse_devices(device, int(count))
    except RuntimeError as exc:  # pick_device: an explicit accelerator that is not there
        raise ConfigError(f"client.device: {exc}") from None
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ConfigError(f"the devices of one site must be of one kind, got {sorted(kinds)}")
    kind = kinds.pop()
    if kind not in ("cuda", "cpu"):
        raise ConfigError(
            f"client.devices > 1 runs on CUDA (nccl or gloo) or CPU (gloo), not on {kind!r}"
        )
    chosen = ("nccl" if kind == "cuda" else "gloo") if backend == "auto" else backend
    if chosen == "nccl" and kind != "cuda":
        raise ConfigError(
            "client.dist_backend=nccl needs CUDA devices, but the site's devices are "
            f"{kind} (torch.cuda.is_available() is {torch.cuda.is_available()}); "
            "use dist_backend gloo or auto"
        )
    if kind == "cuda":
        visible = torch.cuda.device_count()
        indices = [d.index if d.index is not None else 0 for d in devices]
        if max(indices) >= visible:
            raise ConfigError(
                f"client.devices={count} needs CUDA devices {indices}, but only {visible} are "
                f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        if len(set(indices)) != len(indices):
            raise ConfigError(f"a CUDA device appears twice in the site's devices {indices}")
    if chosen == "nccl" and not dist.is_nccl_available():
        raise ConfigError("client.dist_backend=nccl but this torch build has no NCCL; use gloo")
    return devices, chosen



# ---------------------------------------------------------------- the parent side


def _global_sampler(sampler: BatchSource, world: int) -> BatchSource:
    """The single-process sampler with batch ``world · b``: same tokens, seed, stream and noise.

    fl-geo's ``BatchSampler`` only: a user's batch source already yields the site's global batch.
    """
    if not isinstance(sampler, BatchSampler):
        return sampler
    return BatchSampler(
        sampler.tokens,
        sampler.seq_len,
        sampler.batch_size * world,
        seed=sampler.seed,
        stream=sampler.stream,
        noise=sampler.noise,
    )


def train_data_parallel(
    model_cfg: ModelConfig | ModelFactory,
    inner: InnerConfig,
    shared: SharedTrainState,
    sampler: BatchSource,
    steps: int,
    start_step: int,
    *,
    devices: Sequence[torch.device],
    backend: str,
    time_budget_s: float = 0.0,
    threads: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    join_timeout_s: float | None = None,
    rank_setup: Callable[[int, int], None] | None = None,
    loss_fn: LossFn | None = None,
    lr_schedule: ScheduleFn | None = lr_at,
    tokens_fn: TokensFn | None = None,
    parallel: str = "ddp",
) -> TrainResult:
    """Run ``InnerTrainer.train`` as ``len(devices)`` DDP (or, ``parallel="fsdp"``, FSDP2) ranks;
    update ``shared`` in place.

    ``model_cfg`` is fl-geo's decoder config or a picklable factory of a user's model (with
    ``loss_fn`` / ``lr_schedule`` / ``tokens_fn`` as for ``InnerTrainer``; the inner optimizer is
    always the default one of ``inner.optimizer``, AdamW or Muon + AdamW, whose state the shared
    buffers hold: ``shared`` must be allocated with that optimizer's matrices, `matrices_of`). ``sampler`` is fl-geo's
    per-process sampler (batch b), and rank r trains on its slice of the batch the same sampler
    would draw with batch ``len(devices)·b``; a user's source yields the global batch itself. On return ``shared.params`` holds the
    trained parameters and ``shared.optimizer_state()`` the optimizer state, both written by rank 0;
    the result's ``tokens`` is the total over ranks, its losses and step time the rank means.
    ``threads`` is each rank's torch thread count. ``timeout_s`` bounds every collective (a hung
    peer); ``join_timeout_s`` optionally bounds the whole job. ``rank_setup(rank, world)`` runs in
    each rank once the process group is up (per-rank set-up; tests inject failures with it); it
    must be picklable, i.e. a module-level function.

    Raises ``DistributedTrainingError`` (with the failing rank's traceback) when a rank fails or
    the job times out; the other ranks are terminated and ``shared`` must then be considered
    garbage.
    """
    world = len(devices)
    if world < 1:
        raise ValueError("train_data_parallel needs at least one device")
    check_train_args(steps, start_step, time_budget_s)
    global_sampler = _global_sampler(sampler, world)
    # Move the (read-only) token stream into shared memory once, in place: the ranks of this and
    # every later message then map it instead of each receiving a pickled copy.
    if isinstance(global_sampler, BatchSampler):
        global_sampler.tokens.share_memory_()
    shared.result.zero_()  # so a job whose rank 0 never got to write cannot pass for a result
    with tempfile.TemporaryDirectory(prefix="fl_geo_dist_") as tmp:
        job = _Job(
            model_factory=as_factory(model_cfg),
            inner=inner,
            shared=shared,
            sampler=global_sampler,
            steps=int(steps),
            start_step=int(start_step),
            time_budget_s=float(time_budget_s),
            devices=[str(d) for d in devices],
            backend=backend,
            store_path=os.path.join(tmp, "rendezvous"),
            timeout_s=float(timeout_s),
            threads=int(threads),
            rank_setup=rank_setup,
            loss_fn=loss_fn,
            lr_schedule=lr_schedule,
            tokens_fn=tokens_fn,
            parallel=parallel,
            owner_pid=os.getpid(),
        )
        _run_ranks(job, world, join_timeout_s)
    values = shared.result.tolist()
    done = int(values[0])
    if done < 1:
        raise DistributedTrainingError("the ranks exited cleanly but rank 0 wrote no result")
    return TrainResult(
        steps=done,
        tokens=int(values[1]),
        mean_loss=values[2],
        step_time_s=values[3],
        final_loss=values[4],
    )


def _run_ranks(job: _Job, world: int, join_timeout_s: float | None) -> None:
    """Start the ranks and wait; any failure or the deadline ends all of them and raises."""
    method = process_context().get_start_method()  # forkserver: torch imported once, not per rank
    context = mp.start_processes(_rank_main, args=(job,), nprocs=world, join=False, start_method=method)
    deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
    try:
        while not context.join(timeout=1.0, grace_period=_GRACE_S):
            if deadline is not None and time.monotonic() > deadline:
                raise DistributedTrainingError(
                    f"the data-parallel inner loop ({world} ranks, {job.backend}) did not finish "
                    f"within {join_timeout_s:g} s"
                )
    except ProcessException as exc:
        index, message = _first_failure(context.error_files, exc.error_index, str(exc))
        raise DistributedTrainingError(
            f"rank {index} of the data-parallel inner loop ({world} ranks, {job.backend}) failed: {message}"
        ) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(_GRACE_S)
            if process.is_alive():
                with contextlib.suppress(Exception):
                    process.kill()
                    process.join()


def _first_failure(error_files: Sequence[str], index: int, message: str) -> tuple[int, str]:
    """The rank that failed first and its traceback.

    One rank's failure makes its peers fail too, in their next collective ("Connection closed by
    peer"), and torch reports whichever failed exit its ``join`` saw first: the cause or a
    consequence. Each failing rank writes its traceback to its own error file (torch creates
    none for a rank that did not raise), so the file written first names the cause. Falls back
    to torch's choice (``index``, ``message``) when no file can be read.
    """
    written = []
    for i, path in enumerate(error_files):
        try:
            stamp = os.stat(path).st_mtime_ns
            with open(path, "rb") as fh:
                trace = pickle.load(fh)
        except Exception:  # noqa: BLE001 - absent (no raise), or torch changed its format
            continue
        if isinstance(trace, str):
            written.append((stamp, i != index, i, trace))  # a tie goes to torch's choice
    if not written:
        return index, message
    _, _, first, trace = min(written)
    return first, f"\n\n-- Process {first} terminated with the following error:\n{trace}"


class DataParallelTrainer(SharedStateTrainer):
    """``InnerTrainer``'s interface (load state, train, export state) for a data-parallel job.

    Lets the ClientApp's ``train`` handler keep one body for both paths: the handler loads the
    stored optimizer state, trains and exports exactly as with an ``InnerTrainer``, and takes the
    trained parameters from :attr:`params` (shared memory rank 0 wrote) instead of a model.
    Fill :attr:`params` with the global model before :meth:`train`.
    """

    def __init__(
        self,
        model_cfg: ModelConfig | ModelFactory,
        cfg: InnerConfig,
        spec: ParamSpec,
        devices: Sequence[torch.device],
        backend: str,
        threads: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        loss_fn: LossFn | None = None,
        lr_schedule: ScheduleFn | None = lr_at,
        tokens_fn: TokensFn | None = None,
        parallel: str = "ddp",
    ) -> None:
        self.model_cfg = model_cfg
        self.parallel = parallel
        self.loss_fn, self.lr_schedule, self.tokens_fn = loss_fn, lr_schedule, tokens_fn
        self.cfg = cfg
        self.devices = list(devices)
        self.backend = backend
        self.threads = threads
        self.timeout_s = timeout_s
        self.optimizer_kind = cfg.optimizer  # always the default optimizer (InnerTrainer.optimizer_kind)
        # client.optimizer: muon keeps Muon's momentum for the hidden matrices in the shared buffers
        matrices = matrices_of(as_factory(model_cfg)) if cfg.optimizer == "muon" else frozenset()
        self.shared = SharedTrainState.allocate(spec, matrices)


    def train(
        self, sampler: BatchSource, steps: int, start_step: int, time_budget_s: float = 0.0
    ) -> TrainResult:
        """``InnerTrainer.train`` with ``sampler``'s batch per rank (see :func:`train_data_parallel`)."""
        return train_data_parallel(
            self.model_cfg,
            self.cfg,
            self.shared,
            sampler,
            steps,
            start_step,
            devices=self.devices,
            backend=self.backend,
            time_budget_s=time_budget_s,
            threads=self.threads,
            timeout_s=self.timeout_s,
            loss_fn=self.loss_fn,
            lr_schedule=self.lr_schedule,
            tokens_fn=self.tokens_fn,
            parallel=self.parallel,
        )
