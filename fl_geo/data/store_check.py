"""Checks that a token store on disk is what its ``meta.json`` says, before a run trains on it.

A store (`fl_geo.data.store`) is derived data read by every process of every later run, so a
damaged one would train silently on wrong tokens: a few ids flipped by a bad disk or a stray
write, ``meta.json`` edited (a token count of 100 maps only the first 100 tokens and the run
trains on those), a file truncated or swapped with another store's. ``meta.json`` therefore
records each data file's size and sha256, and `verify_store` checks, in this order:

1. ``meta.json`` parses, is of this format, and names the corpus, tokenizer and held-out fraction
   the caller asked for (a meta copied from another store is refused);
2. every file's size is the recorded one, and ``train.bin`` / ``val.bin`` hold exactly
   ``train_tokens`` / ``val_tokens`` ids of ``dtype`` (an edited count is refused here, for free);
3. ``index.npz`` loads and its per-document lengths sum to those counts;
4. every file's sha256 is the recorded one (a single flipped id is refused).

Step 4 reads the files once; the result is remembered per process for the file's identity
(device, inode, size, mtime), so the many `build_store` calls of one process cost one pass. It is
a sequential read at sha256 speed (measured in docs/data.md). A check that fails raises
`StoreDamaged` with the reason; the caller rebuilds the store.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DATA_FILES", "StoreDamaged", "file_record", "forget_verified", "move_aside", "read_meta", "sha256_of",
           "verify_store"]

DATA_FILES = ("train.bin", "val.bin", "index.npz")

_verified: set[tuple[str, int, int, int, int]] = set()  # (path, dev, inode, size, mtime_ns) hashed OK


class StoreDamaged(ValueError):
    """A token store that must not be used; the message says which file and why."""


def sha256_of(path: Path) -> str:
    """sha256 of a file, read in large sequential chunks (``hashlib.file_digest``)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What ``meta.json`` records of one data file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def _identity(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_meta(directory: Path, expect: dict[str, Any]) -> dict[str, Any]:
    """``meta.json`` of the store in ``directory``, checked against ``expect`` (format, corpus,
    tokenizer, held-out fraction: step 1 of the module docstring)."""
    path = directory / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreDamaged(f"{path} is unreadable or not JSON ({exc.__class__.__name__})") from None
    if not isinstance(meta, dict):
        raise StoreDamaged(f"{path} is not a JSON object")
    for key, want in expect.items():
        if meta.get(key) != want:
            raise StoreDamaged(f"{path}: {key} is {meta.get(key)!r}, this store's name says {want!r}")
    if not isinstance(meta.get("files"), dict):
        raise StoreDamaged(f"{path} records no file checksums")
    try:
        np.dtype(meta["dtype"])
        for key in ("train_tokens", "val_tokens"):
            if not isinstance(meta[key], int) or meta[key] < 0:
                raise StoreDamaged(f"{path}: {key} is {meta[key]!r}, not a count")
    except (KeyError, TypeError) as exc:
        raise StoreDamaged(f"{path}: missing or bad field ({exc})") from None
    return meta


def verify_store(directory: Path, meta: dict[str, Any]) -> None:
    """Steps 2 to 4 of the module docstring for the store in ``directory``; raises `StoreDamaged`."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    counts = {"train.bin": meta["train_tokens"], "val.bin": meta["val_tokens"]}
    for name in DATA_FILES:
        path, record = directory / name, meta["files"].get(name)
        if not isinstance(record, dict):
            raise StoreDamaged(f"{directory / 'meta.json'} records nothing for {name}")
        try:
            size = path.stat().st_size
        except OSError:
            raise StoreDamaged(f"{path} is missing") from None
        if size != record.get("bytes"):
            raise StoreDamaged(f"{path} holds {size} bytes, meta.json recorded {record.get('bytes')}")
        if name in counts and size != counts[name] * itemsize:
            raise StoreDamaged(f"{path} holds {size // itemsize} ids of {meta['dtype']}, meta.json says "
                               f"{counts[name]}")
    try:
        with np.load(directory / "index.npz") as index:
            sums = int(index["train_lens"].sum()), int(index["val_lens"].sum())
    except (OSError, ValueError, KeyError) as exc:
        raise StoreDamaged(f"{directory / 'index.npz'} does not load ({exc.__class__.__name__})") from None
    if sums != (meta["train_tokens"], meta["val_tokens"]):
        raise StoreDamaged(f"{directory / 'index.npz'}: document lengths sum to {sums}, meta.json says "
                           f"{(meta['train_tokens'], meta['val_tokens'])}")
    for name in DATA_FILES:
        path = directory / name
        ident = _identity(path)
        if ident in _verified:
            continue
        if sha256_of(path) != meta["files"][name].get("sha256"):
            raise StoreDamaged(f"{path} does not match the sha256 recorded in meta.json (damaged or edited)")
        _verified.add(ident)


def forget_verified() -> None:
    """Drop the per-process memory of verified files (tests that damage a file in place)."""
    _verified.clear()


def move_aside(directory: Path) -> None:
    """Take a damaged store out of the way by one rename (then delete it), so a concurrent
    reader never sees a half-deleted store under the real name."""
    import shutil
    import tempfile

    try:
        aside = Path(tempfile.mkdtemp(prefix=directory.name + ".damaged.", dir=directory.parent))
        os.replace(directory, aside / "store")
    except OSError:
        return  # another process moved it first
    shutil.rmtree(aside, ignore_errors=True)
