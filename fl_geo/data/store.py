"""A corpus tokenised once into memory-mapped token files on disk, for corpora larger than memory.

Dataset corpora (``data.corpus: jsonl | parquet | arrow``) are streamed record by record, each
document split into its training text and held-out tail (`fl_geo.data.partition.split_text`),
encoded a batch of documents at a time and appended to ``train.bin`` / ``val.bin`` (uint8, uint16
or int32 ids: the smallest that holds the vocabulary), with every document ending in the
tokenizer's end-of-text id (sequence packing: windows then span document boundaries, as in
GPT-style pre-training). Per-document lengths and groups go to ``index.npz``; ``meta.json`` is
written last (with each file's size and sha256) and the directory appears by one rename, so a
half-written store is never read; every process checks a store before mapping it
(`fl_geo.data.store_check`) and rebuilds one that fails, with a WARNING naming it. The
store's directory name is a hash of the corpus's sha256, the tokenizer's sha256 and the held-out
fraction: every process and every later run with the same inputs reuses it.

Partitions are cut from the memory maps. Joining pieces (a partition's documents, a group's
text) writes them to an anonymous memory-mapped file (created, mapped, unlinked), so memory holds
at most one piece at a time and the training sampler pages windows in on demand.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_geo.data.partition import Partition, _encode_split, partition_tokens
from fl_geo.data.store_check import StoreDamaged, file_record, move_aside, read_meta, verify_store
from fl_geo.data.tokenizer import Tokenizer
from fl_geo.errors import OutputError

log = logging.getLogger("fl_geo")

__all__ = ["STORE_FORMAT", "DiskConcat", "TokenStore", "build_store", "partition_store", "token_dtype"]

STORE_FORMAT = 2  # 2: meta.json records each file's size and sha256 (fl_geo.data.store_check)
ENCODE_BATCH = 512  # documents encoded (and held in memory) at once
_WRITE_CHUNK = 1 << 24  # elements per write of a large piece


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest id type for ``vocab_size`` tokens."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """Read-only-in-effect map of ``path`` (copy-on-write, so torch sees a writable array and no
    write ever reaches the file); an empty file gives an empty array (mmap refuses size 0)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="c", shape=(count,))


