"""The decoder's shape (`ModelConfig`), the ``model`` section of a run's config.

Its own module, without torch: the config schema, the command line and the deployment code build
and check it, and ``fl-geo --help`` should not pay torch's import (~3 CPU-s) for that.
`fl_geo.inner.model` builds the decoder from it (and re-exports it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ModelConfig"]


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
