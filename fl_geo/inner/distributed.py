"""One site's inner loop as a data-parallel job across its devices (issue 7; docs/multidevice.md).

A datacenter has several accelerators; one process per device with DistributedDataParallel is how
such a site trains a model it can hold on one device. The ClientApp process stays the owner of
everything Flower sees (the message, ``context.state``, the reply): for one message it starts
``world_size`` rank processes (``spawn``: safe from inside a Ray actor or a threaded SuperNode),
hands them the model and the AdamW state through shared-memory tensors, and waits. Rank 0 writes
the trained parameters and optimizer state back into the *same* shared buffers, so the parent
computes the pseudo-gradient Δ = θ_global − θ_local in place exactly as the single-process path
does, with no model-sized copy through pipes or pickles.

Equivalence: rank r trains on rows ``[r·b, (r+1)·b)`` of the batch that the single-process sampler
draws for the same step with batch ``world_size·b``. DDP averages the gradients of the per-rank
mean losses, which is the gradient of the mean loss over the whole batch, so clipping, the LR
schedule and AdamW see what one process with batch ``world_size·b`` would see (up to float
summation order). Loss metrics are averaged over ranks and tokens summed.

This module must stay importable without Flower: the rank processes import it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from fl_geo.core.state import ParamSpec, flatten, load_flat_into, unflatten
from fl_geo.data.loader import BatchSampler
from fl_geo.errors import ConfigError
from fl_geo.inner.device import pick_device
from fl_geo.inner.model import Decoder, ModelConfig
from fl_geo.inner.training import (
    STATE_KEYS,
    BatchSource,
    InnerConfig,
    InnerTrainer,
    LossFn,
    ScheduleFn,
    TokensFn,
    TrainResult,
    check_train_args,
    lr_at,
)

# Builds the site's model (its initial values are overwritten by the shared parameters). Must be
# picklable (a module-level function or a functools.partial of one): the ranks are spawned.
ModelFactory = Callable[[], torch.nn.Module]

__all__ = [
    "DIST_BACKENDS",
    "DataParallelTrainer",
    "DistributedTrainingError",
    "SharedTrainState",
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
# Result slots rank 0 writes for the parent: steps, tokens, mean loss, step time, final loss.
_RESULT_FIELDS = 5


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


# ---------------------------------------------------------------- shared buffers


def model_spec(model_cfg: ModelConfig) -> ParamSpec:
    """The flat layout of the model, from a parameter-less (``meta``) instance.

    The parent of a data-parallel job needs the layout, not a model: building a real one there
    would allocate and initialise a model-sized copy that nobody trains.
    """
    return spec_of(functools.partial(config_model, model_cfg))


def spec_of(factory: ModelFactory) -> ParamSpec:
    """The flat layout of ``factory()``'s model, built on the ``meta`` device when it allows it
    (no memory, no random draws), else for real with the global RNG state preserved."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = factory()
        except Exception:  # noqa: BLE001 - a model that cannot be built on meta: build it for real
            model = factory()
    return ParamSpec.from_state_dict(model.state_dict())


def config_model(model_cfg: ModelConfig) -> torch.nn.Module:
    """The model of a ``model`` section, initial values unspecified (the job's shared buffer
    overwrites them): fl-geo's decoder, or a Hugging Face model for ``kind: hf``."""
    if model_cfg.kind == "hf":
        from fl_geo.inner.hf import build_hf_model

        return build_hf_model(model_cfg, 0)
    return Decoder(model_cfg)


def as_factory(model: ModelConfig | ModelFactory) -> ModelFactory:
    """A ModelFactory for a ``model`` section (`config_model`) or a user's factory (returned as is)."""
    return functools.partial(config_model, model) if isinstance(model, ModelConfig) else model



