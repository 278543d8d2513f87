"""Turn config sections into the core objects, in one place for server and clients alike.

The ServerApp and every ClientApp must build the *same* model (so parameter specs match on the wire)
and read the *same* partitions (so the server's held-out set is never trained on); building both
from the same functions keeps them from drifting.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from fl_geo.data import Partition, Tokenizer, get_partitions, get_tokenizer
from fl_geo.inner.model import Decoder, ModelConfig, build_model
from fl_geo.inner.training import InnerConfig


def _as_dict(section: Any) -> dict[str, Any]:
    if isinstance(section, str):
        return json.loads(section)
    if isinstance(section, dict):
        return dict(section)
    from fl_geo.config import to_dict

    return to_dict(section)


def model_config(section: Any) -> ModelConfig:
    cfg = ModelConfig(**_as_dict(section))
    cfg.validate()
    return cfg


def make_model(section: Any, seed: int) -> Decoder | torch.nn.Module:
    """The initial global model: identical on every process for the same config and seed.

    ``model.kind: hf`` builds a Hugging Face causal LM (fl_geo.inner.hf, ``transformers``
    imported only then); the default is fl-geo's decoder."""
    cfg = model_config(section)
    if cfg.kind == "hf":
        from fl_geo.inner.hf import build_hf_model

        return build_hf_model(cfg, seed)
    return build_model(cfg, seed=seed)


# The client section's inner-optimizer choice and Muon settings, named as in InnerConfig
_OPTIMIZER_KEYS = ("optimizer", "muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_weight_decay",
                   "muon_adjust_lr")


def inner_config(section: Any, total_steps: int) -> InnerConfig:
    d = _as_dict(section)
    return InnerConfig(
        lr=d["lr"],
        min_lr_ratio=d["min_lr_ratio"],
        warmup_steps=d["warmup_steps"],
        total_steps=int(d.get("total_steps") or total_steps),
        betas=(d["beta1"], d["beta2"]),
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        grad_clip=d["grad_clip"],
        batch_size=d["batch_size"],
        seq_len=d["seq_len"],
        precision=d["precision"],
        device=d["device"],
        # (a client section from before the inner optimizer was a setting means AdamW)
        **{key: d[key] for key in _OPTIMIZER_KEYS if key in d},
        activation_checkpointing=bool(d.get("activation_checkpointing", False)),
    )


def partitions(data_section: Any, num_partitions: int) -> tuple[list[Partition], torch.Tensor]:
    """All partitions plus the global held-out tokens (memoised per process by fl_geo.data)."""
    d = _as_dict(data_section)
    return get_partitions(d["corpus"], num_partitions, d["partition"], d["val_fraction"], d["seed"], **_source(d))


def tokenizer(data_section: Any) -> Tokenizer:
    """The run's tokenizer (``data.tokenizer``; a data section without the key means bytes),
    memoised per process; the one `partitions` encodes with."""
    d = _as_dict(data_section)
    return get_tokenizer(d["corpus"], d["val_fraction"], **_source(d))


def _source(d: dict[str, Any]) -> dict[str, Any]:
    """Where the text comes from and how it is tokenised: the keyword arguments `get_partitions` and
    `get_tokenizer` share (a data section from before a key existed gets that key's default)."""
    return {
        "data_dir": d["data_dir"] or None,
        "files": tuple(d["files"]) or None,
        "text_key": d["text_key"],
        "tokenizer": d.get("tokenizer", "byte"),
        "bpe_vocab_size": d.get("bpe_vocab_size", 4096),
        "path": d.get("path", ""),
        "text_field": d.get("text_field", "text"),
    }
