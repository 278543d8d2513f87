"""Hugging Face causal language models as fl-geo models (``model.kind: hf``), offline.

Two ways to get one, both from the run's ``model`` section:

* ``model.preset``: a named shape whose numbers live here (`PRESETS`): GPT-NeoX shaped like
  EleutherAI's Pythia-70M, Llama shaped like SmolLM-135M, and CPU-sized versions of each. Built
  with ``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config`` and a random init drawn
  from the run seed, so every node builds the same model without exchanging it. The vocabulary
  is the run's ``model.vocab_size`` (the tokenizer's), not the preset's original one.
* ``model.path``: a local pretrained checkpoint directory (``config.json`` + safetensors),
  loaded with ``local_files_only=True``; its vocabulary must cover the tokenizer's.

Nothing is ever downloaded: ``HF_HUB_OFFLINE`` is set before ``transformers`` is imported and
every load passes ``local_files_only``. ``transformers`` is an optional extra
(``pip install 'fl-geo[hf]'``), imported only when an ``hf`` model is built; `hf_shape` reads
what the config checks need (layers, vocabulary, positions) without it.

`CausalLM` adapts any such model to what fl-geo's inner loop and flat state expect (also the
public ``fl_geo.clients.causal_lm``): ``forward(ids) -> logits``, parameter names exactly the
Hugging Face ones (no wrapper prefix), and a state dict with **one entry per tensor**: a tied
output head (``lm_head.weight`` is ``model.embed_tokens.weight``) is left out of ``state_dict()``
and filled back in by ``load_state_dict``, so the flat buffer holds one copy, norms and clips
count it once, and the tie survives every load.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fl_geo.errors import ConfigError

__all__ = [
    "HF_EXTRA_HINT",
    "PRESETS",
    "CausalLM",
    "HFShape",
    "build_hf_model",
    "causal_lm",
    "decoder_layers",
    "hf_shape",
    "preset_config",
    "tied_aliases",
]

HF_EXTRA_HINT = "model.kind=hf needs the 'transformers' package: pip install 'fl-geo[hf]'"

# Shapes of the presets, in Hugging Face config names. vocab_size is the original model's (for
# the parameter counts in docs/models.md); the built model takes the run's model.vocab_size.
PRESETS: dict[str, dict[str, Any]] = {
    # EleutherAI/pythia-70m: GPT-NeoX, parallel residual, LayerNorm, rotary on 1/4 of each head.
    "pythia-70m": {
        "model_type": "gpt_neox", "num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
        "intermediate_size": 2048, "rotary_pct": 0.25, "rotary_emb_base": 10000, "vocab_size": 50304,
        "max_position_embeddings": 2048, "use_parallel_residual": True, "layer_norm_eps": 1e-5,
        "hidden_act": "gelu", "tie_word_embeddings": False, "initializer_range": 0.02,
    },
    # HuggingFaceTB/SmolLM-135M: Llama, grouped-query attention (9 heads, 3 kv heads), tied head.
    "smollm-135m": {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "initializer_range": 0.02,
    },
}
# CPU-sized versions: the same architecture and options, 2 layers of width 64.
PRESETS["pythia-tiny"] = {**PRESETS["pythia-70m"], "num_hidden_layers": 2, "hidden_size": 64,
                          "num_attention_heads": 4, "intermediate_size": 256}
PRESETS["smollm-tiny"] = {**PRESETS["smollm-135m"], "num_hidden_layers": 2, "hidden_size": 64,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 192}

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")


@dataclass(frozen=True)
class HFShape:
    """What the config checks need to know about an ``hf`` model, read without ``transformers``:
    its architecture, number of decoder layers, vocabulary and longest position (None: no limit
    in its config)."""

    source: str  # "preset pythia-tiny" or "model.path DIR", for messages
    model_type: str
    layers: int
    vocab_size: int
    max_positions: int | None


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if isinstance(config.get(k), int)), None)


def _read_checkpoint_config(path: str) -> dict[str, Any]:
    """``config.json`` of a local checkpoint directory, checked for what loading it needs."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"model.path {path}: not a directory (a local Hugging Face checkpoint: "
                          "config.json + *.safetensors; nothing is downloaded)")
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"model.path {path}: no config.json in the directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.path {path}: config.json is unreadable ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"model.path {path}: config.json has no model_type")
    if not any(root.glob("*.safetensors")):
        raise ConfigError(f"model.path {path}: no *.safetensors weights in the directory")
    return config