@dataclass
class SharedTrainState:
    """Model and AdamW state in shared memory: written by the parent, trained by rank 0.

    ``params`` holds θ in the flat ``spec`` layout (the global model on the way in, the trained
    local model on the way out). The moments use the same layout, so an entry's optimizer state
    sits at its parameter's offset; ``steps`` holds one AdamW step count per ``spec`` entry.
    ``has_moments`` is 0 until the first step (an empty state, as ``InnerTrainer`` exports it).
    """

    spec: ParamSpec
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    has_moments: torch.Tensor
    result: torch.Tensor

    @classmethod
    def allocate(cls, spec: ParamSpec) -> SharedTrainState:
        """Fresh (uninitialised) shared buffers; ``params`` must be filled by the caller."""

        def shared(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(n, dtype=dtype).share_memory_()

        return cls(
            spec=spec,
            params=shared(spec.numel),
            exp_avg=shared(spec.numel),
            exp_avg_sq=shared(spec.numel),
            steps=shared(len(spec.names)),
            has_moments=shared(1, torch.uint8).zero_(),
            result=shared(_RESULT_FIELDS, torch.float64).zero_(),
        )

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """``InnerTrainer.optimizer_state`` layout, as *views* of the shared buffers (no copy).

        Empty before the first step. Callers that keep the dict beyond the buffers' next use
        must copy (a Flower ``Array`` built from it does).
        """
        if not int(self.has_moments[0]):
            return {}
        flat: dict[str, torch.Tensor] = {}
        avg, avg_sq = unflatten(self.exp_avg, self.spec), unflatten(self.exp_avg_sq, self.spec)
        for index, name in enumerate(self.spec.names):
            flat[f"{name}.exp_avg"] = avg[name]
            flat[f"{name}.exp_avg_sq"] = avg_sq[name]
            flat[f"{name}.step"] = self.steps[index]
        return flat

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Copy an ``InnerTrainer.optimizer_state()`` dict in; empty means no state yet.

        Validated like ``InnerTrainer.load_optimizer_state`` so that a stale state from another
        model fails here, in the parent, rather than in every rank.
        """
        if not flat:
            self.has_moments.zero_()
            return
        expected = {f"{name}.{key}" for name in self.spec.names for key in STATE_KEYS}
        if set(flat) != expected:
            missing = sorted(expected - set(flat))[:5]
            extra = sorted(set(flat) - expected)[:5]
            raise ValueError(
                f"optimizer state does not match the model: missing {missing}, unexpected {extra}"
            )
        for name, shape in zip(self.spec.names, self.spec.shapes, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(flat[f"{name}.{key}"].shape) != shape:
                    raise ValueError(
                        f"optimizer state {name}.{key} has shape "
                        f"{tuple(flat[f'{name}.{key}'].shape)}, parameter has {shape}"
                    )
        avg, avg_sq = unflatten(self.exp_avg, self.spec), unflatten(self.exp_avg_sq, self.spec)
        with torch.no_grad():
            for index, name in enumerate(self.spec.names):
                avg[name].copy_(flat[f"{name}.exp_avg"])
                avg_sq[name].copy_(flat[f"{name}.exp_avg_sq"])
                self.steps[index] = float(torch.as_tensor(flat[f"{name}.step"]).reshape(()))
        self.has_moments.fill_(1)

    def _store_from(self, trainer: InnerTrainer) -> None:
        """Rank 0: copy the trained parameters and AdamW state into the buffers (device → host)."""
        flatten(trainer.model.state_dict(), self.spec, out=self.params)
        views = {
            "exp_avg": unflatten(self.exp_avg, self.spec),
            "exp_avg_sq": unflatten(self.exp_avg_sq, self.spec),
        }
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for name, param in zip(trainer.param_names, params, strict=True):
                state = trainer.optimizer.state[param]
                for key, view in views.items():
                    view[name].copy_(state[key])
                self.steps[self.spec.index(name)] = float(torch.as_tensor(state["step"]))
        self.has_moments.fill_(1)


# ---------------------------------------------------------------- the rank processes


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

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, **options: Any) -> None:
        super().__init__(model, cfg, **options)
        device_ids = [self.device] if self.device.type == "cuda" else None
        self.replica = DistributedDataParallel(self.model, device_ids=device_ids, **_ddp_options())
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


def _rank_main(rank: int, job: _Job) -> None:
    """Body of one rank process (``torch.multiprocessing`` calls it with the rank first)."""
    world = len(job.devices)
    torch.set_num_threads(job.threads)
    device = torch.device(job.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        job.backend,
        init_method=f"file://{job.store_path}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
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
    load_flat_into(model, shared.params, shared.spec)
    trainer = _RankTrainer(model, replace(job.inner, device=str(device)), loss_fn=job.loss_fn,
                           lr_schedule=job.lr_schedule, tokens_fn=job.tokens_fn)
    if set(trainer.param_names) != set(shared.spec.names):
        raise RuntimeError("the model's parameters and its state dict differ; cannot share state")
    if int(shared.has_moments[0]):
        trainer.load_optimizer_state(shared.optimizer_state())
    result = trainer.train(
        _RankBatches(job.sampler, rank, world), job.steps, job.start_step, job.time_budget_s
    )
    totals = torch.tensor(
        [result.steps, result.tokens, result.mean_loss, result.step_time_s, result.final_loss],
        dtype=torch.float64,
        device=trainer._flag.device,
    )
    dist.all_reduce(totals)  # sums; steps and losses are averaged below
    totals = totals.cpu()
    if totals[0] != result.steps * world:
        raise RuntimeError(f"ranks took different numbers of steps (rank {rank}: {result.steps})")
    if rank == 0:
        shared._store_from(trainer)
        shared.result.copy_(
            torch.stack([totals[0] / world, totals[1], totals[2] / world, totals[3] / world,
                         totals[4] / world])
        )


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
) -> TrainResult:
    """Run ``InnerTrainer.train`` as ``len(devices)`` DDP ranks; update ``shared`` in place.

    ``model_cfg`` is fl-geo's decoder config or a picklable factory of a user's model (with
    ``loss_fn`` / ``lr_schedule`` / ``tokens_fn`` as for ``InnerTrainer``; the inner optimizer is
    always the default AdamW, whose state the shared buffers hold). ``sampler`` is fl-geo's
    per-process sampler (batch b), and rank r trains on its slice of the batch the same sampler
    would draw with batch ``len(devices)·b``; a user's source yields the global batch itself. On return ``shared.params`` holds the
    trained parameters and ``shared.optimizer_state()`` the AdamW state, both written by rank 0;
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
    context = mp.start_processes(
        _rank_main, args=(job,), nprocs=world, join=False, start_method="spawn"
    )
    deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
    try:
        while not context.join(timeout=1.0, grace_period=_GRACE_S):
            if deadline is not None and time.monotonic() > deadline:
                raise DistributedTrainingError(
                    f"the data-parallel inner loop ({world} ranks, {job.backend}) did not finish "
                    f"within {join_timeout_s:g} s"
                )
    except ProcessException as exc:
        raise DistributedTrainingError(
            f"rank {exc.error_index} of the data-parallel inner loop ({world} ranks, "
            f"{job.backend}) failed: {exc}"
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


class DataParallelTrainer:
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
    ) -> None:
        self.model_cfg = model_cfg
        self.loss_fn, self.lr_schedule, self.tokens_fn = loss_fn, lr_schedule, tokens_fn
        self.cfg = cfg
        self.devices = list(devices)
        self.backend = backend
        self.threads = threads
        self.timeout_s = timeout_s
        self.shared = SharedTrainState.allocate(spec)

    @property
    def params(self) -> torch.Tensor:
        """θ as a flat shared buffer: the global model before :meth:`train`, the local after."""
        return self.shared.params

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        self.shared.load_optimizer_state(flat)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.shared.optimizer_state()

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
        )
