"""``fl-geo compare --resume`` / ``sweep --resume`` (fl_geo/run_reuse.py): the same command run
again after an interruption reuses the finished runs, continues interrupted ones from their
checkpoints, restarts those that left none, and refuses a folder holding another config's run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fl_geo.cli import main as cli_main
from fl_geo.config import load_config
from tests.conftest import TINY

# three rounds, a checkpoint after each (run.rounds may change on resume: a one-round run cut
# short of its summary is what a run killed after its first checkpoint leaves)
ARGS = ["configs/quickstart_diloco.yaml", *TINY, "run.rounds=3", "run.checkpoint_every=1", "run.name=q"]
BASE = load_config("configs/quickstart_diloco.yaml", TINY).run.seed
NAMES = [f"q-seed={BASE}", f"q-seed={BASE + 1}"]


def _compare(out, *extra: str) -> int:
    return cli_main(["compare", *ARGS, *extra, "--seeds", "2", "--out", str(out)])


def _killed(out, *extra: str) -> None:
    """Seed 2's run as a kill after round 1 leaves it (``extra``: its config, e.g. no checkpoints)."""
    run_dir = out / "runs" / NAMES[1]
    shutil.rmtree(run_dir, ignore_errors=True)
    assert cli_main(["run", *ARGS, *extra, "run.rounds=1", f"run.seed={BASE + 1}", f"run.name={NAMES[1]}",
                     "--out", str(out / "runs")]) == 0
    for name in ("summary.json", "final_model.pt", "final_model.safetensors"):
        (run_dir / name).unlink(missing_ok=True)


def _final(out, name: str):
    return torch.load(out / "runs" / name / "final_model.pt")["params"]


