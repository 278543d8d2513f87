"""Corpora (built-in and local jsonl/parquet/arrow files), tokenizers (byte, BPE, a local
directory), the memory-mapped token store, partitioning into datacenter shards, and stateless
batch sampling. ``tokenizers`` and ``datasets`` are optional extras, imported only where a BPE is
trained or loaded and a local dataset file is read."""

from fl_geo.data.corpus import (
    CORPUS_NAMES,
    Corpus,
    Document,
    corpus_digest,
    default_data_dir,
    fetch_command,
    load_corpus,
)
from fl_geo.data.loader import BatchNoise, BatchSampler, eval_batches
from fl_geo.data.memo import get_corpus, get_partitions, get_tokenizer
from fl_geo.data.partition import (
    PARTITION_SCHEMES,
    Partition,
    make_tokenizer,
    partition_corpus,
)
from fl_geo.data.tokenizer import ByteTokenizer, Tokenizer


def __getattr__(name: str) -> object:
    """Import ``fetch_corpora`` lazily: eager import would make ``python -m fl_geo.data.fetch``
    load the module twice (runpy warns), and training processes never need it."""
    if name == "fetch_corpora":
        from fl_geo.data.fetch import fetch_corpora

        return fetch_corpora
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
