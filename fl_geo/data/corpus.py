"""Text corpora as ordered lists of documents with a natural group label.

The group is what makes a corpus useful for geo-distributed training: it is the non-IID axis along
which datacenters are split (Bible translation, Shakespeare spelling/author, stdlib package, file).
Every corpus carries a sha256 of its text so a run's metadata pins exactly which data it saw.

Fetched corpora (``bible``, ``shakespeare``) are read through the ``MANIFEST.json`` that
:mod:`fl_geo.data.fetch` writes last: a corpus directory without a complete manifest is treated as
absent, so a half-written extraction is never trained on.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fl_geo.errors import ConfigError

__all__ = [
    "CORPUS_NAMES",
    "Corpus",
    "Document",
    "PYDOC_TOPICS_ENV",
    "corpus_digest",
    "default_data_dir",
    "fetch_command",
    "load_corpus",
    "read_manifest",
]

logger = logging.getLogger(__name__)

CORPUS_NAMES = ("auto", "bible", "shakespeare", "stdlib", "pydoc", "files", "jsonl", "parquet", "arrow")
DATASET_CORPORA = ("jsonl", "parquet", "arrow")  # read through `datasets` (fl_geo.data.local_datasets)
FETCHED_CORPORA = ("bible", "shakespeare")
MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = 1
STDLIB_CAP_BYTES = 12_000_000
STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})


@dataclass(frozen=True)
class Document:
    """One unit of text; validation data is cut from the end of every document."""

    name: str
    group: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """An ordered collection of documents; the order is part of its identity (and its hash)."""

    name: str
    documents: list[Document] = field(repr=False)
    sha256: str

    @property
    def groups(self) -> list[str]:
        """Distinct groups in order of first appearance."""
        return list(dict.fromkeys(doc.group for doc in self.documents))

    @property
    def num_chars(self) -> int:
        return sum(len(doc.text) for doc in self.documents)

    def iter_documents(self) -> Iterator[Document]:
        """The documents one by one (the interface the token store reads, `fl_geo.data.store`)."""
        return iter(self.documents)


def corpus_digest(documents: Iterable[Document]) -> str:
    """sha256 over the documents' text in order.

    Each document contributes a ``group/name`` header and its UTF-8 length before its text, so
    moving text between documents or regrouping them changes the hash (plain concatenation would
    not notice).
    """
    digest = hashlib.sha256()
    for doc in documents:
        data = doc.text.encode("utf-8")
        digest.update(f"{doc.group}/{doc.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def default_data_dir() -> Path:
    """``$FL_GEO_DATA_DIR`` if set, else ``~/.cache/fl-geo/corpora``."""
    env = os.environ.get("FL_GEO_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fl-geo" / "corpora"


def _resolve_dir(data_dir: str | Path | None) -> Path:
    return Path(data_dir).expanduser() if data_dir is not None else default_data_dir()


def fetch_command(name: str, data_dir: str | Path | None = None) -> str:
    """The exact shell command that fetches corpus ``name`` into ``data_dir``."""
    target = _resolve_dir(data_dir)
    return (
        f"fl-geo data fetch --data-dir {target} {name}"
        f"  (or: python -m fl_geo.data.fetch --data-dir {target} {name})"
    )


def read_manifest(corpus_dir: Path) -> dict | None:
    """The manifest of a fetched corpus if it is complete (every listed file present with its
    recorded size), else ``None``. Sizes, not hashes: this runs on every load and must be cheap;
    the text hash is verified when the documents are read."""
    path = Path(corpus_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    if not manifest.get("complete") or not manifest.get("documents"):
        return None
    for entry in manifest["documents"]:
        file = Path(corpus_dir) / entry["path"]
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            return None
    return manifest


def _load_fetched(name: str, data_dir: Path) -> Corpus:
    corpus_dir = data_dir / name
    manifest = read_manifest(corpus_dir)
    if manifest is None:
        raise FileNotFoundError(
            f"corpus {name!r} is not present in {corpus_dir} (no complete {MANIFEST_NAME}); "
            f"fetch it with: {fetch_command(name, data_dir)}"
        )
    documents = [
        Document(
            name=entry["name"],
            group=entry["group"],
            text=(corpus_dir / entry["path"]).read_text(encoding="utf-8"),
        )
        for entry in manifest["documents"]
    ]
    sha = corpus_digest(documents)
    if sha != manifest["text_sha256"]:
        raise ConfigError(
            f"corpus {name!r} in {corpus_dir} does not match its manifest hash (files edited or "
            f"corrupted); delete {corpus_dir} and re-fetch with: {fetch_command(name, data_dir)}"
        )
    return Corpus(name=name, documents=documents, sha256=sha)


def _stdlib_files(root: Path, cap_bytes: int) -> list[Path]:
    """Sorted stdlib sources without tests, idlelib or third-party packages, up to ``cap_bytes``.

    Excluded directories are pruned during the walk: ``site-packages`` alone can hold ten times
    more files than the standard library.
    """
    candidates: list[tuple[str, Path]] = []
    for folder, subdirs, filenames in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in STDLIB_EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = Path(folder) / filename
                candidates.append((path.relative_to(root).as_posix(), path))
    chosen: list[Path] = []
    total = 0
    for _, path in sorted(candidates):
        size = path.stat().st_size
        if total + size > cap_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _load_stdlib(cap_bytes: int = STDLIB_CAP_BYTES) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in _stdlib_files(root, cap_bytes):
        rel = path.relative_to(root)
        group = rel.parts[0].removesuffix(".py")
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            documents.append(Document(name=rel.as_posix(), group=group, text=text))
    if not documents:
        raise FileNotFoundError(f"no Python standard library sources found under {root}")
    return Corpus(name="stdlib", documents=documents, sha256=corpus_digest(documents))


# A JSON file of pydoc topics ({"topic": "text", ...}, gzipped if it ends in .gz) that the ``pydoc``
# corpus reads instead of the running Python's `pydoc_data.topics`. That text changes between
# Python patch releases (3.11.2 and 3.11.7 differ by ~1,000 characters), and so does every number
# trained on it; the test suite pins the topics it was recorded with (tests/conftest.py).
PYDOC_TOPICS_ENV = "FL_GEO_PYDOC_TOPICS"


def _pydoc_topics() -> dict[str, str]:
    """The pydoc topics: the file ``$FL_GEO_PYDOC_TOPICS`` names, else this Python's."""
    path = os.environ.get(PYDOC_TOPICS_ENV, "").strip()
    if not path:
        from pydoc_data.topics import topics

        return topics
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            topics = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"{PYDOC_TOPICS_ENV}={path}: cannot read the pydoc topics ({exc})") from None
    if (not isinstance(topics, dict) or not topics
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in topics.items())):
        raise ConfigError(f"{PYDOC_TOPICS_ENV}={path}: expected a JSON object of topic names to texts")
    return topics


