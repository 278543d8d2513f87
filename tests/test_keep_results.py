"""examples/keep_results.py: the four small files it keeps of a finished run are enough for the
comparison to read the run as the original (the same figures) and for ``fl-geo run --resume`` to
reuse it instead of training again; unfinished and moved-aside folders are skipped, and a kept run
is never replaced by different results without ``--replace``."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tarfile
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


def _extract(archive: Path, into: Path) -> Path:
    with tarfile.open(archive, "r:gz") as tar:
        # the "data" filter (no links out, no odd modes) where this Python has it (3.11.4 and newer)
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return into


def test_only_the_finished_runs_four_small_files_are_kept(study, tmp_path, capsys):
    archive = tmp_path / "kept.tar.gz"
    assert keeper.main([str(study), str(archive)]) == 0
    assert "kept 1 run(s)" in capsys.readouterr().out
    members = keeper.read_archive(archive)
    assert sorted(members) == sorted(f"row/runs/k/{n}" for n in keeper.KEPT_FILES)
    original = study / "row" / "runs" / "k"
    assert all(members[f"row/runs/k/{n}"] == (original / n).read_bytes() for n in keeper.KEPT_FILES)
    assert any((original / n).exists() for n in ("final_model.pt", "checkpoints", "final_model.safetensors"))

    before = archive.read_bytes()
    report = keeper.keep_results(study, archive)  # again: nothing to add, not a byte changes
    assert (report.copied, [p.name for p in report.unchanged], [p.name for p in report.unfinished]) == ([], ["k"],
                                                                                                         ["killed"])
    assert archive.read_bytes() == before
    other = tmp_path / "again.tar.gz"
    keeper.keep_results(study, other)
    assert other.read_bytes() == before  # deterministic: the same runs give the same archive


def test_a_kept_run_reads_as_the_original(study, tmp_path):
    keeper.keep_results(study, tmp_path / "kept.tar.gz")
    out = _extract(tmp_path / "kept.tar.gz", tmp_path / "x")
    original, kept = load_run(study / "row" / "runs" / "k"), load_run(out / "row" / "runs" / "k")
    assert kept.final_loss == original.final_loss and kept.final_loss is not None
    assert kept.series("time/virtual_s") == original.series("time/virtual_s")
    assert kept.series("steps") == original.series("steps")
    assert kept.summary == original.summary and kept.tokens_per_param == original.tokens_per_param


def test_resume_reuses_a_kept_run_instead_of_training_again(study, tmp_path, capsys):
    keeper.keep_results(study, tmp_path / "kept.tar.gz")
    out = _extract(tmp_path / "kept.tar.gz", tmp_path / "x")
    summary = out / "row" / "runs" / "k" / "summary.json"
    before = summary.read_bytes(), summary.stat().st_mtime_ns
    capsys.readouterr()
    assert cli_main(["run", *ARGS, "--out", str(out / "row" / "runs"), "--resume"]) == 0
    assert "finished earlier with this config: reused" in capsys.readouterr().err
    assert (summary.read_bytes(), summary.stat().st_mtime_ns) == before
    assert not (out / "row" / "runs" / "k" / "final_model.pt").exists()  # nothing was trained


def test_different_results_are_refused_unless_replace(study, tmp_path, capsys):
    archive = tmp_path / "kept.tar.gz"
    keeper.keep_results(study, archive)
    members = keeper.read_archive(archive)
    key = "row/runs/k/metrics.jsonl"
    members[key] = members[key].replace(b'"val/loss": ', b'"val/loss": 1', 1)
    keeper.write_archive(archive, members)
    tampered = archive.read_bytes()

    assert keeper.main([str(study), str(archive)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl differ" in err and "--replace" in err
    assert archive.read_bytes() == tampered  # left as it was

    assert keeper.main([str(study), str(archive), "--replace"]) == 0
    assert keeper.read_archive(archive)[key] == (study / "row" / "runs" / "k" / "metrics.jsonl").read_bytes()


def test_a_damaged_archive_is_a_one_line_error_and_left_alone(study, tmp_path, capsys):
    archive = tmp_path / "kept.tar.gz"
    archive.write_bytes(b"not a tar")
    assert keeper.main([str(study), str(archive)]) == 1
    assert capsys.readouterr().err.count("\n") == 1 and archive.read_bytes() == b"not a tar"


def test_a_missing_study_folder_is_a_one_line_error(tmp_path, capsys):
    assert keeper.main([str(tmp_path / "nope"), str(tmp_path / "kept.tar.gz")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_every_run_kept_in_docs_results_is_whole_readable_and_listed(tmp_path):
    """What the repository keeps (docs/results/*.tar.gz) is finished runs of four files that the
    comparison reads, in archives docs/results/README.md lists."""
    results = ROOT / "docs" / "results"
    listed = (results / "README.md").read_text(encoding="utf-8")
    archives = sorted(results.glob("*.tar.gz"))
    assert archives and not [p for p in results.iterdir() if p.is_dir()]  # archives only: no folder Flower would pack
    for archive in archives:
        assert f"`{archive.name}`" in listed, f"docs/results/README.md does not list {archive.name}"
        out = _extract(archive, tmp_path / archive.name)
        finished, unfinished = keeper.run_dirs(out)
        assert finished and not unfinished, (archive, unfinished)
        for run in finished:
            assert sorted(p.name for p in run.iterdir()) == sorted(keeper.KEPT_FILES), run
            record = load_run(run)
            assert record.final_loss is not None and record.tokens_per_param, run
            assert record.summary["name"] == run.name, run


def test_the_readme_method_table_rows_are_what_the_kept_runs_give(tmp_path):
    """The README's HALoS and Streaming rows are written by the report from the runs kept in
    docs/results/method-table.tar.gz: reading the archive again must give the same lines, so a
    figure in the README cannot drift from the runs behind it."""
    from tests.test_paired import _report  # examples/method_table_report.py as a module

    report = _report()
    out = _extract(ROOT / "docs" / "results" / "method-table.tar.gz", tmp_path / "kept")
    groups = report.load_groups(out)
    table, _ = report.build(groups)
    readme = report.readme_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    built = report.readme_rows(f"{report.BEGIN}\n{table}{report.END}")
    for situation in ("regions, each with several sites, slow links between regions",
                      "the link's peak bandwidth is the limit"):
        assert situation in built, f"the kept runs do not give the row '{situation}'"
        assert readme.get(situation) == built[situation], f"README row '{situation}' differs from its kept runs"
