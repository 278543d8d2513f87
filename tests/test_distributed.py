"""The data-parallel inner loop (fl_geo.inner.distributed): two gloo ranks with batch b are one process
with batch 2b, a failing rank surfaces in the parent, a time budget stops every rank at the same
step, the ClientApp path and the configuration checks. CPU only; each job spawns two processes
(~2-4 s of start-up on a 2-core machine), so the file keeps to four jobs. The ranks import this
module to find the ``rank_setup`` hooks, so Flower is imported only inside the test that needs it."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import fl_geo.inner.distributed as fdist
from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.data import BatchNoise, BatchSampler, ByteTokenizer
from fl_geo.inner.distributed import (
    DataParallelTrainer,
    DistributedTrainingError,
    resolve_devices,
    train_data_parallel,
)
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, InnerTrainer

TINY = ModelConfig(n_layers=1, d_model=32, n_heads=2, max_seq_len=32)
TOKENS = torch.from_numpy(
    ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 200)
)
B, SEQ = 4, 16  # per-process batch and sequence length
CPU2 = [torch.device("cpu")] * 2
NOISE = BatchNoise(fraction=0.3, kind="random", block=1, vocab_size=256)  # covers noisy rows too


def _inner(batch_size: int = B) -> InnerConfig:
    return InnerConfig(batch_size=batch_size, seq_len=SEQ, warmup_steps=2, total_steps=20, device="cpu")


def _sampler(batch_size: int) -> BatchSampler:
    return BatchSampler(TOKENS, SEQ, batch_size, seed=3, stream=1, noise=NOISE)


def _job() -> DataParallelTrainer:
    model = build_model(TINY, 0)
    spec = ParamSpec.from_state_dict(model.state_dict())
    job = DataParallelTrainer(TINY, _inner(), spec, CPU2, "gloo", timeout_s=60)
    flatten(model.state_dict(), spec, out=job.params)
    return job


def test_two_gloo_ranks_with_batch_b_equal_one_process_with_batch_2b() -> None:
    torch.set_num_threads(1)  # as each rank (threads=1): the printed timings compare like with like
    reference = InnerTrainer(build_model(TINY, 0), _inner(2 * B))
    reference.train(_sampler(2 * B), 2, 0)  # so a non-empty AdamW state goes in
    spec = ParamSpec.from_state_dict(reference.model.state_dict())
    job = DataParallelTrainer(TINY, _inner(), spec, CPU2, "gloo", timeout_s=60)
    flatten(reference.model.state_dict(), spec, out=job.params)
    job.load_optimizer_state(reference.optimizer_state())
    shared_before = job.params.data_ptr()

    t0 = time.perf_counter()
    expected = reference.train(_sampler(2 * B), 5, 2)
    t1 = time.perf_counter()
    got = job.train(_sampler(B), 5, 2)
    t2 = time.perf_counter()
    print(f"\n5 steps: one process, batch {2 * B}: {t1 - t0:.3f} s "
          f"({expected.step_time_s * 1e3:.1f} ms/step); 2 gloo ranks, batch {B} each: "
          f"{t2 - t1:.2f} s with start-up ({got.step_time_s * 1e3:.1f} ms/step)")

    assert got.steps == expected.steps == 5
    assert got.tokens == expected.tokens == 2 * B * SEQ * 5  # total over both ranks
    assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-5)
    assert got.final_loss == pytest.approx(expected.final_loss, rel=1e-5)
    # Rank 0 wrote the result into the same shared buffers the parent filled.
    assert job.params.data_ptr() == shared_before
    torch.testing.assert_close(job.params, flatten(reference.model.state_dict(), spec), rtol=0, atol=1e-6)
    want, have = reference.optimizer_state(), job.optimizer_state()
    assert set(have) == set(want)
    for key, value in want.items():
        if key.endswith(".step"):
            assert float(have[key]) == float(value) == 7.0, key
        else:
            torch.testing.assert_close(have[key], value, rtol=0, atol=1e-7, msg=key)


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("injected failure on rank 1")


def test_the_error_names_the_rank_that_failed_first(tmp_path) -> None:
    """Rank 1 raised; rank 0 then failed in its all-reduce (peer gone) and torch happened to see
    rank 0's exit first: the error must name rank 1, whose error file was written first."""
    from fl_geo.inner.distributed import _first_failure

    files = [str(tmp_path / f"rank{i}.pickle") for i in range(3)]
    for i, (text, ns) in {0: ("Connection closed by peer", 2_000_000_000), 1: ("injected", 1_000_000_000)}.items():
        Path(files[i]).write_bytes(pickle.dumps(text))
        os.utime(files[i], ns=(ns, ns))
    index, message = _first_failure(files, 0, "torch's message")
    assert index == 1 and message.endswith("injected") and "Process 1 terminated" in message
    os.utime(files[0], ns=(1_000_000_000, 1_000_000_000))  # a tie: torch's choice stands
    assert _first_failure(files, 0, "torch's message")[0] == 0
    Path(files[1]).write_bytes(b"not a pickle")  # unreadable files are skipped ...
    assert _first_failure(files, 1, "torch's message")[0] == 0
    # ... and with none readable, torch's choice is kept as it was
    assert _first_failure(files[2:], 2, "torch's message") == (2, "torch's message")


