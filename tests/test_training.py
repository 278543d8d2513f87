"""The datacenter inner loop: schedule, AdamW groups, state round trip, devices, convergence."""

from __future__ import annotations

import math
import time

import pytest
import torch
from flwr.app import ArrayRecord

from fl_geo.data import BatchSampler, ByteTokenizer, eval_batches, get_corpus, get_partitions
from fl_geo.inner.device import autocast_dtype, pick_device
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, InnerTrainer, lr_at

TINY = ModelConfig(n_layers=1, d_model=32, n_heads=2, max_seq_len=32)
TOKENS = torch.from_numpy(
    ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 200)
)


def _trainer(seed: int = 0, **overrides: object) -> InnerTrainer:
    cfg = InnerConfig(
        batch_size=4, seq_len=16, warmup_steps=2, total_steps=20, device="cpu", **overrides
    )
    return InnerTrainer(build_model(TINY, seed), cfg)


def _sampler() -> BatchSampler:
    return BatchSampler(TOKENS, seq_len=16, batch_size=4, seed=0)


# ---------------------------------------------------------------- schedule


def test_lr_schedule_values() -> None:
    cfg = InnerConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(4, cfg) == pytest.approx(0.5)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(35, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert lr_at(10_000, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values[:-1], values[1:], strict=True))


def test_lr_schedule_without_warmup() -> None:
    cfg = InnerConfig(lr=2.0, warmup_steps=0, total_steps=100)
    assert lr_at(0, cfg) == pytest.approx(2.0)
    assert lr_at(100, cfg) == pytest.approx(0.2)


# ---------------------------------------------------------------- optimizer set-up


def test_weight_decay_only_on_matrices() -> None:
    trainer = _trainer()
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(
        p.ndim == 1 for p in no_decay["params"]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8


def test_train_reports_tokens_losses_and_time() -> None:
    trainer = _trainer()
    result = trainer.train(_sampler(), steps=3, start_step=5)
    assert result.steps == 3 and result.tokens == 3 * 4 * 16
    assert math.isfinite(result.mean_loss) and math.isfinite(result.final_loss)
    assert result.step_time_s > 0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(7, trainer.cfg))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        trainer.train(_sampler(), steps=0, start_step=0)


