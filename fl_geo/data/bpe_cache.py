"""The trained-BPE cache file: the tokenizer wrapped with what it claims to be, checked on every use.

A cache entry is one JSON file, ``tokenizers/bpe-<key>.json``::

    {"fl_geo_bpe_cache": 2, "key": "<full cache key>", "settings": {...},
     "sha256": "<sha256 of the tokenizer text>", "tokenizer": "<the tokenizers library's JSON>"}

The key is the sha256 of the training text's hash and every setting of the recipe
(`fl_geo.data.bpe.bpe_cache_key`); ``settings`` spells them out for a reader. A file is used only
if it parses, carries this format, names the key the caller asked for (a valid entry copied under
another entry's name is refused) and its tokenizer text hashes to the recorded digest (an edited
vocabulary, another valid tokenizer pasted in, a truncated file, garbage: all refused). A refused
file is *rebuilt*, never used and never a traceback: `read_entry` says why (the caller logs it at
WARNING, naming the file) and the caller trains again and replaces it. The entry is derived data,
so rebuilding is always safe; it costs one BPE training.

Entries are written with `fl_geo.atomic.atomic_path` under a per-process temporary name, since
every node of a run may train the same entry at the same moment.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fl_geo.atomic import atomic_path

__all__ = ["CACHE_FORMAT", "read_entry", "write_entry"]

CACHE_FORMAT = 2  # the envelope's own version (1: the bare tokenizers file, before entries were checked)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_entry(path: Path, key: str) -> tuple[str | None, str]:
    """``(tokenizer text, "")`` when ``path`` holds a verified entry for ``key``; ``(None, why)``
    otherwise (``why`` is empty when the file does not exist, a phrase when it was refused)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    try:
        entry = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None, "not JSON (damaged or not a cache entry)"
    if not isinstance(entry, dict) or entry.get("fl_geo_bpe_cache") != CACHE_FORMAT:
        return None, f"not an fl-geo BPE cache entry of format {CACHE_FORMAT} (a bare or foreign tokenizer file)"
    if entry.get("key") != key:
        return None, "an entry for other training text or settings (its key differs from its name's)"
    text, digest = entry.get("tokenizer"), entry.get("sha256")
    if not isinstance(text, str) or not isinstance(digest, str) or _digest(text) != digest:
        return None, "its tokenizer does not match the sha256 recorded with it (edited or damaged)"
    return text, ""


def write_entry(path: Path, key: str, settings: dict[str, Any], tokenizer_text: str) -> None:
    """Write the entry for ``key`` atomically (a full disk is a one-line `OutputError`)."""
    entry = {"fl_geo_bpe_cache": CACHE_FORMAT, "key": key, "settings": settings,
             "sha256": _digest(tokenizer_text), "tokenizer": tokenizer_text}
    with atomic_path(path, shared=True) as tmp:
        tmp.write_text(json.dumps(entry, sort_keys=True), encoding="utf-8")
