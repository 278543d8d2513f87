#!/usr/bin/env python
"""Keep the results of a study's finished runs in the repository, without their weights.

    .venv/bin/python examples/keep_results.py OUT DEST     # e.g. /work/mt docs/results/method-table

A study (examples/long_budget_study.sh, examples/method_table.sh, ...) writes each run to a folder
of tens of MB: checkpoints, every site's optimizer state, the final weights. What its tables are
computed from is four small files: ``config.yaml`` (what ran), ``meta.json`` (the versions, the
corpus and tokenizer hashes, the parameter count), ``metrics.jsonl`` (every logged record) and
``summary.json`` (written last: the run finished). This copies those four files of every finished
run under OUT to the same relative path under DEST, and nothing else.

Why: the figures in docs/ and the README's method table must be re-derivable by a reader, and a
study of many hours must be able to continue on another machine. A kept run folder is what both
need:

- ``fl-geo compare --runs DEST/.../runs/*-seed=[0-9]`` and examples/method_table_report.py read it
  as they read the original (they use only those files);
- copied back into a study's OUT (``cp -r DEST/. OUT/``), ``fl-geo run --resume`` finds it finished
  with the same config and reuses it instead of running it again (fl_geo/run_reuse.py), so the
  study script runs only the cells still missing.

Rules: a folder without ``summary.json`` (still running, or killed) is skipped and named. A run
already kept with the same bytes is left as it is. A run kept with *different* bytes is refused with
a one-line error naming it (asynchronous runs of one seed are not bit-identical across machines, so
a kept figure is never replaced silently); ``--replace`` overwrites it. Exit status 0, or 1 with
the error.
"""

from __future__ import annotations

import argparse
import shutil
import sys
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


def _same(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def keep_results(out: Path, dest: Path, replace: bool = False) -> KeepReport:
    """Copy `KEPT_FILES` of every finished run under ``out`` to ``dest`` / its path relative to
    ``out`` (module docstring). Every run is checked before anything is written, so a refusal
    leaves ``dest`` as it was."""
    out, dest = Path(out), Path(dest)
    if not out.is_dir():
        raise KeepError(f"{out}: no such folder (the study's OUT)")
    finished, unfinished = run_dirs(out)
    report = KeepReport(unfinished=unfinished)
    plan: list[tuple[Path, Path]] = []
    for run in finished:
        target = dest / run.relative_to(out)
        files = [n for n in KEPT_FILES if (run / n).is_file()]
        if all(_same(run / n, target / n) for n in files):
            report.unchanged.append(target)
            continue
        if (target / "summary.json").is_file() and not replace:
            differ = [n for n in files if not _same(run / n, target / n)]
            raise KeepError(f"{target} already holds this run with other results ({', '.join(differ)} differ); "
                            f"--replace to overwrite it")
        plan.append((run, target))
    for run, target in plan:
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT_FILES:
            if (run / name).is_file():
                shutil.copyfile(run / name, target / name)
                report.bytes_copied += (target / name).stat().st_size
            else:
                (target / name).unlink(missing_ok=True)
        report.copied.append(target)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the study's output folder (searched for finished runs)")
    parser.add_argument("dest", type=Path, help="where to keep them, e.g. docs/results/<study>")
    parser.add_argument("--replace", action="store_true", help="overwrite kept runs whose results differ")
    args = parser.parse_args(argv)
    try:
        report = keep_results(args.out, args.dest, args.replace)
    except KeepError as exc:
        print(f"keep_results: {exc}", file=sys.stderr)
        return 1
    for run in report.unfinished:
        print(f"skipped {run}: no summary.json (still running, or killed)", file=sys.stderr)
    print(f"kept {len(report.copied)} run(s) in {args.dest} ({report.bytes_copied / 1e6:.2f} MB), "
          f"{len(report.unchanged)} already kept, {len(report.unfinished)} unfinished skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
