"""The study scripts (examples/long_budget_study.sh, examples/method_table.sh) resume through
``fl-geo run --resume`` (examples/study_resume.sh), so running a study's command again follows the
rules of fl_geo/run_reuse.py (tested with the command itself in tests/test_compare_resume.py):
finished runs of the same config reused, interrupted ones continued or moved aside."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("rounds", "every"), [(1, 1), (11, 1), (36, 3), (60, 5), (3600, 300)])
def test_a_study_run_keeps_about_twelve_checkpoints(rounds, every):
    script = f'source "{ROOT}/examples/study_resume.sh"; checkpoint_every "$1"'
    done = subprocess.run(["bash", "-c", script, "every", str(rounds)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, check=True)
    assert done.stdout.strip() == f"run.checkpoint_every={every}"


def _recording_flgeo(tmp_path: Path) -> tuple[Path, Path]:
    """An executable standing in for fl-geo (and the report's python) that records its arguments, one
    call per line, so a study script's calls can be read without training anything."""
    calls = tmp_path / "calls.txt"
    exe = tmp_path / "record"
    exe.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n')
    exe.chmod(0o755)
    return exe, calls


@pytest.mark.parametrize("script", ["long_budget_study.sh", "method_table.sh"])
def test_every_study_run_goes_through_run_resume(tmp_path, script):
    exe, calls = _recording_flgeo(tmp_path)
    out = tmp_path / "study"
    env = {**os.environ, "FLGEO": str(exe), "PY": str(exe), "CELLS": "fedavg-H25 ddp", "HEADLINE": "ddp",
           "ROWS": "straggler", "SEEDS": "2", "KEEP": str(tmp_path / "kept")}
    subprocess.run(["bash", str(ROOT / "examples" / script), str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True)
    runs = [c.split() for c in calls.read_text().splitlines() if c.startswith("run ")]
    expected = 4 if script == "long_budget_study.sh" else 6  # 2 cells + ddp twice more / 3 cells x 2 seeds
    assert len(runs) == expected, runs
    for argv in runs:
        assert argv[-1] == "--resume" and argv[-3] == "--out", argv
        name = next(a.split("=", 1)[1] for a in argv if a.startswith("run.name="))
        assert Path(argv[-2]).name == "runs" and "-seed=" in name, argv
    keeps = [c.split() for c in calls.read_text().splitlines() if "keep_results.py" in c]
    assert keeps == [["examples/keep_results.py", str(out), str(tmp_path / "kept")]]  # KEEP: once, after the runs
    lines = calls.read_text().splitlines()  # a study whose runs succeed writes its table, after the keep
    table = next(i for i, c in enumerate(lines) if c.startswith("compare") or "method_table_report.py" in c)
    assert table > next(i for i, c in enumerate(lines) if "keep_results.py" in c)


@pytest.mark.parametrize("script", ["long_budget_study.sh", "method_table.sh"])
def test_a_failed_run_still_keeps_the_finished_ones_and_fails_the_study(tmp_path, script):
    calls = tmp_path / "calls.txt"
    exe = tmp_path / "record"  # records every call; each `run` fails, as a crashed run would
    exe.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n[ "$1" != run ]\n')
    exe.chmod(0o755)
    env = {**os.environ, "FLGEO": str(exe), "PY": str(exe), "CELLS": "ddp", "HEADLINE": "", "ROWS": "straggler",
           "SEEDS": "1", "KEEP": str(tmp_path / "kept")}
    done = subprocess.run(["bash", str(ROOT / "examples" / script), str(tmp_path / "study")], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "some runs failed" in done.stderr
    lines = calls.read_text().splitlines()
    assert any("keep_results.py" in c for c in lines)
    assert not any(c.startswith("compare") or "method_table_report.py" in c for c in lines)  # no table of a failed study


@pytest.mark.parametrize("script", ["long_budget_study.sh", "method_table.sh"])
def test_editing_a_study_script_while_it_runs_does_not_change_the_running_study(tmp_path, script):
    """Bash reads a script as it runs; a study runs for hours, and its file is edited in place
    meanwhile (a comment, a new cell). The first run call below overwrites the script's copy in
    place (same file, every byte shifted), and the study must still run every job, keep and table."""
    examples = tmp_path / "examples"
    examples.mkdir()
    for name in (script, "study_resume.sh"):
        (examples / name).write_text((ROOT / "examples" / name).read_text())
    copy, calls = examples / script, tmp_path / "calls.txt"
    exe = tmp_path / "record"
    exe.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n'
                   f'if [ "$1" = run ] && [ ! -e "{tmp_path}/edited" ]; then touch "{tmp_path}/edited"; '
                   f'{{ printf "# %0300d\\n" 0; cat "{ROOT / "examples" / script}"; }} > "{copy}"; fi\n')
    exe.chmod(0o755)
    env = {**os.environ, "FLGEO": str(exe), "PY": str(exe), "CELLS": "fedavg-H25 ddp", "HEADLINE": "ddp",
           "ROWS": "straggler", "SEEDS": "2", "KEEP": str(tmp_path / "kept")}
    done = subprocess.run(["bash", str(copy), str(tmp_path / "study")], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert (tmp_path / "edited").exists() and copy.read_text().startswith("# 000")  # the edit happened
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    runs = [c for c in lines if c.startswith("run ")]
    assert len(runs) == len(set(runs)) == (4 if script == "long_budget_study.sh" else 6)  # each job once
    keeps = [i for i, c in enumerate(lines) if "keep_results.py" in c]
    tables = [i for i, c in enumerate(lines) if c.startswith("compare") or "method_table_report.py" in c]
    assert len(keeps) == len(tables) == 1 and keeps[0] < tables[0], lines  # kept once, then one table
