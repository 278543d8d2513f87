"""On a CUDA device (marker ``gpu``; tests/conftest.py skips them elsewhere, `make gpu-check` runs
them): the inner loop under bf16 autocast, the NCCL data-parallel job, and the Hugging Face presets
(GPT-NeoX and Llama shapes from fl_geo/inner/hf.py, random init, never downloaded) training on CUDA. Heavy imports stay
inside the tests so that collecting this file costs the CPU suite nothing."""

from __future__ import annotations

import pytest
import torch

from fl_geo.core.state import ParamSpec, flatten
from fl_geo.data import BatchSampler, ByteTokenizer
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, InnerTrainer, evaluate_loss

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=4, max_seq_len=64)
TOKENS = torch.from_numpy(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 400))
B, SEQ = 8, 64


def _inner(precision: str = "auto", batch: int = B, device: str = "cuda") -> InnerConfig:
    return InnerConfig(batch_size=batch, seq_len=SEQ, warmup_steps=2, total_steps=40, device=device,
                       precision=precision, lr=3e-3)


def _sampler(batch: int = B) -> BatchSampler:
    return BatchSampler(TOKENS, SEQ, batch, seed=1, stream=0)


def test_bf16_autocast_trains_on_cuda_with_fp32_master_weights():
    trainer = InnerTrainer(build_model(MODEL, 0), _inner("auto"))
    assert trainer.device.type == "cuda" and trainer.amp_dtype is torch.bfloat16
    seen: list[torch.dtype] = []
    handle = trainer.model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    first = trainer.train(_sampler(), 3, 0)
    handle.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)  # the forward ran in bf16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights fp32
    last = trainer.train(_sampler(), 30, 3)
    assert last.final_loss < first.mean_loss - 0.5  # it learns
    # the same steps in fp32 on CUDA land close to the bf16 run (bf16 only perturbs the path)
    reference = InnerTrainer(build_model(MODEL, 0), _inner("fp32"))
    reference.train(_sampler(), 33, 0)
    batches = [_sampler().batch(1000 + i) for i in range(4)]
    bf16_loss = evaluate_loss(trainer.model, batches)
    fp32_loss = evaluate_loss(reference.model, batches)
    assert bf16_loss == pytest.approx(fp32_loss, rel=0.05)


def test_nccl_data_parallel_job_equals_one_process_with_the_whole_batch():
    from fl_geo.inner.distributed import DataParallelTrainer, resolve_devices

    world = min(torch.cuda.device_count(), 2)
    devices, backend = resolve_devices("cuda", world, "nccl")
    assert backend == "nccl" and len(devices) == world
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = InnerTrainer(build_model(MODEL, 0), _inner("fp32", world * B))
    reference.train(_sampler(world * B), 2, 0)  # so a non-empty AdamW state goes in
    spec = ParamSpec.from_state_dict(reference.model.state_dict())
    job = DataParallelTrainer(MODEL, _inner("fp32"), spec, devices, backend, timeout_s=120)
    job.params.copy_(flatten(reference.model.state_dict(), spec).cpu())
    job.load_optimizer_state(reference.optimizer_state())
    expected = reference.train(_sampler(world * B), 5, 2)
    got = job.train(_sampler(B), 5, 2)
    assert got.steps == expected.steps == 5
    assert got.tokens == expected.tokens == world * B * SEQ * 5
    assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-4)
    torch.testing.assert_close(job.params, flatten(reference.model.state_dict(), spec).cpu(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("preset", ["pythia-tiny", "smollm-tiny"])
def test_hf_preset_trains_on_cuda_and_evaluates_as_on_cpu(preset):
    pytest.importorskip("transformers")
    from fl_geo.inner.hf import build_hf_model

    model = build_hf_model(ModelConfig(kind="hf", preset=preset, vocab_size=256, max_seq_len=SEQ), seed=0)
    trainer = InnerTrainer(model, _inner("auto"))
    assert next(trainer.model.parameters()).is_cuda
    first = trainer.train(_sampler(), 3, 0)
    last = trainer.train(_sampler(), 30, 3)
    assert last.final_loss < first.mean_loss - 0.5
    batches = [_sampler().batch(1000 + i) for i in range(2)]
    on_cuda = evaluate_loss(trainer.model, batches)  # fp32 evaluation on the GPU
    on_cpu = evaluate_loss(trainer.model.to("cpu"), batches)
    assert on_cuda == pytest.approx(on_cpu, rel=1e-3)
