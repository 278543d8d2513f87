"""Local JSONL / Parquet / Arrow files read through Hugging Face ``datasets``, one record at a time.

``data.corpus: jsonl | parquet | arrow`` with ``data.path`` (a file, a glob or a directory) and
``data.text_field`` (the column holding the text, default ``text``). Files are read in streaming
mode, record by record, so a corpus larger than memory is never held as a whole: the token store
(`fl_geo.data.store`) writes its tokens to disk as they come. Local files only: ``datasets`` is
switched to offline mode before it is imported, and no hub name is ever passed to it. Each file
is one group (the non-IID axis of ``data.partition: by_group``), as for ``data.corpus: files``.

``datasets`` is an optional extra (``pip install 'fl-geo[data]'``), imported only here.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.data.corpus import Document
from fl_geo.errors import ConfigError

__all__ = ["DATASET_FORMATS", "DatasetCorpus", "load_dataset_corpus"]

# data.corpus -> (datasets' builder, file suffixes a directory is searched for)
DATASET_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "jsonl": ("json", (".jsonl", ".json")),
    "parquet": ("parquet", (".parquet",)),
    "arrow": ("arrow", (".arrow",)),
}
_HASH_CHUNK = 1 << 20


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.corpus=jsonl|parquet|arrow needs the `datasets` package: "
                          "pip install 'fl-geo[data]'") from None
    datasets.disable_progress_bars()
    return datasets


def _files(kind: str, path: str) -> list[Path]:
    suffixes = DATASET_FORMATS[kind][1]
    target = Path(path).expanduser()
    if target.is_dir():
        found = sorted(p for p in target.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    else:
        found = sorted(Path(m) for m in glob.glob(str(target), recursive=True) if Path(m).is_file())
    if not found:
        raise ConfigError(f"data.path {path!r} matches no {'/'.join(suffixes)} file for data.corpus={kind}")
    return found


@dataclass(frozen=True)
class DatasetCorpus:
    """A corpus of local dataset files, read lazily: ``sha256`` covers the files' bytes, the
    format and the text field, so the token store's cache follows any change to them."""

    name: str
    files: tuple[Path, ...]
    text_field: str
    sha256: str

    @property
    def groups(self) -> list[str]:
        return list(dict.fromkeys(f.stem for f in self.files))

    def iter_documents(self) -> Iterator[Document]:
        """Every non-empty text of every file, in file then record order."""
        datasets = _datasets()
        builder = DATASET_FORMATS[self.name][0]
        for file in self.files:
            ds = datasets.load_dataset(builder, data_files=[str(file)], split="train", streaming=True)
            for i, record in enumerate(ds):
                text = record.get(self.text_field)
                if not isinstance(text, str):
                    keys = ", ".join(map(str, record))
                    raise ConfigError(f"{file}: record {i} has no string field data.text_field="
                                      f"{self.text_field!r} (it has: {keys})")
                if text:
                    yield Document(name=f"{file.stem}:{i}", group=file.stem, text=text)


def load_dataset_corpus(kind: str, path: str, text_field: str = "text") -> DatasetCorpus:
    """The files of ``data.path`` for ``data.corpus=kind``; reads only their bytes (for the hash)."""
    if kind not in DATASET_FORMATS:
        raise ConfigError(f"data.corpus {kind!r} is not a dataset format; valid: {', '.join(DATASET_FORMATS)}")
    if not path:
        raise ConfigError(f"data.corpus={kind} needs data.path (a file, glob or directory)")
    files = _files(kind, path)
    digest = hashlib.sha256(f"{kind}\0{text_field}\0".encode())
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return DatasetCorpus(name=kind, files=tuple(files), text_field=text_field, sha256=digest.hexdigest())
