"""examples/keep_results.py: the four small files it keeps of a finished run are enough for the
comparison to read the run as the original (the same figures) and for ``fl-geo run --resume`` to
reuse it instead of training again; unfinished and moved-aside folders are skipped, and a kept run
is never replaced by different results without ``--replace``."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from fl_geo.cli import main as cli_main
from fl_geo.compare import load_run
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["configs/quickstart_diloco.yaml", *TINY, "run.name=k"]


def _keeper():
    """examples/keep_results.py as a module (registered first: its dataclasses look it up)."""
    if "keep_results" not in sys.modules:
        spec = importlib.util.spec_from_file_location("keep_results", ROOT / "examples" / "keep_results.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["keep_results"] = module
        spec.loader.exec_module(module)
    return sys.modules["keep_results"]


keeper = _keeper()


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """A study folder as the scripts leave it: one finished run, one killed before its summary, one
    that a resume moved aside."""
    out = tmp_path_factory.mktemp("study")
    runs = out / "row" / "runs"
    assert cli_main(["run", *ARGS, "--out", str(runs)]) == 0
    shutil.copytree(runs / "k", runs / "killed")
    (runs / "killed" / "summary.json").unlink()
    shutil.copytree(runs / "k", runs / "k.interrupted-1700000000")
    return out


def test_only_the_finished_runs_four_small_files_are_kept(study, tmp_path, capsys):
    dest = tmp_path / "kept"
    assert keeper.main([str(study), str(dest)]) == 0
    assert "kept 1 run(s)" in capsys.readouterr().out
    kept = dest / "row" / "runs" / "k"
    assert sorted(p.name for p in dest.rglob("*") if p.is_file()) == sorted(keeper.KEPT_FILES)
    assert all((kept / n).read_bytes() == (study / "row" / "runs" / "k" / n).read_bytes() for n in keeper.KEPT_FILES)
    original = study / "row" / "runs" / "k"
    assert any((original / n).exists() for n in ("final_model.pt", "checkpoints", "final_model.safetensors"))

    report = keeper.keep_results(study, dest)  # again: nothing to copy
    assert (report.copied, [p.name for p in report.unchanged], [p.name for p in report.unfinished]) == ([], ["k"],
                                                                                                         ["killed"])


def test_a_kept_run_reads_as_the_original(study, tmp_path):
    dest = tmp_path / "kept"
    keeper.keep_results(study, dest)
    original, kept = load_run(study / "row" / "runs" / "k"), load_run(dest / "row" / "runs" / "k")
    assert kept.final_loss == original.final_loss and kept.final_loss is not None
    assert kept.series("time/virtual_s") == original.series("time/virtual_s")
    assert kept.series("steps") == original.series("steps")
    assert kept.summary == original.summary and kept.tokens_per_param == original.tokens_per_param


def test_resume_reuses_a_kept_run_instead_of_training_again(study, tmp_path, capsys):
    dest = tmp_path / "kept"
    keeper.keep_results(study, dest)
    summary = dest / "row" / "runs" / "k" / "summary.json"
    before = summary.read_bytes(), summary.stat().st_mtime_ns
    capsys.readouterr()
    assert cli_main(["run", *ARGS, "--out", str(dest / "row" / "runs"), "--resume"]) == 0
    assert "finished earlier with this config: reused" in capsys.readouterr().err
    assert (summary.read_bytes(), summary.stat().st_mtime_ns) == before
    assert not (dest / "row" / "runs" / "k" / "final_model.pt").exists()  # nothing was trained


def test_different_results_are_refused_unless_replace(study, tmp_path, capsys):
    dest = tmp_path / "kept"
    keeper.keep_results(study, dest)
    kept_metrics = dest / "row" / "runs" / "k" / "metrics.jsonl"
    kept_metrics.write_text(kept_metrics.read_text().replace('"val/loss": ', '"val/loss": 1', 1))
    tampered = kept_metrics.read_bytes()

    assert keeper.main([str(study), str(dest)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl differ" in err and "--replace" in err
    assert kept_metrics.read_bytes() == tampered  # left as it was

    assert keeper.main([str(study), str(dest), "--replace"]) == 0
    assert kept_metrics.read_bytes() == (study / "row" / "runs" / "k" / "metrics.jsonl").read_bytes()


def test_a_missing_study_folder_is_a_one_line_error(tmp_path, capsys):
    assert keeper.main([str(tmp_path / "nope"), str(tmp_path / "kept")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_every_run_kept_in_docs_results_is_whole_readable_and_listed():
    """What the repository keeps (docs/results/) is a finished run of four files that the comparison
    reads, in a study folder docs/results/README.md lists."""
    results = ROOT / "docs" / "results"
    finished, unfinished = keeper.run_dirs(results)
    assert not unfinished, unfinished
    listed = (results / "README.md").read_text(encoding="utf-8")
    for run in finished:
        assert sorted(p.name for p in run.iterdir()) == sorted(keeper.KEPT_FILES), run
        record = load_run(run)
        assert record.final_loss is not None and record.tokens_per_param, run
        assert record.summary["name"] == run.name, run
        study = run.relative_to(results).parts[0]
        assert f"`{study}/`" in listed, f"docs/results/README.md does not list {study}/"