def test_a_failing_rank_raises_in_the_parent_without_hanging() -> None:
    job = _job()
    t0 = time.perf_counter()
    with pytest.raises(DistributedTrainingError, match=r"(?s)rank 1 .*injected failure on rank 1"):
        train_data_parallel(TINY, _inner(), job.shared, _sampler(B), 3, 0, devices=CPU2,
                            backend="gloo", timeout_s=60, rank_setup=_fail_on_rank_1)
    # Rank 0 waits in its first gradient all-reduce for a peer that is gone: the parent ends it
    # instead of waiting for the 60 s process-group timeout.
    assert time.perf_counter() - t0 < 30


def _clock_jumps_on_rank_1(rank: int, world: int) -> None:
    """Rank 1's clock jumps 10^4 s per reading: only rank 1 sees the time budget run out."""
    if rank == 1:
        real, calls = time.perf_counter, itertools.count()
        time.perf_counter = lambda: real() + 1e4 * next(calls)


def test_time_budget_stops_every_rank_at_the_same_step() -> None:
    job = _job()
    # Without the collective stop, rank 0 would go on to step 2 alone and its gradient
    # all-reduce would meet rank 1's metrics all-reduce: an error or a 20 s timeout.
    result = train_data_parallel(TINY, _inner(), job.shared, _sampler(B), 4, 0, devices=CPU2,
                                 backend="gloo", time_budget_s=1000.0, timeout_s=20,
                                 rank_setup=_clock_jumps_on_rank_1)
    assert result.steps == 1 and result.tokens == 2 * B * SEQ
    assert float(job.optimizer_state()["embed.weight.step"]) == 1.0


# ---------------------------------------------------------------- the ClientApp