def hf_shape(model: Any) -> HFShape:
    """The `HFShape` of a ``model`` section with ``kind: hf`` (a preset or a local checkpoint);
    `ConfigError` (one line, naming the field) for a missing or unknown preset, both set, or a
    directory that is not a readable checkpoint. For a preset the vocabulary is the section's
    ``vocab_size`` (the model is built with it)."""
    preset, path = str(model.preset or ""), str(model.path or "")
    if preset and path:
        raise ConfigError("model.preset and model.path are exclusive: a preset is a random init, a path a "
                          "pretrained checkpoint")
    if not preset and not path:
        raise ConfigError(f"model.kind=hf needs model.preset (one of {', '.join(PRESETS)}) or model.path "
                          "(a local checkpoint directory)")
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"model.preset '{preset}' is unknown; valid: {', '.join(PRESETS)}")
        numbers = PRESETS[preset]
        return HFShape(f"preset {preset}", numbers["model_type"], numbers["num_hidden_layers"],
                       int(model.vocab_size), numbers["max_position_embeddings"])
    config = _read_checkpoint_config(path)
    layers, vocab = _first(config, _LAYER_KEYS), config.get("vocab_size")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"model.path {path}: config.json gives no layer count ({' / '.join(_LAYER_KEYS)})")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"model.path {path}: config.json gives no vocab_size")
    if vocab < int(model.vocab_size):
        raise ConfigError(f"model.path {path}: the checkpoint's vocabulary ({vocab}) is smaller than the "
                          f"tokenizer's (model.vocab_size={model.vocab_size}); use a checkpoint made for it")
    return HFShape(f"model.path {path}", config["model_type"], layers, vocab, _first(config, _POSITION_KEYS))


def transformers_available() -> bool:
    """Whether ``transformers`` can be imported (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("transformers") is not None


def _transformers() -> Any:
    """``transformers``, imported offline; a `ConfigError` naming the extra when it is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(HF_EXTRA_HINT) from None
    return transformers


def preset_config(name: str, vocab_size: int) -> Any:
    """The ``transformers`` config of a preset with the run's vocabulary."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset '{name}' is unknown; valid: {', '.join(PRESETS)}")
    numbers = dict(PRESETS[name])
    model_type = numbers.pop("model_type")
    numbers["vocab_size"] = int(vocab_size)
    return _transformers().AutoConfig.for_model(model_type, **numbers)


def build_hf_model(model: Any, seed: int) -> CausalLM:
    """The ``hf`` model of a ``model`` section (a `fl_geo.inner.model.ModelConfig`), in fp32.

    A preset gets a random init that depends only on ``(section, seed)`` (drawn under
    ``fork_rng``, so the caller's global RNG stream is untouched); a path loads its checkpoint
    from disk only. Problems are one-line `ConfigError`s.
    """
    shape = hf_shape(model)
    tf = _transformers()
    if model.preset:
        config = preset_config(model.preset, model.vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            hf = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        try:
            hf = tf.AutoModelForCausalLM.from_pretrained(str(Path(model.path).expanduser()), local_files_only=True,
                                                         dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"model.path {model.path}: cannot load it as a causal language model ({first})") from None
    hf.float()
    info = replace(model, vocab_size=int(hf.get_input_embeddings().weight.shape[0]),
                   max_seq_len=int(shape.max_positions or model.max_seq_len))
    return CausalLM(hf, cfg=info)


# ---------------------------------------------------------------------------------------------
# The adapter (no transformers import: it works for any model of that form)
# ---------------------------------------------------------------------------------------------


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: source}`` for every parameter or buffer reachable under two names (a tied
    output head: ``{"lm_head.weight": "model.embed_tokens.weight"}``); the first name in module
    order is the source. By tensor identity, so it works on the ``meta`` device too."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in chain(module.named_parameters(remove_duplicate=False),
                              module.named_buffers(remove_duplicate=False)):
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
    return aliases


def decoder_layers(model: nn.Module) -> str:
    """Dotted path of the model's list of decoder layers, from its module tree: the
    ``nn.ModuleList`` whose children are the model's own layer class (Hugging Face names it in
    ``_no_split_modules``: ``GPTNeoXLayer``, ``LlamaDecoderLayer``), else the list of identical
    modules holding the most parameters. ``gpt_neox.layers``, ``model.layers``, ``transformer.h``,
    ``blocks`` (fl-geo's decoder). ValueError when the model has no ``nn.ModuleList``."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    best: tuple[bool, bool, int, str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(child) for child in module}
        named = bool(layer_classes) and all(type(child).__name__ in layer_classes for child in module)
        key = (named, len(kinds) == 1, sum(p.numel() for p in module.parameters()), path)
        if best is None or key[:3] > best[:3]:
            best = key
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers; give the blocks "
                         "explicitly (make_client_app(blocks=...))")
    return best[3]


