"""The run's corpus, tokenizer and partitions, memoised per process: a simulation actor or a
ClientApp process handles many messages, and loading and tokenising the corpus once instead of
once per message saves seconds each round. Keys are the resolved data directory and file list,
so two spellings of one directory share an entry. The returned objects are shared between
callers: treat them as read-only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from fl_geo.data.corpus import Corpus, default_data_dir, load_corpus
from fl_geo.data.partition import Partition, make_tokenizer, partition_corpus
from fl_geo.data.tokenizer import Tokenizer

__all__ = ["get_corpus", "get_partitions", "get_tokenizer"]


@functools.lru_cache(maxsize=2)
def _cached_corpus(
    name: str, data_dir: str, files: tuple[str, ...] | None, text_key: str, path: str = "",
    text_field: str = "text",
) -> Corpus:
    return load_corpus(
        name, data_dir=data_dir, files=list(files) if files else None, text_key=text_key, path=path,
        text_field=text_field,
    )


def _corpus_key(
    data_dir: str | Path | None, files: Sequence[str] | None
) -> tuple[str, tuple[str, ...] | None]:
    directory = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return str(directory.resolve()), (tuple(str(f) for f in files) if files else None)


def get_corpus(
    corpus_name: str,
    data_dir: str | Path | None = None,
    files: Sequence[str] | None = None,
    text_key: str = "text",
    path: str = "",
    text_field: str = "text",
) -> Corpus:
    """Memoised :func:`load_corpus` (e.g. to record ``.name``/``.sha256`` of what ``auto`` chose)."""
    directory, file_key = _corpus_key(data_dir, files)
    return _cached_corpus(corpus_name, directory, file_key, text_key, path, text_field)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(
    spec: str,
    bpe_vocab_size: int,
    corpus_name: str,
    val_fraction: float,
    data_dir: str,
    files: tuple[str, ...] | None,
    text_key: str,
    path: str = "",
    text_field: str = "text",
) -> Tokenizer:
    corpus = _cached_corpus(corpus_name, data_dir, files, text_key, path, text_field) if spec == "bpe" else None
    return make_tokenizer(spec, corpus, val_fraction, bpe_vocab_size, data_dir)


def get_tokenizer(
    corpus_name: str,
    val_fraction: float = 0.05,
    data_dir: str | Path | None = None,
    files: Sequence[str] | None = None,
    text_key: str = "text",
    tokenizer: str = "byte",
    bpe_vocab_size: int = 4096,
    path: str = "",
    text_field: str = "text",
) -> Tokenizer:
    """Memoised :func:`make_tokenizer` for the run's data settings (what :func:`get_partitions` uses)."""
    directory, file_key = _corpus_key(data_dir, files)
    return _cached_tokenizer(str(tokenizer), int(bpe_vocab_size), corpus_name, float(val_fraction),
                             directory, file_key, text_key, path, text_field)


@functools.lru_cache(maxsize=4)
def _cached_partitions(
    corpus_name: str,
    num_partitions: int,
    scheme: str,
    val_fraction: float,
    seed: int,
    data_dir: str,
    files: tuple[str, ...] | None,
    text_key: str,
    tokenizer: str = "byte",
    bpe_vocab_size: int = 4096,
    path: str = "",
    text_field: str = "text",
) -> tuple[list[Partition], torch.Tensor]:
    corpus = _cached_corpus(corpus_name, data_dir, files, text_key, path, text_field)
    tok = _cached_tokenizer(tokenizer, bpe_vocab_size, corpus_name, val_fraction, data_dir, files, text_key,
                            path, text_field)
    if tokenizer != "byte" or not isinstance(corpus, Corpus):
        # A dataset corpus, or any corpus with a trained tokenizer: tokenised once into memory maps on
        # disk (fl_geo.data.store; the same partitions as in memory), so the other processes of the run
        # and later runs map the store instead of encoding again. Bytes of a built-in corpus stay in memory.
        from fl_geo.data.store import build_store, partition_store

        store = build_store(corpus, tok, val_fraction, Path(data_dir) / "token-stores")
        return partition_store(store, corpus.name, num_partitions, scheme, seed)
    return partition_corpus(corpus, num_partitions, scheme, val_fraction, seed, tokenizer=tok)


def get_partitions(
    corpus_name: str,
    num_partitions: int,
    scheme: str = "by_group",
    val_fraction: float = 0.05,
    seed: int = 0,
    data_dir: str | Path | None = None,
    files: Sequence[str] | None = None,
    text_key: str = "text",
    tokenizer: str = "byte",
    bpe_vocab_size: int = 4096,
    path: str = "",
    text_field: str = "text",
) -> tuple[list[Partition], torch.Tensor]:
    """Memoised :func:`partition_corpus` of :func:`load_corpus` (dataset corpora: of their token
    store, `fl_geo.data.store`).

    A simulation actor handles many client messages per process; loading and tokenising the corpus
    once per process instead of once per message saves seconds each round. The returned tensors are
    shared between callers: treat them as read-only. ``tokenizer``: ``data.tokenizer``
    (:func:`get_tokenizer`).
    """
    directory, file_key = _corpus_key(data_dir, files)
    return _cached_partitions(
        corpus_name,
        int(num_partitions),
        scheme,
        float(val_fraction),
        int(seed),
        directory,
        file_key,
        text_key,
        str(tokenizer),
        int(bpe_vocab_size),
        str(path),
        str(text_field),
    )
