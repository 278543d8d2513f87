"""examples/study_resume.sh: running a study's command again resumes it (finished runs skipped, an
interrupted run's folder moved aside so `fl-geo run` can start it again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pending(run_dir: Path, dry: bool = False) -> str:
    script = f'source "{ROOT}/examples/study_resume.sh"; pending "$1" && echo run || echo skip'
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
