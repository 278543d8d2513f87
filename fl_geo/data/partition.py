"""Split a corpus into per-datacenter training shards plus one global held-out set.

Validation text is the last ``val_fraction`` of *every* document, cut before any partitioning, so
the global held-out set (the union of the partitions' validation parts) is never trained on by any
datacenter, under every scheme. The schemes differ only in how the training text is dealt out:

* ``by_group``: natural non-IID split along the corpus's group label (translation, author, package).
* ``iid``: fixed-size chunks of all training text, shuffled and dealt round-robin.
* ``by_document``: whole documents dealt to balance sizes (mildly non-IID).
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_geo.data.corpus import Corpus, Document, default_data_dir
from fl_geo.data.tokenizer import ByteTokenizer, Tokenizer
from fl_geo.errors import ConfigError

__all__ = [
    "IID_CHUNK_BYTES",
    "PARTITION_SCHEMES",
    "Partition",
    "make_tokenizer",
    "partition_corpus",
    "split_text",
    "training_sha256",
]

PARTITION_SCHEMES = ("by_group", "iid", "by_document")
IID_CHUNK_BYTES = 4096


@dataclass
class Partition:
    """One datacenter's data: token tensors for training and for local validation (uint8 with the
    byte tokenizer, uint16 or int32 with a larger vocabulary)."""

    index: int
    groups: list[str]
    train: torch.Tensor
    val: torch.Tensor

    @property
    def num_train_tokens(self) -> int:
        return int(self.train.numel())


def _concat(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces) if len(pieces) else np.zeros(0, dtype=np.uint8)


def _greedy_assign(sizes: Sequence[int], bins: int) -> list[int]:
    """Bin per item: largest items first, each to the currently lightest bin (lowest index on ties).

    The longest-processing-time heuristic: within 4/3 of the best possible balance, deterministic.
    """
    loads = np.zeros(bins, dtype=np.int64)
    assignment = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = int(np.argmin(loads))
        assignment[item] = target
        loads[target] += sizes[item]
    return assignment


def _shares(sizes: Sequence[int], total: int) -> list[int]:
    """Partitions per group when there are fewer groups than partitions: one each, then extra ones
    to the group with the most bytes per partition (D'Hondt), so shard sizes stay comparable."""
    counts = [1] * len(sizes)
    for _ in range(total - len(sizes)):
        best = max(range(len(sizes)), key=lambda i: (sizes[i] / counts[i], -i))
        counts[best] += 1
    return counts


def _deal_chunks(
    data: np.ndarray, chunk: int, parts: int, rng: np.random.Generator
) -> list[list[int]]:
    """Chunk start offsets per partition: shuffle the chunk order, then deal round-robin."""
    starts = np.arange(0, len(data), chunk)
    order = starts[rng.permutation(len(starts))]
    return [sorted(order[p::parts].tolist()) for p in range(parts)]


def _gather(data: np.ndarray, starts: Sequence[int], chunk: int, concat: Concat) -> np.ndarray:
    return concat([data[start : start + chunk] for start in starts])


def _covered_docs(
    doc_offsets: np.ndarray, starts: Sequence[int], chunk: int, total: int
) -> np.ndarray:
    """Boolean mask of documents that overlap any chunk ``[start, start + chunk)`` of the stream."""
    mask = np.zeros(len(doc_offsets), dtype=np.int64)
    if len(starts):
        first = np.asarray(starts)
        last = np.minimum(first + chunk, total) - 1
        lo = np.searchsorted(doc_offsets, first, side="right") - 1
        hi = np.searchsorted(doc_offsets, last, side="right") - 1
        np.add.at(mask, lo, 1)
        np.add.at(mask, hi[hi + 1 < len(mask)] + 1, -1)
    return np.cumsum(mask) > 0


def partition_corpus(
    corpus: Corpus,
    num_partitions: int,
    scheme: str = "by_group",
    val_fraction: float = 0.05,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> tuple[list[Partition], torch.Tensor]:
    """Partitions (one per datacenter) and the global validation tokens.

    ``by_group`` with as many groups as partitions gives group i to partition i (corpus order).
    With more groups, groups are balanced greedily by size (largest first). With fewer, each group
    gets ≥ 1 partition (extra partitions go to the largest groups) and its training text is cut into
    equal contiguous pieces, so each partition stays within one group. Only ``iid`` uses ``seed``;
    every scheme is deterministic. ``tokenizer`` (default bytes): with another tokenizer each
    document's held-out tail is cut as text (`split_text`) before encoding, and each piece ends
    with the tokenizer's end-of-text id when it has one (documents packed with a separator).
    """
    if not isinstance(num_partitions, numbers.Integral) or num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions!r}")
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(
            f"unknown partition scheme {scheme!r}; expected one of {PARTITION_SCHEMES}"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    tokenizer = tokenizer or ByteTokenizer()

    docs = corpus.documents
    train_parts, val_parts = _encode_split(docs, tokenizer, val_fraction)
    group_names = corpus.groups
    group_index = {name: i for i, name in enumerate(group_names)}
    doc_group = [group_index[doc.group] for doc in docs]
    return partition_tokens(corpus.name, train_parts, val_parts, doc_group, group_names, num_partitions, scheme, seed)


Concat = Callable[[Sequence[np.ndarray]], np.ndarray]


def partition_tokens(
    corpus_name: str,
    train_parts: list[np.ndarray],
    val_parts: list[np.ndarray],
    doc_group: list[int],
    group_names: list[str],
    num_partitions: int,
    scheme: str,
    seed: int,
    concat: Concat | None = None,
    whole: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[Partition], torch.Tensor]:
    """The partitions of already tokenised documents (``train_parts[i]`` / ``val_parts[i]`` of
    document ``i``, in group ``doc_group[i]``). ``concat`` joins pieces (default in memory; the
    token store passes one that writes to a memory-mapped file); ``whole``: the concatenation of
    all training and all held-out parts when the caller has it already (the token store's files)."""
    concat = concat or _concat
    docs = train_parts
    # Each plan entry: (train pieces, val pieces, group indices) for one partition.
    plan: list[tuple[list[np.ndarray], list[np.ndarray], list[int]]]
    if scheme == "iid":
        plan = _plan_iid(train_parts, val_parts, doc_group, num_partitions, seed, concat, whole)
    elif scheme == "by_document":
        if len(docs) < num_partitions:
            raise ValueError(
                f"by_document: {len(docs)} documents cannot fill {num_partitions} partitions"
            )
        owner = _greedy_assign([len(part) for part in train_parts], num_partitions)
        plan = _plan_from_owner(
            owner, train_parts, val_parts, [[g] for g in doc_group], num_partitions
        )
    else:
        plan = _plan_by_group(train_parts, val_parts, doc_group, len(group_names), num_partitions, concat)

    partitions = []
    for index, (train, val, groups) in enumerate(plan):
        train_tokens = concat(train)
        if len(train_tokens) == 0:
            raise ValueError(
                f"partition {index} of {num_partitions} would be empty ({scheme} split of corpus "
                f"{corpus_name!r} with {len(docs)} documents); use fewer partitions or another scheme"
            )
        partitions.append(
            Partition(
                index=index,
                groups=[group_names[g] for g in groups],
                train=torch.from_numpy(train_tokens),
                val=torch.from_numpy(concat(val)),
            )
        )
    return partitions, torch.from_numpy(whole[1] if whole is not None else concat(val_parts))


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """A document's training text and held-out tail: the last ``val_fraction`` of its UTF-8 bytes,
    the cut moved back to a character boundary. The byte tokenizer cuts at the same byte (without
    the move, which bytes do not need), so byte-level and BPE runs hold out nearly the same
    bytes and differ at most by the part of one character."""
    data = text.encode("utf-8")
    cut = len(data) - int(len(data) * val_fraction)
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")


def training_texts(corpus: Corpus | Any, val_fraction: float) -> Iterator[str]:
    """Every document's training text, in corpus order: all a tokenizer may be trained on (a
    dataset corpus is read record by record)."""
    for doc in corpus.iter_documents():
        train, _ = split_text(doc.text, val_fraction)
        if train:
            yield train


def training_sha256(texts: Iterator[str]) -> str:
    """sha256 of the training texts in order, each with its length, so the pieces' boundaries count."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        digest.update(f"{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _with_eos(tokens: np.ndarray, eos_id: int | None) -> np.ndarray:
    if eos_id is None or len(tokens) == 0:
        return tokens
    return np.concatenate([tokens, np.asarray([eos_id], dtype=tokens.dtype)])


def _encode_split(
    docs: Sequence[Document], tokenizer: Tokenizer, val_fraction: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per document: its training tokens and its held-out tokens."""
    if isinstance(tokenizer, ByteTokenizer):  # cut in token space = bytes (bit for bit as before)
        encoded = [tokenizer.encode(doc.text) for doc in docs]
        cuts = [len(tokens) - int(len(tokens) * val_fraction) for tokens in encoded]
        return ([tokens[:cut] for tokens, cut in zip(encoded, cuts, strict=True)],
                [tokens[cut:] for tokens, cut in zip(encoded, cuts, strict=True)])
    pieces = [split_text(doc.text, val_fraction) for doc in docs]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    train_texts = [train for train, _ in pieces]
    val_texts = [val for _, val in pieces]
    if encode_batch is not None:
        train_ids, val_ids = encode_batch(train_texts), encode_batch(val_texts)
    else:
        train_ids = [tokenizer.encode(t) for t in train_texts]
        val_ids = [tokenizer.encode(t) for t in val_texts]
    eos = tokenizer.eos_id
    return [_with_eos(t, eos) for t in train_ids], [_with_eos(v, eos) for v in val_ids]


def _plan_from_owner(
    owner: Sequence[int],
    train_items: Sequence[np.ndarray],
    val_items: Sequence[np.ndarray],
    item_groups: Sequence[Sequence[int]],
    parts: int,
) -> list[tuple[list[np.ndarray], list[np.ndarray], list[int]]]:
    """Collect whole items (documents or groups) per owning partition, keeping corpus order."""
    members: list[list[int]] = [[] for _ in range(parts)]
    for item, part in enumerate(owner):
        members[part].append(item)
    return [
        (
            [train_items[i] for i in items],
            [val_items[i] for i in items],
            sorted({g for i in items for g in item_groups[i]}),
        )
        for items in members
    ]


def _plan_iid(
    train_parts: list[np.ndarray],
    val_parts: list[np.ndarray],
    doc_group: list[int],
    parts: int,
    seed: int,
    concat: Concat,
    whole: tuple[np.ndarray, np.ndarray] | None,
) -> list[tuple[list[np.ndarray], list[np.ndarray], list[int]]]:
    rng = np.random.default_rng(seed)
    train, val = whole if whole is not None else (concat(train_parts), concat(val_parts))
    if len(train) < parts * IID_CHUNK_BYTES and len(train) >= parts:
        chunk = len(train) // parts  # tiny corpora: smaller chunks so every partition gets text
    else:
        chunk = IID_CHUNK_BYTES
    val_chunk = max(1, min(IID_CHUNK_BYTES, len(val) // parts))
    train_deal = _deal_chunks(train, chunk, parts, rng)
    val_deal = _deal_chunks(val, val_chunk, parts, rng)
    offsets = (
        np.cumsum([0] + [len(part) for part in train_parts[:-1]]) if train_parts else np.zeros(0)
    )
    group_of_doc = np.asarray(doc_group, dtype=np.int64)
    plan = []
    for p in range(parts):
        covered = _covered_docs(offsets, train_deal[p], chunk, len(train))
        groups = sorted(set(group_of_doc[covered].tolist()))
        plan.append(
            ([_gather(train, train_deal[p], chunk, concat)], [_gather(val, val_deal[p], val_chunk, concat)], groups)
        )
    return plan


def _plan_by_group(
    train_parts: list[np.ndarray],
    val_parts: list[np.ndarray],
    doc_group: list[int],
    num_groups: int,
    parts: int,
    concat: Concat,
) -> list[tuple[list[np.ndarray], list[np.ndarray], list[int]]]:
    group_train = [
        concat([t for t, g in zip(train_parts, doc_group, strict=True) if g == k])
        for k in range(num_groups)
    ]
    group_val = [
        concat([v for v, g in zip(val_parts, doc_group, strict=True) if g == k])
        for k in range(num_groups)
    ]
    if num_groups >= parts:
        owner = (
            list(range(parts))
            if num_groups == parts
            else _greedy_assign([len(tokens) for tokens in group_train], parts)
        )
        return _plan_from_owner(
            owner, group_train, group_val, [[k] for k in range(num_groups)], parts
        )
    plan = []
    for k, count in enumerate(_shares([len(tokens) for tokens in group_train], parts)):
        train_pieces = np.array_split(group_train[k], count)
        val_pieces = np.array_split(group_val[k], count)
        plan.extend(([train_pieces[i]], [val_pieces[i]], [k]) for i in range(count))
    return plan


def make_tokenizer(
    spec: str, corpus: Corpus | None, val_fraction: float, bpe_vocab_size: int, cache_dir: str | Path | None
) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: ``byte``, ``bpe`` (trained on ``corpus``'s training
    text, cached in ``cache_dir``/tokenizers) or a directory holding ``tokenizer.json``."""
    if spec == "byte":
        return ByteTokenizer()
    from fl_geo.data import bpe

    if spec == "bpe":
        if corpus is None:
            raise ValueError("data.tokenizer=bpe needs the corpus to train on")
        sha = training_sha256(training_texts(corpus, val_fraction))
        directory = (Path(cache_dir).expanduser() if cache_dir else default_data_dir()) / "tokenizers"
        return bpe.train_bpe(lambda: training_texts(corpus, val_fraction), sha, bpe_vocab_size, directory)
    path = Path(spec).expanduser()
    if not path.exists() and "/" not in spec and not spec.startswith("."):
        raise ConfigError(f"data.tokenizer {spec!r} is unknown; valid: byte, bpe, or a directory holding tokenizer.json")
    return bpe.load_dir_tokenizer(path)
