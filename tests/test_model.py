"""The decoder: shapes, causality, tied weights, stable names and seeded initialisation."""

from __future__ import annotations

import pytest
import torch

from fl_geo.inner.model import Decoder, ModelConfig, build_model

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=2, max_seq_len=32)


def test_default_config_matches_the_documented_size() -> None:
    cfg = ModelConfig()
    assert cfg.ffn_hidden == 352  # multiple of 32 nearest 8/3 * 128 = 341.3
    model = build_model(cfg, seed=0)
    # 0.43 M parameters is the size docs/data.md's throughput figures were measured with.
    assert model.num_params() == 434_816


def test_explicit_d_ff_is_used() -> None:
    assert ModelConfig(d_model=64, d_ff=100).ffn_hidden == 100
    assert ModelConfig(d_model=64).ffn_hidden == 160


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 130, "n_heads": 4}, "divisible by n_heads"),
        ({"d_model": 12, "n_heads": 4}, "must be even"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"vocab_size": -1}, "vocab_size must be a positive integer"),
        ({"d_ff": -5}, "d_ff must be >= 0"),
        ({"norm_eps": 0.0}, "norm_eps must be > 0"),
    ],
)
def test_validate_rejects_bad_shapes(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides).validate()


def test_forward_shape_and_dtype() -> None:
    model = build_model(TINY, seed=0)
    idx = torch.randint(0, 256, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_sequence_longer_than_max_is_rejected() -> None:
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :15], after[:, :15], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 15:], after[:, 15:])


def test_tied_embedding_is_stored_once_and_used_as_head() -> None:
    model = build_model(TINY, seed=0)
    state = model.state_dict()
    assert "embed.weight" in state
    assert not any("lm_head" in key or "head" in key for key in state)
    assert sum(t.numel() for t in state.values()) == model.num_params()
    # The head really is the embedding: zeroing it zeroes every logit.
    with torch.no_grad():
        model.embed.weight.zero_()
    assert torch.count_nonzero(model(torch.ones(1, 4, dtype=torch.long))) == 0


def test_parameter_names_group_by_top_level_module() -> None:
    model = build_model(TINY, seed=0)
    names = list(model.state_dict())
    assert names[0] == "embed.weight" and names[-1] == "norm.weight"
    tops = list(
        dict.fromkeys(
            ".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0]
            for n in names
        )
    )
    assert tops == ["embed", "blocks.0", "blocks.1", "norm"]
    assert "blocks.0.attn.qkv.weight" in names and "blocks.1.mlp.down.weight" in names


def test_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    a, b = build_model(TINY, seed=7), build_model(TINY, seed=7)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    c = build_model(TINY, seed=8)
    assert not torch.equal(a.embed.weight, c.embed.weight)

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(TINY, seed=99)
    assert torch.equal(torch.rand(3), expected)


def test_init_statistics() -> None:
    model = build_model(ModelConfig(), seed=0)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # Residual output projections are scaled down by 1/sqrt(2 * n_layers).
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(128))


def test_decoder_validates_its_config() -> None:
    with pytest.raises(ValueError):
        Decoder(ModelConfig(d_model=10, n_heads=3))


def test_untrained_model_is_near_uniform() -> None:
    model = build_model(ModelConfig(), seed=0).eval()
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.1)