def _finals(out) -> list[float]:
    (group,) = json.loads((out / "summary.json").read_text())["groups"]
    return [r["figures"]["final"] for r in group["runs"]]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted comparison (two seeds, one at a time) every test here is held against."""
    out = tmp_path_factory.mktemp("full")
    assert _compare(out) == 0
    return out


def test_resume_reuses_finished_runs_and_continues_an_interrupted_one_bit_identically(tmp_path, full, capsys,
                                                                                    caplog):
    caplog.set_level("INFO", logger="fl_geo")  # the log's handler may hold an earlier test's stderr
    out = tmp_path / "cut"
    assert _compare(out) == 0
    _killed(out)
    summary0 = out / "runs" / NAMES[0] / "summary.json"
    mtime0 = summary0.stat().st_mtime_ns
    capsys.readouterr()

    assert _compare(out, "--resume") == 0
    err = capsys.readouterr().err
    assert f"seed 1/2 of q: run.seed={BASE} (finished earlier: reused)" in err
    assert f"seed 2/2 of q: run.seed={BASE + 1} (interrupted: continued)" in err and "resumed from" in caplog.text
    assert summary0.stat().st_mtime_ns == mtime0  # not run again
    for name in NAMES:  # synchronous DiLoCo: the continued run ends where the uninterrupted one does
        assert torch.equal(_final(out, name), _final(full, name)), name
    assert _finals(out) == _finals(full)

    capsys.readouterr()
    assert _compare(out, "--resume") == 0  # everything finished: nothing runs
    assert capsys.readouterr().err.count("(finished earlier: reused)") == 2


def test_an_interrupted_run_without_a_checkpoint_is_moved_aside_and_run_again(tmp_path, full, caplog):
    out = tmp_path / "cut"
    _killed(out, "run.checkpoint_every=0")
    assert _compare(out, "--resume") == 0
    (aside,) = (out / "runs").glob(f"{NAMES[1]}.interrupted-*")
    assert (aside / "metrics.jsonl").is_file()  # kept, not deleted
    assert "interrupted before any checkpoint" in caplog.text
    assert torch.equal(_final(out, NAMES[1]), _final(full, NAMES[1]))


def test_a_folder_of_another_config_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "cut"
    assert _compare(out) == 0
    before = sorted(p.name for p in (out / "runs").iterdir())
    mtimes = [(out / "runs" / n / "summary.json").stat().st_mtime_ns for n in NAMES]
    capsys.readouterr()
    assert cli_main(["compare", *ARGS, "client.lr=0.002", "--seeds", "3", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a run of another config (client.lr:" in err and "use another --out" in err
    assert sorted(p.name for p in (out / "runs").iterdir()) == before  # seed 3 did not start, nothing moved
    assert [(out / "runs" / n / "summary.json").stat().st_mtime_ns for n in NAMES] == mtimes
    assert cli_main(["compare", *ARGS, "--seeds", "2", "--out", str(out)]) == 2  # without --resume: refused as before


def test_sweep_resume_runs_only_the_missing_points(tmp_path, capsys):
    out = tmp_path / "sw"
    sweep = ["sweep", *TINY, "run.rounds=1", "run.name=lr", "strategy.outer_lr=0.3,0.9", "--out", str(out)]
    assert cli_main(sweep) == 0
    shutil.rmtree(out / "runs" / "lr-outer_lr=0.9")
    kept = (out / "runs" / "lr-outer_lr=0.3" / "summary.json").stat().st_mtime_ns
    capsys.readouterr()
    assert cli_main([*sweep, "--resume"]) == 0
    assert (out / "runs" / "lr-outer_lr=0.3" / "summary.json").stat().st_mtime_ns == kept
    assert (out / "runs" / "lr-outer_lr=0.9" / "summary.json").is_file()
    assert "(finished earlier: reused)" in capsys.readouterr().err


def test_a_run_still_going_is_neither_continued_nor_moved(tmp_path, capsys):
    from fl_geo.runtime.run_lock import RunLock

    out = tmp_path / "cut"
    _killed(out, "run.checkpoint_every=0")
    held = RunLock(out / "runs" / NAMES[1])
    held.acquire()  # another process's run in that folder, as far as the lock says
    try:
        capsys.readouterr()
        assert _compare(out, "--resume") != 0
        assert "is in use by another run" in capsys.readouterr().err
        assert not list((out / "runs").glob("*.interrupted-*")) and (out / "runs" / NAMES[1]).is_dir()
    finally:
        held.release()


def test_jobs_two_gives_the_runs_one_at_a_time_gives(tmp_path, full, capsys):
    """``--jobs 2``: each run its own ``fl-geo run`` process, two at a time; one thread each (the
    tiny config's), so the same bits and the same group figures as running them in turn."""
    serial, parallel = full, tmp_path / "parallel"
    capsys.readouterr()
    assert _compare(parallel, "--jobs", "2") == 0
    err = capsys.readouterr().err
    assert "run 1/2 started" in err and "run 2/2 ended" in err
    for name in NAMES:
        assert torch.equal(_final(parallel, name), _final(serial, name)), name
        assert "final val loss" in (parallel / "runs" / ".logs" / f"{name}.log").read_text()
    # logs and configs in dot folders, which a shell's OUT/runs/* leaves out
    assert sorted(p.name for p in (parallel / "runs").iterdir()) == [".configs", ".logs", *NAMES]
    assert _finals(parallel) == _finals(serial)
    # without --resume a second time is refused before anything runs; with it, everything is reused
    assert _compare(parallel, "--jobs", "2") == 2
    assert "already holds run(s)" in capsys.readouterr().err
    assert _compare(parallel, "--jobs", "2", "--resume") == 0
    assert "started" not in capsys.readouterr().err


def _run(runs_dir, seed: int, *extra: str) -> int:
    """``fl-geo run`` of one seed's run into ``runs_dir``, as the study scripts call it."""
    return cli_main(["run", *ARGS, f"run.seed={seed}", f"run.name=q-seed={seed}", *extra, "--out", str(runs_dir)])


def test_run_resume_reuses_continues_and_refuses_as_compare_does(tmp_path, full, capsys, caplog):
    """``fl-geo run --resume`` (what examples/study_resume.sh runs every study cell with) follows
    the same rules: a finished run of the same config is reused without training, an interrupted
    one continues from its checkpoint to the uninterrupted run's bits, another config's run is a
    one-line error with nothing moved, and --resume without --out is refused."""
    caplog.set_level("INFO", logger="fl_geo")
    out = tmp_path / "cut"
    _killed(out)
    runs = out / "runs"
    shutil.copytree(full / "runs" / NAMES[0], runs / NAMES[0])
    summary0 = runs / NAMES[0] / "summary.json"
    mtime0 = summary0.stat().st_mtime_ns
    capsys.readouterr()

    assert _run(runs, BASE, "--resume") == 0  # finished: reused
    captured = capsys.readouterr()
    assert f"run {NAMES[0]}: finished earlier with this config: reused" in captured.err
    assert summary0.stat().st_mtime_ns == mtime0
    assert f"| {NAMES[0]} |" in captured.out  # still in the summary table
    assert _run(runs, BASE + 1, "--resume") == 0  # interrupted after round 1: continued
    assert "resumed from" in caplog.text
    assert torch.equal(_final(out, NAMES[1]), _final(full, NAMES[1]))

    capsys.readouterr()
    assert _run(runs, BASE, "client.lr=0.002", "--resume") == 2
    err = capsys.readouterr().err
    assert "holds a run of another config (client.lr:" in err
    assert summary0.stat().st_mtime_ns == mtime0 and not list(runs.glob("*.interrupted-*"))
    assert cli_main(["run", *ARGS, "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_run_resume_moves_an_interrupted_run_without_a_checkpoint_aside(tmp_path, full):
    out = tmp_path / "cut"
    _killed(out, "run.checkpoint_every=0")
    assert _run(out / "runs", BASE + 1, "--resume") == 0
    (aside,) = (out / "runs").glob(f"{NAMES[1]}.interrupted-*")
    assert (aside / "metrics.jsonl").is_file()
    assert torch.equal(_final(out, NAMES[1]), _final(full, NAMES[1]))
