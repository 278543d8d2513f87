"""A small Llama-style decoder used by every datacenter client.

The architecture (RMSNorm, rotary position embeddings, SwiGLU MLP, tied embeddings, causal SDPA)
follows the models the DiLoCo-family papers train, scaled down so that CPU runs converge in seconds.

Parameter names are part of the public contract: the pseudo-gradient penalty's ``module`` granularity
groups parameters by their top-level module (``embed``, ``blocks.0`` … ``blocks.{L-1}``, ``norm``),
and the Flower glue flattens ``state_dict()`` in order. Hence the output head reuses
``embed.weight`` inside ``forward`` instead of owning a second (aliased) parameter, so the state
dict holds exactly one copy of the tied matrix, and the RoPE tables are non-persistent buffers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "Decoder", "RMSNorm", "build_model"]


@dataclass
class ModelConfig:
    """Shape of the decoder. ``d_ff=0`` derives the SwiGLU width from ``d_model``.

    ``kind``: ``builtin`` (this decoder) or ``hf`` (a Hugging Face causal LM, fl_geo.inner.hf:
    ``preset`` names a shape kept in the repo, ``path`` a local pretrained checkpoint; the
    decoder's shape fields are then unused, ``vocab_size`` is still the tokenizer's).
    """

    kind: str = "builtin"
    preset: str = ""
    path: str = ""
    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 0
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def validate(self) -> ModelConfig:
        """Raise ``ValueError`` naming the offending field; returns ``self`` for chaining."""
        if self.kind not in ("builtin", "hf"):
            raise ValueError(f"ModelConfig.kind must be builtin or hf, got {self.kind!r}")
        if self.kind == "builtin" and (self.preset or self.path):
            raise ValueError("ModelConfig.preset and ModelConfig.path are for kind=hf (model.kind=hf)")
        for field in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if not isinstance(self.d_ff, int) or self.d_ff < 0:
            raise ValueError(
                f"ModelConfig.d_ff must be >= 0 (0 = derive from d_model), got {self.d_ff!r}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head dimension d_model/n_heads = {self.d_model // self.n_heads} must be even for RoPE"
            )
        for field in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"ModelConfig.{field} must be > 0, got {value!r}")
        return self

    def blocks(self) -> tuple[int, str]:
        """The model's number of transformer blocks and how to name it in a message (a Hugging
        Face model's are read from its preset or checkpoint config, without building it)."""
        if self.kind == "hf":
            from fl_geo.inner.hf import hf_shape

            shape = hf_shape(self)
            return shape.layers, f"the layers of the model ({shape.source})"
        return self.n_layers, "model.n_layers"

    def check_hf(self, seq_len: int) -> None:
        """``kind: hf``: the package is there, a known preset or a readable local checkpoint, and
        room for ``seq_len`` positions (read without importing ``transformers``; fl_geo.inner.hf);
        a `ConfigError` otherwise."""
        from fl_geo.errors import require
        from fl_geo.inner.hf import HF_EXTRA_HINT, hf_shape, transformers_available

        require(transformers_available(), HF_EXTRA_HINT)
        shape = hf_shape(self)
        require(shape.max_positions is None or seq_len <= shape.max_positions,
                f"client.seq_len ({seq_len}) exceeds the {shape.max_positions} positions of the model ({shape.source})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden width: ``d_ff`` or the multiple of 32 nearest 8/3·d_model.

        8/3 keeps the SwiGLU MLP (three matrices) at the parameter count of a 4×-wide two-matrix
        MLP; rounding to 32 keeps matmul shapes friendly to vector units.
        """
        if self.d_ff > 0:
            return self.d_ff
        return max(32, 32 * round(8 * self.d_model / 3 / 32))

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 so bf16 autocast does not lose the scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables [max_seq_len, head_dim] for the rotate-half RoPE convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, D] by position; ``cos``/``sin`` are [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention; q, k and v come from one fused projection (one matmul)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate and up share one fused matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids [B, T] → next-token logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Non-persistent: derived from the config, so they must not travel in the state dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        # Tied output head: reuse the embedding matrix rather than registering an alias.
        return F.linear(self.norm(x), self.embed.weight)

    def get_output_embeddings(self) -> nn.Module:
        """The output layer (Hugging Face's name for it): the tied embedding. The Muon inner
        optimizer (fl_geo.inner.muon) reads it to keep the head on AdamW."""
        return self.embed

    def num_params(self) -> int:
        """Number of trainable scalars; the tied embedding/head matrix is counted once."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """GPT-2/Llama-style init: N(0, std) everywhere, residual output projections scaled by
        1/sqrt(2·n_layers) so the residual stream's variance does not grow with depth; norms at 1."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, mean=0.0, std=std, generator=generator)
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, mean=0.0, std=std, generator=generator)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std, generator=generator)
            nn.init.normal_(block.mlp.gate_up.weight, mean=0.0, std=std, generator=generator)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std, generator=generator)
            block.attn_norm.weight.fill_(1.0)
            block.mlp_norm.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)


def build_model(cfg: ModelConfig, seed: int) -> Decoder:
    """A freshly initialised decoder that depends only on ``(cfg, seed)``.

    Every datacenter must start from bit-identical weights without exchanging them, and building a
    model must not shift the caller's global RNG stream (that would change data order elsewhere):
    module construction runs under ``fork_rng`` and the real init draws from a local generator.
    """
    with torch.random.fork_rng(devices=[]):
        model = Decoder(cfg)
    generator = torch.Generator().manual_seed(int(seed))
    model.reset_parameters(generator)
    return model
