"""The Muon inner optimizer (``client.optimizer: muon``, fl_geo.inner.muon): which parameters Muon
takes, that its steps are torch's Muon and AdamW applied to that partition on the inner schedule,
that its state persists across rounds like AdamW's, the checks of its settings, and a DiLoCo run
that learns with it. Tiny models, CPU, fixed seeds."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fl_geo.clients.persist import (
    OPT_STATE_KEY,
    PREV_OPT_STATE_KEY,
    PROGRESS_KEY,
    opt_from_record,
    opt_record,
    progress_record,
    start_opt_state,
)
from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec
from fl_geo.inner.distributed import SharedTrainState
from fl_geo.inner.hf import CausalLM
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.muon import LR_SCALE, MuonAdamW, hidden_matrices, muon_optimizer
from fl_geo.inner.training import InnerConfig, InnerTrainer, lr_at

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=16)
MUON = {"optimizer": "muon", "warmup_steps": 2, "total_steps": 10, "device": "cpu", "batch_size": 4, "seq_len": 16}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


class _Regression:
    """Step-indexed batches of a fixed regression task for the MLP."""

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        return x, torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3:].sum(1)], dim=1)


class _Tokens:
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
        return ids[:, :-1], ids[:, 1:]


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# ---------------------------------------------------------------- the partition rule

def test_partition_of_the_builtin_decoder_is_its_block_matrices() -> None:
    model = build_model(TINY, 0)
    assert hidden_matrices(model) == [f"blocks.{i}.{m}.weight" for i in range(2)
                                      for m in ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down")]
    # the tied embedding/head and the norm gains go to AdamW
    rest = {n for n, _ in model.named_parameters()} - set(hidden_matrices(model))
    assert rest == {"embed.weight", "norm.weight", *(f"blocks.{i}.{k}_norm.weight" for i in range(2) for k in ("attn", "mlp"))}


def test_partition_of_user_models() -> None:
    # a plain stack: every 2-D weight but the last (the head); biases never
    assert hidden_matrices(_mlp()) == ["0.weight", "2.weight"]

    class TiedLM(nn.Module):  # no get_output_embeddings: the head, tied to the embedding, is registered last
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.hidden = nn.Linear(8, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    assert hidden_matrices(TiedLM()) == ["hidden.weight"]

    class Untied(nn.Module):  # the head named by get_output_embeddings, registered before the blocks
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(8, 50)
            self.embed = nn.Embedding(50, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.pos = nn.Parameter(torch.zeros(1, 16, 8))  # 3-D: AdamW

        def get_output_embeddings(self) -> nn.Module:
            return self.out

    assert hidden_matrices(Untied()) == ["blocks.0.weight", "blocks.1.weight"]
    wrapped = CausalLM(Untied(), cfg=object())  # the wrapped model's get_output_embeddings is read
    assert hidden_matrices(wrapped) == ["blocks.0.weight", "blocks.1.weight"]


def test_muon_optimizer_refuses_a_bad_partition() -> None:
    cfg = InnerConfig(**MUON)
    with pytest.raises(ValueError, match="not parameters"):
        muon_optimizer(_mlp(), cfg, matrices=["nope.weight"])
    with pytest.raises(ValueError, match="0.bias is not 2-D"):
        muon_optimizer(_mlp(), cfg, matrices=["0.bias"])


# ---------------------------------------------------------------- the steps

def test_steps_are_torch_muon_and_adamw_on_the_partition_and_schedule() -> None:
    """Three inner steps (warm-up then cosine, clip binding) equal torch.optim.Muon on the hidden
    matrices and torch.optim.AdamW on the rest, driven by hand; the first momentum is (1 − μ)·g."""
    cfg = InnerConfig(**MUON, grad_clip=0.5)
    trainer = InnerTrainer(_mlp(), cfg, loss_fn=_mse, tokens_fn=lambda x, y: len(y))
    assert isinstance(trainer.optimizer, MuonAdamW)
    model = _mlp()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named["0.weight"], named["2.weight"]], lr=1.0, momentum=cfg.muon_momentum,
                            nesterov=True, ns_steps=cfg.muon_ns_steps, weight_decay=cfg.muon_weight_decay)
    adamw = torch.optim.AdamW([{"params": [named["4.weight"]], "weight_decay": cfg.weight_decay},
                               {"params": [named[n] for n in ("0.bias", "2.bias", "4.bias")], "weight_decay": 0.0}],
                              lr=1.0, betas=cfg.betas, eps=cfg.eps)
    data = _Regression()
    first_grad = None
    for step in range(3):
        for group in muon.param_groups:
            group["lr"] = lr_at(step, cfg) * cfg.muon_lr / cfg.lr
        for group in adamw.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.batch(step)
        model.zero_grad()
        _mse(model(x), y).backward()
        if step == 0:
            first_grad = named["2.weight"].grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if step == 0:
            first_grad *= named["2.weight"].grad.norm() / first_grad.norm()  # the clipped gradient
        muon.step()
        adamw.step()
        trainer.train(data, 1, step)
        if step == 0:
            buf = trainer.optimizer_state()["2.weight.momentum_buffer"]
            torch.testing.assert_close(buf, (1 - cfg.muon_momentum) * first_grad, rtol=1e-6, atol=0)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, named[name]), name
    assert trainer.optimizer.param_groups[0][LR_SCALE] == pytest.approx(cfg.muon_lr / cfg.lr)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(2, cfg) * cfg.muon_lr / cfg.lr)


def test_state_round_trip_two_rounds_equal_one_continuous_run() -> None:
    """Two rounds of two steps, the state through the ArrayRecord the ClientApp keeps, equal four
    steps in one go, bit for bit (the decoder: Muon momentum and AdamW moments both in the state)."""
    cfg = InnerConfig(**MUON)
    continuous = InnerTrainer(build_model(TINY, 0), cfg)
    continuous.train(_Tokens(), 4, 0)

    first = InnerTrainer(build_model(TINY, 0), cfg)
    first.train(_Tokens(), 2, 0)
    record = opt_record(first)
    keys = set(record)
    assert "blocks.0.mlp.down.weight.momentum_buffer" in keys and "embed.weight.exp_avg_sq" in keys
    assert not any(k.startswith("blocks.0.mlp.down.weight.exp_avg") for k in keys)
    second = InnerTrainer(build_model(TINY, 7), cfg)  # another init: everything comes from the state
    second.model.load_state_dict(first.model.state_dict())
    second.load_optimizer_state(opt_from_record(record))
    second.train(_Tokens(), 2, 2)
    for (name, a), b in zip(continuous.model.named_parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    incomplete = opt_from_record(record)
    del incomplete["blocks.1.attn.qkv.weight.momentum_buffer"]
    with pytest.raises(ValueError, match="missing"):
        second.load_optimizer_state(incomplete)


def test_a_state_of_the_other_optimizer_is_dropped_with_a_warning(caplog) -> None:
    adam = InnerTrainer(build_model(TINY, 0), InnerConfig(**{**MUON, "optimizer": "adamw"}))
    adam.train(_Tokens(), 1, 0)
    state = RecordDict()
    state[OPT_STATE_KEY] = opt_record(adam)
    state[PREV_OPT_STATE_KEY] = opt_record(adam)
    state[PROGRESS_KEY] = progress_record(1, 1, adam.optimizer_kind, last_round=1)
    assert start_opt_state(state, "adamw") is state.array_records[OPT_STATE_KEY]
    with caplog.at_level(logging.WARNING, logger="fl_geo"):
        assert start_opt_state(state, "muon") is None
    assert "adamw's but this job's inner optimizer is muon" in caplog.text
    assert OPT_STATE_KEY not in state.array_records and PREV_OPT_STATE_KEY not in state.array_records
    assert int(state.config_records[PROGRESS_KEY]["step"]) == 1  # the schedule position stays
    # a record from before the tag existed is loaded as it is
    state[OPT_STATE_KEY] = ArrayRecord()
    state[PROGRESS_KEY] = ConfigRecord({"step": 1, "rounds": 1})
    assert start_opt_state(state, "muon") is not None


def test_shared_state_of_the_data_parallel_job_holds_muon_momentum() -> None:
    trainer = InnerTrainer(build_model(TINY, 0), InnerConfig(**MUON))
    trainer.train(_Tokens(), 1, 0)
    spec = ParamSpec.from_state_dict(trainer.model.state_dict())
    shared = SharedTrainState.allocate(spec, trainer.matrix_names)
    shared.load_optimizer_state(trainer.optimizer_state())
    got, want = shared.optimizer_state(), trainer.optimizer_state()
    assert set(got) == set(want)
    assert all(torch.equal(got[k].float(), want[k].float()) for k in want)
    adamw_only = SharedTrainState.allocate(spec)  # a job allocated for AdamW refuses Muon's state
    with pytest.raises(ValueError, match="unexpected"):
        adamw_only.load_optimizer_state(want)


# ---------------------------------------------------------------- settings and a run

@pytest.mark.parametrize(("override", "match"), [
    ("client.optimizer=sgd", "client.optimizer 'sgd' is unknown; valid: adamw, muon"),
    ("client.muon_lr=0", "client.muon_lr must be > 0"),
    ("client.muon_momentum=1.0", r"client.muon_momentum must be in \[0, 1\)"),
    ("client.muon_ns_steps=100", "client.muon_ns_steps must be in 1..99"),
    ("client.muon_weight_decay=-0.1", "client.muon_weight_decay must be >= 0"),
    ("client.muon_adjust_lr=rms", "client.muon_adjust_lr 'rms' is unknown"),
    ("client.parallel=fsdp", "client.parallel=fsdp shards AdamW's state only; client.optimizer=muon needs client.parallel=ddp"),
])
def test_bad_settings_are_one_line_errors(tiny, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        tiny("client.optimizer=muon", override)
    assert "\n" not in str(info.value)


def test_ddp_refuses_muon_and_adamw_keeps_its_run_identity(tiny) -> None:
    from fl_geo.config import run_identity

    with pytest.raises(ConfigError, match="strategy ddp steps the inner AdamW at the server"):
        tiny("strategy.name=ddp", "client.optimizer=muon")
    assert not any("muon" in k or k == "client.optimizer" for k in run_identity(tiny()))
    assert run_identity(tiny("client.optimizer=muon"))["client.muon_lr"] == 0.02


def test_diloco_with_the_muon_inner_optimizer_learns(tiny, tmp_path) -> None:
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.runtime.metrics import read_metrics
    from fl_geo.server_app import run_server

    cfg = tiny("run.rounds=3", "strategy.inner_steps=5", "client.optimizer=muon")
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    run_server(grid, cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.1
    for ctx in grid.contexts.values():
        assert ctx.state.config_records[PROGRESS_KEY]["optimizer"] == "muon"
        keys = set(ctx.state.array_records[OPT_STATE_KEY])
        assert "blocks.0.attn.qkv.weight.momentum_buffer" in keys and "embed.weight.exp_avg" in keys


def test_two_gloo_ranks_with_muon_equal_one_process_with_double_batch() -> None:
    """client.devices = 2 with Muon: the job (Muon momentum and AdamW moments in shared memory, a
    non-empty state going in) takes the step of one process with twice the batch. One step: the
    float summation order differs (the all-reduce), and over several steps Muon's bf16
    Newton-Schulz iterations amplify that to ~5e-4 (measured); one step agrees to ~4e-9, against
    ~9e-3 for a step on the wrong batch. One spawn."""
    from fl_geo.core.state import flatten
    from fl_geo.inner.distributed import DataParallelTrainer
    from tests.test_distributed import CPU2, B, _sampler
    from tests.test_distributed import TINY as DP_TINY

    def inner(batch: int) -> InnerConfig:
        return InnerConfig(optimizer="muon", batch_size=batch, seq_len=16, warmup_steps=2, total_steps=20, device="cpu")

    torch.set_num_threads(1)
    reference = InnerTrainer(build_model(DP_TINY, 0), inner(2 * B))
    reference.train(_sampler(2 * B), 2, 0)
    spec = ParamSpec.from_state_dict(reference.model.state_dict())
    job = DataParallelTrainer(DP_TINY, inner(B), spec, CPU2, "gloo", timeout_s=60)
    assert job.shared.matrices == reference.matrix_names != frozenset()
    flatten(reference.model.state_dict(), spec, out=job.params)
    job.load_optimizer_state(reference.optimizer_state())
    reference.train(_sampler(2 * B), 1, 2)
    job.train(_sampler(B), 1, 2)
    torch.testing.assert_close(job.params, flatten(reference.model.state_dict(), spec), rtol=0, atol=1e-6)
    want, have = reference.optimizer_state(), job.optimizer_state()
    assert set(want) == set(have)
    for key in want:
        torch.testing.assert_close(have[key].float(), want[key].float(), rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("node, parallel, where", [
    ({"site-group": "unix:///nonexistent/fl-geo-test.sock"}, "ddp", "the site group"),
    ({}, "fsdp", "client.parallel=fsdp"),
])
def test_muon_is_refused_where_the_shared_state_holds_adamw_only(node, parallel, where) -> None:
    """The persistent site group's files and the FSDP ranks hold AdamW's state layout: a Muon job
    there is a one-line error before anything starts (the spawned DDP job takes Muon)."""
    from types import SimpleNamespace

    from fl_geo.clients.parallel import parallel_trainer

    site = SimpleNamespace(node_config={"device": "cpu", **node}, inner=SimpleNamespace(optimizer="muon", device="cpu"),
                           sections={"client": {"parallel": parallel}})
    client = SimpleNamespace(optimizer_fn=None)
    with pytest.raises(ValueError, match=f"client.optimizer=muon runs in the spawned DDP job only, not {where}"):
        parallel_trainer(client, SimpleNamespace(threads=1), site, 2)