def test_training_continues_data_order_from_start_step() -> None:
    # Two rounds of 2 steps equal one round of 4 steps: batch index = start_step + i.
    split, whole = _trainer(), _trainer()
    split.train(_sampler(), 2, 0)
    split.train(_sampler(), 2, 2)
    whole.train(_sampler(), 4, 0)
    for a, b in zip(split.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- optimizer state


def test_optimizer_state_round_trip_continues_identically() -> None:
    original = _trainer()
    assert original.optimizer_state() == {}
    original.train(_sampler(), steps=3, start_step=0)
    state = original.optimizer_state()
    assert len(state) == 3 * len(list(original.model.parameters()))
    assert state["embed.weight.step"].item() == 3.0
    assert (
        state["embed.weight.exp_avg"].shape == (256, 32)
        and state["embed.weight.exp_avg"].device.type == "cpu"
    )
    weights = {k: v.clone() for k, v in original.model.state_dict().items()}

    restored = _trainer(seed=123)  # different init: everything must come from the saved state
    restored.model.load_state_dict(weights)
    # Through the Flower container the client stores it in between rounds.
    restored.load_optimizer_state(ArrayRecord(state).to_torch_state_dict())
    original.train(_sampler(), steps=1, start_step=3)
    restored.train(_sampler(), steps=1, start_step=3)
    for (name, a), b in zip(
        original.model.named_parameters(), restored.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    # The exported state is a copy, not a view of the live optimizer state.
    assert state["embed.weight.step"].item() == 3.0


def test_load_optimizer_state_validates() -> None:
    trainer = _trainer()
    trainer.train(_sampler(), 1, 0)
    state = trainer.optimizer_state()
    missing = dict(state)
    missing.pop("norm.weight.exp_avg")
    with pytest.raises(ValueError, match=r"missing \['norm.weight.exp_avg'\]"):
        trainer.load_optimizer_state(missing)
    wrong = dict(state)
    wrong["norm.weight.exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match="norm.weight.exp_avg has shape \\(7,\\)"):
        trainer.load_optimizer_state(wrong)
    other = InnerTrainer(
        build_model(ModelConfig(n_layers=2, d_model=32, n_heads=2), 0), trainer.cfg
    )
    with pytest.raises(ValueError, match="unexpected"):
        other.load_optimizer_state(state)
    trainer.load_optimizer_state({})  # reset
    assert trainer.optimizer_state() == {}


def test_evaluate_is_deterministic_and_restores_mode() -> None:
    trainer = _trainer()
    batches = eval_batches(TOKENS, seq_len=16, batch_size=8, max_batches=2)
    trainer.model.train()
    first = trainer.evaluate(batches)
    assert trainer.model.training
    assert first == trainer.evaluate(batches)
    assert first == pytest.approx(math.log(256), abs=0.3)
    with pytest.raises(ValueError, match="no batches"):
        trainer.evaluate([])


def test_bf16_autocast_trains_on_cpu_when_forced() -> None:
    trainer = _trainer(precision="bf16")
    assert trainer.amp_dtype == torch.bfloat16
    result = trainer.train(_sampler(), steps=2, start_step=0)
    assert math.isfinite(result.final_loss)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


# ---------------------------------------------------------------- devices


def test_pick_device() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto").type in {"cpu", "npu", "mps"}
        with pytest.raises(RuntimeError, match="'cuda' requested but unavailable"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        pick_device("tpu")


def test_autocast_dtype() -> None:
    assert autocast_dtype(torch.device("cpu"), "auto") is None
    assert autocast_dtype("cpu", "bf16") is torch.bfloat16
    assert autocast_dtype("cpu", "fp32") is None
    assert autocast_dtype("mps", "auto") is torch.bfloat16
    assert autocast_dtype("cuda", "fp32") is None
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        autocast_dtype("cpu", "fp8")


# ---------------------------------------------------------------- convergence


@pytest.mark.slow(seconds=16)
def test_inner_loop_converges_on_real_text() -> None:
    """0.43 M-parameter decoder on corpus `auto` (Bible if fetched, else stdlib): ≈ ln 256 → < 2.9 in
    60 steps, below what the training text's byte frequencies alone score on the Bible's held-out text
    (3.07 nats/byte), so it has learned context; 2.73 there. (It was 120 steps to < 2.5: half the suite time, the same check.)
    One intra-op thread, as every test (tests/conftest.py): two made it ~5 s faster alone but cost
    ~2 CPU-s more (14.3 against 12.2 for the 60 steps), and the same 2.736 to the last printed digit."""
    partitions, global_val = get_partitions("auto", 1, "by_group", val_fraction=0.05, seed=0)
    corpus = get_corpus("auto")
    cfg = InnerConfig(
        lr=6e-3, warmup_steps=10, total_steps=60, batch_size=16, seq_len=128, device="cpu"
    )
    trainer = InnerTrainer(build_model(ModelConfig(), seed=0), cfg)
    val = eval_batches(global_val, seq_len=128, batch_size=16, max_batches=8)
    sampler = BatchSampler(partitions[0].train, seq_len=128, batch_size=16, seed=0)

    initial = trainer.evaluate(val)
    started = time.perf_counter()
    result = trainer.train(sampler, steps=60, start_step=0)
    final = trainer.evaluate(val)
    elapsed = time.perf_counter() - started
    print(
        f"\nconvergence on {corpus.name} ({corpus.sha256[:12]}): val {initial:.3f} → {final:.3f} nats/byte "
        f"in {elapsed:.1f} s ({result.steps} steps, {result.tokens / elapsed / 1e3:.1f}k tok/s)"
    )
    # Code repeats bytes (indentation) so often that the tied embedding's built-in "copy the
    # current byte" logit already beats uniform at init; prose starts at ln 256.
    tolerance = 0.3 if corpus.name == "bible" else 0.45
    assert initial == pytest.approx(math.log(256), abs=tolerance)
    assert final < 2.9
    # No time bound here: speed lives in benchmarks (a loaded machine made a 60 s bound flaky).
