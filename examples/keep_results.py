#!/usr/bin/env python
"""Keep the results of a study's finished runs in the repository, without their weights.

    .venv/bin/python examples/keep_results.py OUT ARCHIVE  # e.g. /work/mt docs/results/method-table.tar.gz

A study (examples/long_budget_study.sh, examples/method_table.sh, ...) writes each run to a folder
of tens of MB: checkpoints, every site's optimizer state, the final weights. What its tables are
computed from is four small files: ``config.yaml`` (what ran), ``meta.json`` (the versions, the
corpus and tokenizer hashes, the parameter count), ``metrics.jsonl`` (every logged record) and
``summary.json`` (written last: the run finished). This adds those four files of every finished
run under OUT to the gzipped tar ARCHIVE, at their paths relative to OUT, and nothing else.

Why an archive and not a folder: the files are JSON, JSONL and YAML, which Flower packs into the
app bundle of ``flwr run`` (its size limit is 10 MB; a folder of kept studies would be shipped
with every deployment), and the metrics compress about 8x. The archive is written
deterministically (sorted members, no timestamps), so keeping the same runs again changes no byte.

Why: the figures in docs/ and the README's method table must be re-derivable by a reader, and a
study of many hours must be able to continue on another machine. A kept run folder is what both
need:

- extracted (``tar xzf ARCHIVE -C DIR``), ``fl-geo compare --runs DIR/.../runs/*-seed=[0-9]`` and
  examples/method_table_report.py read it as they read the original (they use only those files);
- extracted into a study's OUT, ``fl-geo run --resume`` finds it finished with the same config and
  reuses it instead of running it again (fl_geo/run_reuse.py), so the study script runs only the
  cells still missing.

Rules: a folder without ``summary.json`` (still running, or killed) is skipped and named. A run
already kept with the same bytes is left as it is. A run kept with *different* bytes is refused with
a one-line error naming it (asynchronous runs of one seed are not bit-identical across machines, so
a kept figure is never replaced silently); ``--replace`` overwrites it. Exit status 0, or 1 with
the error.
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

KEPT_FILES = ("config.yaml", "meta.json", "metrics.jsonl", "summary.json")
REQUIRED = ("config.yaml", "metrics.jsonl", "summary.json")


@dataclass
class KeepReport:
    """What `keep_results` did: runs copied, runs already kept unchanged, unfinished folders skipped,
    and the bytes copied."""

    copied: list[Path] = field(default_factory=list)
    unchanged: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)
    bytes_copied: int = 0


class KeepError(Exception):
    """A kept run would be replaced by different results (without ``replace``), or OUT is missing."""


def run_dirs(out: Path) -> tuple[list[Path], list[Path]]:
    """(finished, unfinished) run folders under ``out``: a folder with ``config.yaml`` is a run (one
    is written when a run starts); it is finished when ``metrics.jsonl`` and ``summary.json`` are there
    too. Folders inside a run (checkpoints, client state) are not searched, nor runs a resume moved
    aside (``<name>.interrupted-<epoch>``)."""
    finished: list[Path] = []
    unfinished: list[Path] = []
    todo = [out]
    while todo:
        folder = todo.pop()
        if (folder / "config.yaml").is_file():  # a run: classify it, do not look inside
            if ".interrupted-" not in folder.name:
                (finished if all((folder / n).is_file() for n in REQUIRED) else unfinished).append(folder)
            continue
        todo.extend(child for child in folder.iterdir() if child.is_dir())
    return sorted(finished), sorted(unfinished)


def read_archive(archive: Path) -> dict[str, bytes]:
    """Every member of a kept-results archive: its path -> its bytes ({} when there is none yet).
    Raises KeepError for a damaged one."""
    if not archive.is_file():
        return {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    except (tarfile.TarError, OSError, EOFError) as exc:  # a damaged archive is refused, never overwritten
        raise KeepError(f"{archive}: not a readable kept-results archive ({exc})") from None


def write_archive(archive: Path, members: dict[str, bytes]) -> None:
    """Write ``members`` as a gzipped tar, deterministically (sorted, no times or owners), through a
    temporary file and a rename, so a failure leaves the previous archive whole."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(members[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(members[name]))
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, archive)


def keep_results(out: Path, archive: Path, replace: bool = False) -> KeepReport:
    """Add `KEPT_FILES` of every finished run under ``out`` to ``archive`` at its path relative to
    ``out`` (module docstring). Every run is checked before anything is written, so a refusal
    leaves the archive as it was."""
    out, archive = Path(out), Path(archive)
    if not out.is_dir():
        raise KeepError(f"{out}: no such folder (the study's OUT)")
    finished, unfinished = run_dirs(out)
    report = KeepReport(unfinished=unfinished)
    members = read_archive(archive)
    changed = False
    for run in finished:
        rel = run.relative_to(out).as_posix()
        ours = {f"{rel}/{n}": (run / n).read_bytes() for n in KEPT_FILES if (run / n).is_file()}
        kept = {k: v for k, v in members.items() if k.rpartition("/")[0] == rel}
        if kept == ours:
            report.unchanged.append(archive / rel)
            continue
        if f"{rel}/summary.json" in kept and not replace:
            differ = [k.rpartition("/")[2] for k in sorted(set(ours) | set(kept)) if ours.get(k) != kept.get(k)]
            raise KeepError(f"{archive}: {rel} is already kept with other results ({', '.join(differ)} differ); "
                            f"--replace to overwrite it")
        for k in kept:
            del members[k]
        members.update(ours)
        report.bytes_copied += sum(len(v) for v in ours.values())
        report.copied.append(archive / rel)
        changed = True
    if changed:
        write_archive(archive, members)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the study's output folder (searched for finished runs)")
    parser.add_argument("archive", type=Path, help="the archive to add them to, e.g. docs/results/<study>.tar.gz")
    parser.add_argument("--replace", action="store_true", help="overwrite kept runs whose results differ")
    args = parser.parse_args(argv)
    try:
        report = keep_results(args.out, args.archive, args.replace)
    except KeepError as exc:
        print(f"keep_results: {exc}", file=sys.stderr)
        return 1
    for run in report.unfinished:
        print(f"skipped {run}: no summary.json (still running, or killed)", file=sys.stderr)
    size = args.archive.stat().st_size / 1e6 if args.archive.is_file() else 0.0
    print(f"kept {len(report.copied)} run(s) in {args.archive} ({report.bytes_copied / 1e6:.2f} MB of files; "
          f"the archive is {size:.2f} MB), "
          f"{len(report.unchanged)} already kept, {len(report.unfinished)} unfinished skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