@dataclass
class TokenStore:
    """The tokenised corpus: all training tokens, all held-out tokens, per-document lengths."""

    directory: Path
    train: np.ndarray
    val: np.ndarray
    train_lens: np.ndarray
    val_lens: np.ndarray
    doc_group: np.ndarray
    groups: list[str]

    def parts(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per-document views into the maps (no copies)."""
        t_off = np.concatenate([[0], np.cumsum(self.train_lens)])
        v_off = np.concatenate([[0], np.cumsum(self.val_lens)])
        train = [self.train[t_off[i]:t_off[i + 1]] for i in range(len(self.train_lens))]
        val = [self.val[v_off[i]:v_off[i + 1]] for i in range(len(self.val_lens))]
        return train, val


def open_store(directory: Path, expect: dict[str, Any]) -> TokenStore:
    """Map the store in ``directory`` after `fl_geo.data.store_check` has verified it against
    ``expect`` (its meta's format, corpus, tokenizer, held-out fraction); raises `StoreDamaged`."""
    meta = read_meta(directory, expect)
    verify_store(directory, meta)
    dtype = np.dtype(meta["dtype"])
    with np.load(directory / "index.npz") as index:
        lens = {k: index[k] for k in ("train_lens", "val_lens", "doc_group")}
    return TokenStore(
        directory=directory,
        train=_memmap(directory / "train.bin", dtype, int(meta["train_tokens"])),
        val=_memmap(directory / "val.bin", dtype, int(meta["val_tokens"])),
        train_lens=lens["train_lens"], val_lens=lens["val_lens"], doc_group=lens["doc_group"],
        groups=list(meta["groups"]),
    )


def store_key(corpus_sha256: str, tokenizer_sha256: str, val_fraction: float) -> str:
    text = json.dumps({"format": STORE_FORMAT, "corpus": corpus_sha256, "tokenizer": tokenizer_sha256,
                       "val_fraction": float(val_fraction)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def build_store(corpus: object, tokenizer: Tokenizer, val_fraction: float, cache_dir: Path) -> TokenStore:
    """The token store of ``corpus`` (anything with ``sha256`` and ``iter_documents()``), from the
    cache when it exists, else streamed from the corpus and written there."""
    key = store_key(corpus.sha256, tokenizer.sha256, val_fraction)  # type: ignore[attr-defined]
    directory = Path(cache_dir) / f"tokens-{key[:32]}"
    expect = {"format": STORE_FORMAT, "corpus_sha256": corpus.sha256,  # type: ignore[attr-defined]
              "tokenizer_sha256": tokenizer.sha256, "val_fraction": float(val_fraction)}
    if (directory / "meta.json").is_file():
        try:
            return open_store(directory, expect)
        except StoreDamaged as exc:  # derived data: rebuilt, never used
            log.warning("fl-geo: token store refused (%s); building it again from the corpus", exc)
            move_aside(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", suffix=".tmp", dir=directory.parent))
    dtype = token_dtype(tokenizer.vocab_size)
    groups: dict[str, int] = {}
    train_lens: list[int] = []
    val_lens: list[int] = []
    doc_group: list[int] = []
    try:
        # the ids are hashed as they are written, so recording the checksums costs no second read
        digests = {"train.bin": hashlib.sha256(), "val.bin": hashlib.sha256()}
        with (tmp / "train.bin").open("wb") as f_train, (tmp / "val.bin").open("wb") as f_val:
            batch: list = []

            def flush() -> None:
                train, val = _encode_split(batch, tokenizer, val_fraction)
                for doc, t, v in zip(batch, train, val, strict=True):
                    t_bytes, v_bytes = np.asarray(t, dtype=dtype).tobytes(), np.asarray(v, dtype=dtype).tobytes()
                    f_train.write(t_bytes)
                    f_val.write(v_bytes)
                    digests["train.bin"].update(t_bytes)
                    digests["val.bin"].update(v_bytes)
                    train_lens.append(len(t))
                    val_lens.append(len(v))
                    doc_group.append(groups.setdefault(doc.group, len(groups)))
                batch.clear()

            for doc in corpus.iter_documents():  # type: ignore[attr-defined]
                batch.append(doc)
                if len(batch) >= ENCODE_BATCH:
                    flush()
            flush()
        np.savez(tmp / "index.npz", train_lens=np.asarray(train_lens, dtype=np.int64),
                 val_lens=np.asarray(val_lens, dtype=np.int64), doc_group=np.asarray(doc_group, dtype=np.int64))
        meta = {"format": STORE_FORMAT, "dtype": dtype.name, "train_tokens": int(sum(train_lens)),
                "val_tokens": int(sum(val_lens)), "documents": len(train_lens), "groups": list(groups),
                "corpus_sha256": corpus.sha256, "tokenizer_sha256": tokenizer.sha256,  # type: ignore[attr-defined]
                "val_fraction": float(val_fraction),
                "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": digests[name].hexdigest()}
                          for name in digests} | {"index.npz": file_record(tmp / "index.npz")}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            tmp.rename(directory)
        except OSError:  # another process finished the same store first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):  # e.g. a corpus file gone: not ours to word
            raise
        # a full disk while tokenising: nothing half-written stays
        raise OutputError(f"cannot write the token store {directory}: {exc.strerror or exc} (free space there "
                          "or point data.data_dir elsewhere)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        return open_store(directory, expect)
    except StoreDamaged as exc:  # just written: the disk or another writer is at fault
        raise OutputError(f"the token store just built does not verify ({exc}); check the disk under "
                          f"{directory.parent}") from None


class DiskConcat:
    """Joins token pieces into an anonymous memory-mapped file in ``directory`` (written piece by
    piece, mapped, then unlinked: the mapping keeps it alive and nothing is left behind). One
    piece is returned as it is (a view of the store)."""

    def __init__(self, directory: Path, dtype: np.dtype) -> None:
        self.directory = Path(directory)
        self.dtype = np.dtype(dtype)

    def __call__(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
        if len(pieces) == 1:
            return pieces[0]
        total = sum(len(p) for p in pieces)
        if total == 0:
            return np.zeros(0, dtype=self.dtype)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.directory, suffix=".bin")
        try:
            with os.fdopen(fd, "wb") as out:
                for piece in pieces:
                    for start in range(0, len(piece), _WRITE_CHUNK):
                        out.write(np.ascontiguousarray(piece[start:start + _WRITE_CHUNK], dtype=self.dtype).tobytes())
            return np.memmap(name, dtype=self.dtype, mode="c", shape=(total,))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name)


def partition_store(store: TokenStore, name: str, num_partitions: int, scheme: str,
                    seed: int) -> tuple[list[Partition], torch.Tensor]:
    """`fl_geo.data.partition.partition_corpus` on the store: same schemes, same results as the
    in-memory path for the same tokens, with joins written to disk instead of memory."""
    train, val = store.parts()
    concat = DiskConcat(store.directory.parent / "scratch", store.train.dtype)
    return partition_tokens(name, train, val, [int(g) for g in store.doc_group], store.groups, num_partitions,
                            scheme, seed, concat=concat, whole=(store.train, store.val))