def test_client_app_node_devices_equal_one_process_with_double_batch(tiny, tmp_path) -> None:
    """Through the real train handler: node config devices=2 with batch 4 vs one process with 8."""
    from fl_geo.clients.datacenter import OPT_STATE_KEY
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    common = ("run.num_clients=1", "run.rounds=1", "strategy.inner_steps=3", "run.eval_every=0")
    runs = {}
    for name, batch, node in (("one", 8, {}), ("two", 4, {"devices": 2})):
        # the operator allows the two-device site its devices (strategy.site_devices, issue 26)
        cfg = tiny(*common, f"client.batch_size={batch}", f"strategy.site_devices={node.get('devices', 0)}")
        grid = InlineGrid(client_app, 1, seed=0, node_configs=[{"partition-id": 0, "num-partitions": 1, **node}])
        summary = run_server(grid, cfg, tmp_path / name)
        final = torch.load(tmp_path / name / "final_model.pt")["params"]
        (context,) = grid.contexts.values()
        runs[name] = (summary, final, context.state.array_records[OPT_STATE_KEY])
    (s1, final1, opt1), (s2, final2, opt2) = runs["one"], runs["two"]
    assert s1["tokens"] == s2["tokens"] == 3 * 8 * 32
    torch.testing.assert_close(final2, final1, rtol=0, atol=1e-6)
    assert list(opt2.keys()) and set(opt2.keys()) == set(opt1.keys())
    for key in opt1:
        torch.testing.assert_close(torch.from_numpy(opt2[key].numpy()), torch.from_numpy(opt1[key].numpy()),
                                   rtol=0, atol=1e-7, msg=key)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["client.devices=0"], "client.devices must be >= 1"),
        (["client.dist_backend=mpi"], "client.dist_backend must be auto, gloo or nccl"),
        (["client.dist_backend=nccl", "client.device=cpu"], "nccl needs CUDA devices"),
        (["client.devices=2", "client.device=mps"], "client.devices > 1 runs on cuda or cpu"),
        (["client.parallel=zero3"], "client.parallel must be ddp or fsdp"),
    ],
)
def test_config_rejects_bad_multidevice_settings(tiny, overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny(*overrides)


def test_config_accepts_multidevice_settings_and_keeps_the_default(tiny) -> None:
    assert tiny().client.devices == 1 and tiny().client.dist_backend == "auto" and tiny().client.parallel == "ddp"
    cfg = tiny("client.devices=4", "client.dist_backend=gloo", "client.parallel=fsdp")
    assert (cfg.client.devices, cfg.client.dist_backend, cfg.client.parallel) == (4, "gloo", "fsdp")


def test_resolve_devices_on_cpu() -> None:
    assert resolve_devices("cpu", 2) == (CPU2, "gloo")
    assert resolve_devices("cpu", 1, "gloo") == ([torch.device("cpu")], "gloo")
    with pytest.raises(ConfigError, match="must be >= 1"):
        resolve_devices("cpu", 0)
    with pytest.raises(ConfigError, match="dist_backend must be one of"):
        resolve_devices("cpu", 2, "mpi")
    with pytest.raises(ConfigError, match="nccl needs CUDA devices"):
        resolve_devices("cpu", 2, "nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_resolve_devices_without_cuda() -> None:
    with pytest.raises(ConfigError, match="nccl needs CUDA devices"):
        resolve_devices("auto", 2, "nccl")
    with pytest.raises(ConfigError, match="'cuda' requested but unavailable"):
        resolve_devices("cuda", 2)


def test_resolve_devices_counts_gpus(monkeypatch) -> None:
    """A pretend machine with two GPUs (the checks read only torch.cuda's answers)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fdist.dist, "is_nccl_available", lambda: True)
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_devices("cuda", 2) == (cuda, "nccl")
    assert resolve_devices("auto", 2, "gloo") == (cuda, "gloo")
    assert resolve_devices("cuda:1, cuda:0", 2) == (cuda[::-1], "nccl")
    with pytest.raises(ConfigError, match="only 2 are visible"):
        resolve_devices("cuda", 4)
    with pytest.raises(ConfigError, match="only 2 are visible"):
        resolve_devices("cuda:1", 2)  # a node's GPUs start at its device index
    with pytest.raises(ConfigError, match="appears twice"):
        resolve_devices("cuda:0,cuda:0", 2)
    with pytest.raises(ConfigError, match="names 2 devices but"):
        resolve_devices("cuda:0,cuda:1", 3)
    with pytest.raises(ConfigError, match="of one kind"):
        resolve_devices("cuda:0,cpu", 2)


def test_shared_state_rejects_a_foreign_optimizer_state() -> None:
    job = _job()
    assert job.optimizer_state() == {}
    trainer = InnerTrainer(build_model(ModelConfig(n_layers=2, d_model=32, n_heads=2), 0), _inner())
    trainer.train(_sampler(B), 1, 0)
    with pytest.raises(ValueError, match="unexpected"):
        job.load_optimizer_state(trainer.optimizer_state())
    assert json.dumps(sorted(job.optimizer_state())) == "[]"  # nothing half-loaded