def _load_pydoc() -> Corpus:
    topics = _pydoc_topics()
    documents = [Document(name=key, group=key, text=topics[key]) for key in sorted(topics)]
    return Corpus(name="pydoc", documents=documents, sha256=corpus_digest(documents))


def _expand_files(patterns: Sequence[str | Path]) -> list[Path]:
    paths: list[Path] = []
    for pattern in patterns:
        text = str(Path(pattern).expanduser())
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise FileNotFoundError(f"no file matches {str(pattern)!r}")
        paths.extend(Path(match) for match in matches if Path(match).is_file())
    return list(dict.fromkeys(paths))


def _read_jsonl(path: Path, text_key: str) -> list[Document]:
    documents = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{lineno}: record has no string field {text_key!r} (it has: {keys}); "
                                  "set data.text_key to the field that holds the text")
            if record[text_key]:
                documents.append(
                    Document(name=f"{path.stem}:{lineno}", group=path.stem, text=record[text_key])
                )
    return documents


def _load_files(files: Sequence[str | Path] | None, text_key: str) -> Corpus:
    if not files:
        raise ConfigError("corpus 'files' needs a list of .txt/.jsonl paths or globs in `files`")
    documents: list[Document] = []
    for path in _expand_files(files):
        suffix = path.suffix.lower()
        if suffix == ".txt":
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                documents.append(Document(name=path.stem, group=path.stem, text=text))
        elif suffix == ".jsonl":
            documents.extend(_read_jsonl(path, text_key))
        else:
            raise ConfigError(f"unsupported file type {path.name!r} in data.files: use .txt or .jsonl")
    if not documents:
        raise ConfigError(f"the files {list(map(str, files))} contain no text")
    return Corpus(name="files", documents=documents, sha256=corpus_digest(documents))


def load_corpus(
    name: str,
    data_dir: str | Path | None = None,
    files: list[str] | None = None,
    text_key: str = "text",
    path: str = "",
    text_field: str = "text",
) -> Corpus:
    """Load corpus ``name`` (one of :data:`CORPUS_NAMES`).

    ``jsonl`` / ``parquet`` / ``arrow`` (``path``, ``text_field``) give a lazily read
    `fl_geo.data.local_datasets.DatasetCorpus` instead (same ``name`` / ``sha256`` / ``groups``;
    documents through ``iter_documents()``), which the token store tokenises to disk.

    ``auto`` picks ``bible`` when it has been fetched into ``data_dir`` and otherwise falls back to
    the always-present Python standard library, so a fresh checkout can train without network.
    """
    directory = _resolve_dir(data_dir)
    if name == "auto":
        if read_manifest(directory / "bible") is not None:
            return _load_fetched("bible", directory)
        logger.warning(
            "corpus 'auto': the Bible corpus is not in %s, using the Python stdlib instead; "
            "fetch the Bible with: %s",
            directory,
            fetch_command("bible", directory),
        )
        return _load_stdlib()
    if name in FETCHED_CORPORA:
        return _load_fetched(name, directory)
    if name == "stdlib":
        return _load_stdlib()
    if name == "pydoc":
        return _load_pydoc()
    if name == "files":
        return _load_files(files, text_key)
    if name in DATASET_CORPORA:
        from fl_geo.data.local_datasets import load_dataset_corpus

        return load_dataset_corpus(name, path, text_field)  # type: ignore[return-value]
    raise ConfigError(f"unknown corpus {name!r}; expected one of {', '.join(CORPUS_NAMES)}")
