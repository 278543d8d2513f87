"""The sharded leader's follower backends (fl_geo/ps/backend.py) without a grid or a process.

The end-to-end runs are in test_sharded_loop.py (in process) and test_sharded_grpc.py (processes);
here the in-process backend's interface is driven directly, and both backends' checkpoint parts
are checked to refuse each other's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.core.state import ParamSpec
from fl_geo.ps.backend import InProcessBackend, ProcessBackend, follower_backend
from fl_geo.ps.settings import PsSection

SPEC = ParamSpec(("embed.w", "blocks.0.w", "blocks.1.w"), ((8, 4), (16,), (24,)), ("float32",) * 3)


def _optimizer(numel: int):
    return build_outer_optimizer("nesterov", numel, lr=0.7, momentum=0.8)


def _no_run_dir():
    raise AssertionError("an in-process backend needs no run directory")


def _local(params: torch.Tensor) -> InProcessBackend:
    backend = follower_backend(ShardPlan.build(SPEC, 2), PsSection(followers=2), params, _optimizer, wire="fp32",
                               send="pseudo_grad", torch_threads=1, run_dir=_no_run_dir)
    assert isinstance(backend, InProcessBackend)
    return backend


def _step(backend: InProcessBackend, job: str, seed: int) -> int:
    """One update pushed as the reply's pieces (one per tensor), folded with weight 1, stepped."""
    g = torch.Generator().manual_seed(seed)
    backend.push(job, [(off, torch.randn(n, generator=g)) for off, n in zip(SPEC.offsets, SPEC.numels, strict=True)])
    assert all(f.has(job) for f in backend.followers)
    for f in backend.followers:
        f.fold(job, 1.0)
    for f in backend.followers:
        f.mean_sq_sums(1.0)
    return {f.step() for f in backend.followers}.pop()


def test_in_process_backend_steps_the_leaders_buffer_and_round_trips_its_checkpoint():
    params = torch.linspace(-1, 1, SPEC.numel)
    backend = _local(params)
    assert not backend.data_path and backend.unreachable == () and backend.healthy()
    backend.start(None)
    assert backend.job_config("j0", 0) == {}
    before = params.clone()
    assert _step(backend, "j0", seed=1) == 1
    assert not torch.equal(params, before)  # the followers are views: θ moved in the leader's buffer
    saved = {**copy.deepcopy(backend.model_state(1)), "counters": {"version": 1}}
    at_1 = params.clone()
    _step(backend, "j1", seed=2)
    at_2 = params.clone()
    install = backend.prepare_model_state(saved)
    assert torch.equal(params, at_2)  # validating changes nothing
    install()
    assert torch.equal(params, at_1)
    assert _step(backend, "j1", seed=2) == 2 and torch.equal(params, at_2)  # the outer state came back too
    backend.sync_model(2)
    backend.stop()
    assert torch.equal(params, at_2)


def test_a_checkpoint_of_the_other_transport_is_refused_before_anything_changes(tmp_path):
    params = torch.zeros(SPEC.numel)
    local = _local(params)
    seen = []

    def run_dir():
        seen.append(True)
        return tmp_path

    remote = follower_backend(ShardPlan.build(SPEC, 2), PsSection(followers=2, transport="grpc"), params, _optimizer,
                              wire="fp32", send="pseudo_grad", torch_threads=1, run_dir=run_dir)
    assert isinstance(remote, ProcessBackend) and remote.data_path
    assert seen and remote.workdir == tmp_path / "ps"  # ps.workdir unset: <run dir>/ps
    counters = {"counters": {"version": 3}}
    remote.prepare_model_state({**remote.model_state(3), **counters})()
    with pytest.raises(ValueError, match="not written by a leader of follower processes"):
        remote.prepare_model_state({**local.model_state(3), **counters})
    with pytest.raises(ValueError, match="outer state of 2 in-process followers"):
        local.prepare_model_state({**remote.model_state(3), **counters})
    remote.stop()