@dataclass(frozen=True)
class LMInfo:
    """What fl-geo's tools read from a model (``fl-geo sample``): its vocabulary and context."""

    vocab_size: int
    max_seq_len: int


class CausalLM(nn.Module):
    """A causal LM (``model(input_ids=ids)`` returning ``.logits``, a tuple or a tensor) as an
    fl-geo model: ``forward(ids) -> logits (B, T, V)``.

    The wrapped model's children (and its own tensors) are registered on this module as they
    are, so every parameter keeps its Hugging Face name (``gpt_neox.layers.0.…``) and the module
    tree is the wrapped one: its layer list is ``layer_list`` (`decoder_layers`). Tied tensors
    (`tied_aliases`) appear once in ``state_dict()``; ``load_state_dict`` accepts a state dict
    without the aliases (and with them). ``cfg`` (vocabulary, context length) is for fl-geo's
    tools; from the model's config when not given.
    """

    def __init__(self, model: nn.Module, cfg: Any | None = None) -> None:
        super().__init__()
        self.__dict__["wrapped"] = model  # not a submodule: its children are ours (no name prefix)
        for name, param in model._parameters.items():
            if param is not None:
                self.register_parameter(name, param)
        for name, buf in model._buffers.items():
            if buf is not None:
                self.register_buffer(name, buf, persistent=name not in model._non_persistent_buffers_set)
        for name, child in model.named_children():
            self.add_module(name, child)
        # the wrapped model's own attribute, so that decoder_layers finds the same list through us
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self.tied = tied_aliases(self)
        self.layer_list = decoder_layers(self)
        if cfg is None:
            config = getattr(model, "config", None)
            vocab = getattr(config, "vocab_size", None)
            positions = _first(vars(config), _POSITION_KEYS) if config is not None else None
            cfg = LMInfo(int(vocab) if vocab else 0, int(positions) if positions else 0)
        self.cfg = cfg
        self._register_state_dict_hook(_drop_aliases)
        self.register_load_state_dict_pre_hook(_fill_aliases)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if hasattr(self.wrapped, "config") else {}
        out = self.wrapped(input_ids=input_ids, **kwargs)
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, tuple | list) else out

    def train(self, mode: bool = True) -> CausalLM:
        super().train(mode)
        self.wrapped.training = mode  # the children follow through super(); the top-level flag too
        return self

    def num_params(self) -> int:
        """Trainable scalars, a tied matrix counted once."""
        return sum(p.numel() for p in self.parameters())


def _drop_aliases(module: CausalLM, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for alias in module.tied:
        state_dict.pop(prefix + alias, None)


def _fill_aliases(module: CausalLM, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                  strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    for alias, source in module.tied.items():
        if prefix + alias not in state_dict and prefix + source in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + source]


def causal_lm(model_or_factory: nn.Module | Callable[..., nn.Module]) -> Any:
    """A user's Hugging Face (or any ``input_ids -> .logits``) causal LM as an fl-geo model.

    Given a model: the `CausalLM` around it (a `CausalLM` is returned as is). Given a factory
    (``model_fn(site)`` of ``make_client_app``, or any callable): a factory with the same
    arguments whose models are wrapped, picklable when the factory is (the data-parallel job
    pickles it). Use the same wrapping for the server's initial arrays,
    ``ArrayRecord(causal_lm(model).state_dict())``, so that both sides hold a tied matrix once.
    """
    if isinstance(model_or_factory, CausalLM):
        return model_or_factory
    if isinstance(model_or_factory, nn.Module):
        return CausalLM(model_or_factory)
    if callable(model_or_factory):
        return functools.partial(_wrapped_call, model_or_factory)
    raise TypeError(f"causal_lm takes a torch model or a factory of one, got {type(model_or_factory).__name__}")


def _wrapped_call(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> CausalLM:
    model = factory(*args, **kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory must return a torch.nn.Module, got {type(model).__name__}")
    return causal_lm(model)
