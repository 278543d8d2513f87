"""client.activation_checkpointing (fl_geo.inner.blocks): each repeated block's forward is recomputed
in backward, so the activations kept for backward shrink while the training numbers stay the same,
on fl-geo's decoder and on a Hugging Face model's own layer list. With FSDP2 on two ranks it is checked
in tests/test_site_group.py (the ClientApp's FSDP run checkpoints its blocks)."""

from __future__ import annotations

import copy

import pytest
import torch

from fl_geo.core.state import ParamSpec, flatten
from fl_geo.data import BatchSampler, ByteTokenizer
from fl_geo.inner.blocks import block_lists, set_activation_checkpointing
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, InnerTrainer

TOKENS = torch.from_numpy(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 200))
SEQ, BATCH, STEPS = 32, 4, 3


def _sampler() -> BatchSampler:
    return BatchSampler(TOKENS, SEQ, BATCH, seed=5, stream=0)


def _inner(checkpointing: bool) -> InnerConfig:
    return InnerConfig(batch_size=BATCH, seq_len=SEQ, warmup_steps=2, total_steps=20, device="cpu",
                       activation_checkpointing=checkpointing)


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward pass of ``model``."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def _model(name: str) -> torch.nn.Module:
    """Built when the test runs, not at collection: the Hugging Face one imports transformers'
    model code (~5 CPU-s), which every pytest worker would otherwise pay to collect this file."""
    if name == "decoder":
        return build_model(ModelConfig(n_layers=3, d_model=32, n_heads=2, max_seq_len=SEQ), 0)
    pytest.importorskip("transformers", reason="transformers is an extra (pip install -e '.[hf]')")
    from fl_geo.config import load_config
    from fl_geo.runtime.builders import make_model
    from tests.conftest import TINY

    return make_model(load_config(None, [*TINY, "model.kind=hf", "model.preset=smollm-tiny"]).model, 0)


@pytest.mark.parametrize("name", ["decoder", "smollm-tiny"])
def test_checkpointing_keeps_fewer_activations_and_trains_the_same_numbers(name: str) -> None:
    model = _model(name)
    x, _ = _sampler().batch(0)
    plain_bytes = _saved_bytes(model, x)
    spec = ParamSpec.from_state_dict(model.state_dict())
    runs = {}
    for checkpointing in (False, True):
        trainer = InnerTrainer(copy.deepcopy(model), _inner(checkpointing))
        result = trainer.train(_sampler(), STEPS, 0)
        runs[checkpointing] = (result, flatten(trainer.model.state_dict(), spec), trainer.optimizer_state())
        if checkpointing:
            kept = _saved_bytes(trainer.model, x)
    (plain, plain_params, plain_opt), (ckpt, ckpt_params, ckpt_opt) = runs[False], runs[True]
    # Recomputation replays the same kernels on the same inputs: the same bits.
    assert ckpt.mean_loss == plain.mean_loss and ckpt.tokens == plain.tokens
    assert torch.equal(ckpt_params, plain_params)
    assert all(torch.equal(ckpt_opt[k], v) for k, v in plain_opt.items())
    # Only each block's inputs are kept (and what lies outside the blocks): measured, not assumed.
    assert kept < 0.5 * plain_bytes, (name, kept, plain_bytes)


def test_checkpointing_is_idempotent_reversible_and_leaves_the_state_dict_alone() -> None:
    model = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=SEQ), 0)
    keys = list(model.state_dict())
    blocks = [b for blocks in block_lists(model) for b in blocks]
    assert len(blocks) == 2
    assert set_activation_checkpointing(model, True) == 2
    wrapped = [b.forward for b in blocks]
    assert set_activation_checkpointing(model, True) == 2  # a persistent rank's kept model: not twice
    assert [b.forward for b in blocks] == wrapped
    assert list(model.state_dict()) == keys
    set_activation_checkpointing(model, False)
    assert all("forward" not in b.__dict__ for b in blocks)  # the class's forward again
    x, _ = _sampler().batch(0)
    with torch.no_grad():  # evaluation does not checkpoint (nothing is kept for backward anyway)
        set_activation_checkpointing(model, True)
        assert torch.equal(model(x), model(x))
