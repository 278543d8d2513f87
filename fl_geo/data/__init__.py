"""Corpora (built-in and local jsonl/parquet/arrow files), tokenizers (byte, BPE, a local
directory), the memory-mapped token store, partitioning into datacenter shards, and stateless
batch sampling. ``tokenizers`` and ``datasets`` are optional extras, imported only where a BPE is
trained or loaded and a local dataset file is read.

The names below are imported from their modules when first used: the config schema reads
``fl_geo.data.settings`` (torch-free), and importing this package for it must not import torch
(the sampler's module does) or the corpus fetcher (``python -m fl_geo.data.fetch`` would load that
module twice, and runpy warns)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fl_geo.data.corpus import (
        CORPUS_NAMES,
        Corpus,
        Document,
        corpus_digest,
        default_data_dir,
        fetch_command,
        load_corpus,
    )
    from fl_geo.data.fetch import fetch_corpora
    from fl_geo.data.loader import BatchNoise, BatchSampler, eval_batches
    from fl_geo.data.memo import get_corpus, get_partitions, get_tokenizer
    from fl_geo.data.partition import PARTITION_SCHEMES, Partition, make_tokenizer, partition_corpus
    from fl_geo.data.tokenizer import ByteTokenizer, Tokenizer

_HOME = {
    **dict.fromkeys(("CORPUS_NAMES", "Corpus", "Document", "corpus_digest", "default_data_dir", "fetch_command",
                     "load_corpus"), "corpus"),
    **dict.fromkeys(("BatchNoise", "BatchSampler", "eval_batches"), "loader"),
    **dict.fromkeys(("get_corpus", "get_partitions", "get_tokenizer"), "memo"),
    **dict.fromkeys(("PARTITION_SCHEMES", "Partition", "make_tokenizer", "partition_corpus"), "partition"),
    **dict.fromkeys(("ByteTokenizer", "Tokenizer"), "tokenizer"),
    "fetch_corpora": "fetch",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    if home != "fetch":  # kept: the next lookup is a plain attribute (fetch is looked up each time, as before)
        globals()[name] = value
    return value


__all__ = [
    "CORPUS_NAMES",
    "PARTITION_SCHEMES",
    "BatchNoise",
    "BatchSampler",
    "ByteTokenizer",
    "Corpus",
    "Document",
    "Partition",
    "Tokenizer",
    "corpus_digest",
    "default_data_dir",
    "eval_batches",
    "fetch_command",
    "fetch_corpora",
    "get_corpus",
    "get_partitions",
    "get_tokenizer",
    "make_tokenizer",
    "load_corpus",
    "partition_corpus",
]
