"""examples/study_resume.sh: running a study's command again resumes it (finished runs skipped, an
interrupted run with a checkpoint continued from it, any other interrupted run's folder moved aside so
`fl-geo run` can start it again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pending(run_dir: Path, dry: bool = False) -> str:
    """"skip", "run", or "run run.resume=true" (the override `pending` sets for the run)."""
    script = f'source "{ROOT}/examples/study_resume.sh"; pending "$1" && echo run $RESUME || echo skip'
    env = {"PATH": "/usr/bin:/bin", **({"DRY": "1"} if dry else {})}
    done = subprocess.run(["bash", "-c", script, "pending", str(run_dir)], capture_output=True, text=True,
                          env=env, check=True)
    return done.stdout.strip()


def test_finished_runs_are_skipped_and_interrupted_ones_moved_aside(tmp_path):
    finished = tmp_path / "a-seed=0"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    assert _pending(finished) == "skip" and (finished / "summary.json").is_file()

    assert _pending(tmp_path / "never-started") == "run"

    interrupted = tmp_path / "b-seed=0"
    interrupted.mkdir()
    (interrupted / "metrics.jsonl").write_text("{}\n")
    assert _pending(interrupted, dry=True) == "run" and interrupted.is_dir()  # printing moves nothing
    assert _pending(interrupted) == "run" and not interrupted.exists()
    (moved,) = tmp_path.glob("b-seed=0.interrupted-*")
    assert (moved / "metrics.jsonl").read_text() == "{}\n"  # kept, not deleted


def test_an_interrupted_run_with_a_checkpoint_resumes_in_place(tmp_path):
    run = tmp_path / "c-seed=0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoints" / "ckpt-00000001.pt.tmp").write_text("torn")  # a torn write is no checkpoint
    assert _pending(run, dry=True) == "run"
    assert _pending(run) == "run" and not run.exists()  # moved aside: nothing to resume from

    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoints" / "ckpt-00000005.pt").write_bytes(b"x")
    assert _pending(run, dry=True) == "run run.resume=true"
    assert _pending(run) == "run run.resume=true"
    assert (run / "metrics.jsonl").is_file() and len(list(tmp_path.glob("c-seed=0.interrupted-*"))) == 1

    (run / "summary.json").write_text("{}")  # finished after the resume: skipped, no override left set
    assert _pending(run) == "skip"


@pytest.mark.parametrize(("rounds", "every"), [(1, 1), (11, 1), (36, 3), (60, 5), (3600, 300)])
def test_a_study_run_keeps_about_twelve_checkpoints(rounds, every):
    script = f'source "{ROOT}/examples/study_resume.sh"; checkpoint_every "$1"'
    done = subprocess.run(["bash", "-c", script, "every", str(rounds)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, check=True)
    assert done.stdout.strip() == f"run.checkpoint_every={every}"


def test_a_run_still_going_is_skipped_not_moved(tmp_path):
    import shutil

    from fl_geo.runtime.run_lock import RunLock

    if shutil.which("flock", path="/usr/bin:/bin") is None:
        pytest.skip("no flock(1) here: the study scripts cannot tell a live run's lock (util-linux)")
    run = tmp_path / "d-seed=0"
    held = RunLock(run)
    held.acquire()  # a run of another study writes there
    try:
        assert _pending(run) == "skip" and run.is_dir() and not list(tmp_path.glob("*.interrupted-*"))
    finally:
        held.release()
    assert _pending(run) == "run" and not run.exists()  # released: an interrupted run, moved aside
