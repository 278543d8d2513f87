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

import torch
import torch.nn.functional as F
from torch import nn

from fl_geo.inner.model_config import ModelConfig

__all__ = ["ModelConfig", "Decoder", "RMSNorm", "build_model"]


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
