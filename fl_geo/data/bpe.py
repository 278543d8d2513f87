"""Byte-level BPE trained on the run's training text, and tokenizers loaded from a local directory.

``data.tokenizer: bpe`` trains a byte-level BPE (the GPT-2 / Pythia scheme: 256 byte symbols, so
nothing is out of vocabulary) with the ``tokenizers`` library on the *training* text only: the
held-out tail of every document is cut off before the tokenizer sees anything, so validation
text never shapes the vocabulary. The trained tokenizer is cached on disk under a key made of the
sha256 of that training text and the settings, so every node and every later run with the same
data loads the identical file instead of training again. The cache file is checked before use
(`fl_geo.data.bpe_cache`: its key and the sha256 of its content); a file that fails the check is
trained again and replaced, with a WARNING naming it. The tokenizer's ``sha256`` (of the serialised
tokenizer) is the identity the server sends to the ClientApps. ``data.tokenizer: DIR`` loads
``DIR/tokenizer.json`` (what ``transformers``' ``save_pretrained`` writes), local files only.

``tokenizers`` is an optional extra (``pip install fl-geo[hf]``), imported only here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_geo.data.bpe_cache import read_entry, write_entry
from fl_geo.errors import ConfigError

__all__ = [
    "BPE_FORMAT",
    "EOS_TOKEN",
    "MIN_BPE_VOCAB",
    "HFTokenizer",
    "bpe_cache_key",
    "load_dir_tokenizer",
    "require_tokenizers",
    "train_bpe",
]

log = logging.getLogger("fl_geo")

EOS_TOKEN = "<|endoftext|>"
MIN_BPE_VOCAB = 258  # 256 byte symbols, the end-of-text token, at least one merge
BPE_FORMAT = 2  # part of the cache key: bump when the training recipe or the entry format changes
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("data.tokenizer=bpe or a directory needs the `tokenizers` package: "
                          "pip install 'fl-geo[hf]'") from None
    return tokenizers


def require_tokenizers() -> None:
    """Raise the one-line `ConfigError` naming the extra when ``tokenizers`` is not installed."""
    _tokenizers()


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind fl-geo's tokenizer interface (`fl_geo.data.tokenizer`).

    Ids are returned as uint16 when the vocabulary fits (half the memory of int32 for a token
    stream) and int32 otherwise.
    """

    def __init__(self, tok: Any, eos: str | None = None) -> None:
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_id: int | None = tok.token_to_id(eos) if eos else None
        if self.eos_id is None and eos is None:
            self.eos_id = next((tok.token_to_id(t) for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.int32
        self.sha256 = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
        self._token_bytes: np.ndarray | None = None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, dtype=self.dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of many texts at once (the library parallelises it)."""
        return [np.asarray(e.ids, dtype=self.dtype) for e in self.tok.encode_batch(texts)]

    def decode(self, tokens: np.ndarray | torch.Tensor | Iterable[int]) -> str:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)]
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for; 0 for special tokens (the end-of-text separator covers
        no text). Exact for byte-level tokenizers, where every character of a token's string is one
        byte; otherwise the length of the id decoded alone (a word-initial marker may make that
        one byte off)."""
        if self._token_bytes is None:
            specials = {int(i) for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
            byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
            out = np.zeros(self.vocab_size, dtype=np.int64)
            for i in range(self.vocab_size):
                if i in specials:
                    continue
                if byte_level:
                    token = self.tok.id_to_token(i)
                    out[i] = len(token) if token is not None else 0
                else:
                    out[i] = len(self.tok.decode([i], skip_special_tokens=False).encode("utf-8"))
            self._token_bytes = out
        return self._token_bytes

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def _cache_settings(training_sha256: str, vocab_size: int) -> dict[str, Any]:
    """Every input of a trained BPE but the text itself (which is named by its hash)."""
    return {"format": BPE_FORMAT, "vocab_size": int(vocab_size), "eos": EOS_TOKEN,
            "tokenizers": _tokenizers().__version__, "training_text": training_sha256}


def bpe_cache_key(training_sha256: str, vocab_size: int) -> str:
    """The cache key of a trained BPE: its training text's hash and every setting of the recipe
    (never the held-out text: a different split of the same training text is the same key)."""
    settings = json.dumps(_cache_settings(training_sha256, vocab_size), sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()


def train_bpe(texts: Callable[[], Iterator[str]], training_sha256: str, vocab_size: int,
              cache_dir: Path) -> HFTokenizer:
    """The byte-level BPE of ``texts`` (a factory of an iterator over the training text), from
    ``cache_dir`` when it was trained before, else trained and written there atomically.

    Deterministic for the same text and settings (the test trains twice, in two processes).
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"data.bpe_vocab_size must be >= {MIN_BPE_VOCAB} (256 byte symbols, the end-of-text "
                          f"token and at least one merge), got {vocab_size}")
    tokenizers = _tokenizers()
    key = bpe_cache_key(training_sha256, vocab_size)
    path = Path(cache_dir) / f"bpe-{key[:32]}.json"
    text, why = read_entry(path, key)
    if text is not None:
        return HFTokenizer(tokenizers.Tokenizer.from_str(text), EOS_TOKEN)
    if why:  # a refused entry is derived data: trained again and replaced, never used
        log.warning("fl-geo: BPE cache %s refused (%s); training the tokenizer again and replacing it", path, why)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    text = tok.to_str()
    write_entry(path, key, _cache_settings(training_sha256, vocab_size), text)
    # Rebuilt from the text written, so a fresh training and a cache hit give the same object and sha.
    return HFTokenizer(tokenizers.Tokenizer.from_str(text), EOS_TOKEN)


def _dir_eos(directory: Path) -> str | None:
    """The end-of-text token named in ``tokenizer_config.json`` (transformers' file), if any."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_dir_tokenizer(directory: str | Path) -> HFTokenizer:
    """``DIR/tokenizer.json`` (local only; never a hub name)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer: directory {str(directory)!r} does not exist (valid: byte, bpe, "
                          "or a directory holding tokenizer.json)")
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"data.tokenizer: {str(directory)!r} has no tokenizer.json")
    tokenizers = _tokenizers()
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own Exception subclass
        raise ConfigError(f"data.tokenizer: {file} is not a tokenizers file ({exc})") from None
    return HFTokenizer(tok, _dir_eos(path))
