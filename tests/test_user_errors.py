"""A new user's mistakes and failed runs: each is one line on stderr and a non-zero exit code.

User errors (bad YAML, a scalar where a section belongs, an unknown corpus or device, a wrong
``data.text_key``, compare on a directory with nothing to compare) exit 2 with one line; a run in
which every job failed, or that stopped because no node was left, exits 1 and is marked FAILED in
the summary, the table and ``fl-geo compare``.
"""

from __future__ import annotations

import json

import pytest
import torch

from fl_geo.cli import main
from fl_geo.clients.api import DatacenterClient
from tests.conftest import TINY


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("strategy:\n  name: diloco\n  bad: [1,\n", "not valid YAML at line 4, column 1"),
        ("run:\n\tname: tab\n", "not valid YAML at line 2"),
        ("data: 5\n", "'data' is a section, not a value (5); set its keys, e.g. data.corpus=..."),
        ("- a\n- b\n", "a config is a mapping of sections"),
        ("42\n", "a config is a mapping of sections (run, strategy, penalty, halos, streaming, wire, ps, model, "
                 "data, client), got int"),
        ("", "the file is empty (or only comments)"),
        ("# nothing set\n", "the file is empty (or only comments)"),
        ("run:\n  rounds: 3\n  rounds: 4\n", "key 'rounds' appears twice in one mapping (line 2 and line 3)"),
        ("run:\n  rounds: 3\nclient:\n  lr: 0.1\nrun:\n  seed: 1\n", "key 'run' appears twice in one mapping "
                                                                     "(line 1 and line 5)"),
        ("run:\n  name: !!python/object/apply:os.system ['echo owned']\n", "YAML tag refused at line 2, column 9"),
        ("run:\n  out_dir: !!python/object/apply:pathlib.Path ['/tmp']\n", "YAML tag refused at line 2"),
        ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
         "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
         "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", "more than 100000 values once YAML aliases are expanded"),
    ],
)
def test_bad_config_file_is_one_line(tmp_path, capsys, content: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(content)
    err = _one_error_line(capsys, ["config", str(path)])
    assert err.startswith(f"fl-geo: config error: {path}") and needle in err


@pytest.mark.parametrize(("content", "needle"), [
        ("client:\n  lr: .inf\n", "client.lr must be a finite number, got inf"),
        ("client:\n  lr: .nan\n", "client.lr must be a finite number, got nan"),
        ("strategy:\n  outer_lr: .inf\n", "strategy.outer_lr must be a finite number, got inf"),
        ("strategy:\n  round_timeout_s: .inf\n", "strategy.round_timeout_s must be a finite number, got inf"),
        ("strategy:\n  round_timeout_s: -1\n", "strategy.round_timeout_s must be >= 0"),
        ("run:\n  wait_nodes_timeout_s: -5\n", "run.wait_nodes_timeout_s must be >= 0, got -5.0"),
        ("client:\n  lr: -0.1\n", "client.lr, batch_size and seq_len must be positive"),
        ("client:\n  weight_decay: -0.1\n", "client.weight_decay and client.grad_clip must be >= 0"),
        ("client:\n  beta2: 1.5\n", "client.beta1 and client.beta2 must be in [0, 1)"),
        ("strategy:\n  tau: 0\n", "strategy.beta1 and beta2 must be in [0, 1) and strategy.tau > 0"),
        ("run:\n  rounds: -3\n", "run.rounds must be >= 1, got -3"),
        ("run:\n  rounds: .inf\n", "invalid config key or value 'run.rounds'"),
        ("ps:\n  heartbeat_s: .inf\n", "ps.heartbeat_s must be a finite number, got inf"),
])
def test_bad_values_in_a_config_file_are_one_line(tmp_path, capsys, content: str, needle: str) -> None:
    """Infinite, NaN or negative values where they make no sense: one line, exit 2, before any
    run starts (NaN fails every comparison, so only an explicit finiteness check catches it)."""
    path = tmp_path / "c.yaml"
    path.write_text(content)
    err = _one_error_line(capsys, ["config", str(path)])
    assert err.startswith("fl-geo: config error: ") and needle in err, err


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("data=5", "'data' is a section, not a value; set its keys"),
        ("data.corpus=nope", "data.corpus 'nope' is unknown; valid: auto, bible, shakespeare, stdlib, pydoc, files"),
        ("client.device=cuda:x", "valid: auto, cuda, cuda:N, npu, npu:N, mps, cpu"),
        ("client.device=cpu:0", "client.device 'cpu:0' is unknown"),
    ],
)
def test_bad_override_is_one_line(capsys, override: str, needle: str) -> None:
    assert needle in _one_error_line(capsys, ["config", override])


@pytest.mark.parametrize("device", ["cuda:1", "npu:0", "cuda", "cpu"])
def test_indexed_devices_are_valid_config(capsys, device: str) -> None:
    assert main(["config", f"client.device={device}"]) == 0
    assert f"device: {device}" in capsys.readouterr().out


def test_wrong_text_key_is_one_line_before_flower_starts(tmp_path, capsys) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"body": "some text " * 50}) + "\n")
    err = _one_error_line(capsys, ["run", *TINY, "data.corpus=files", f"data.files=[{corpus}]",
                                   "data.text_key=zzz", "--out", str(tmp_path / "runs")])
    assert "record has no string field 'zzz' (it has: body); set data.text_key" in err
    assert not (tmp_path / "runs").exists()  # nothing started


def test_missing_files_are_one_line(tmp_path, capsys) -> None:
    err = _one_error_line(capsys, ["run", *TINY, "data.corpus=files", f"data.files=[{tmp_path}/none*.jsonl]"])
    assert "no file matches" in err


def test_compare_with_nothing_to_compare_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    err = _one_error_line(capsys, ["compare", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "c")])
    assert "has no metrics.jsonl: not an fl-geo run directory" in err
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    err = _one_error_line(capsys, ["compare", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "c")])
    assert "nothing to compare: no run logged a validation loss" in err
    (tmp_path / "empty" / "summary.json").write_text("{not json")
    assert "cannot read the run's results" in _one_error_line(
        capsys, ["compare", "--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "c")])


def test_resume_that_would_replace_earlier_results_is_one_line(tmp_path, capsys) -> None:
    """``run.resume=true`` into a run directory without checkpoints but with an earlier run's
    results: exit 2, one line, the files untouched (a fresh start would have deleted them)."""
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "final_model.pt").write_bytes(b"earlier model")
    err = _one_error_line(capsys, ["run", *TINY, "run.resume=true", "--out", str(tmp_path / "runs")])
    assert err.startswith("fl-geo: config error: run.resume=true but ") and "holds no checkpoint" in err
    # run.lock: the run held the directory while it checked it (tests/test_run_dirs.py)
    assert sorted(p.name for p in run_dir.iterdir()) == ["final_model.pt", "metrics.jsonl", "run.lock"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (run_dir / "final_model.pt").read_bytes() == b"earlier model"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_line_before_the_simulation(tmp_path, capsys) -> None:
    err = _one_error_line(capsys, ["run", *TINY, "client.device=cuda", "--out", str(tmp_path / "runs")])
    assert err.startswith("fl-geo: config error: client.device=cuda: device 'cuda' requested but unavailable")
    assert err.endswith("(a simulation's clients run on this machine)")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [
        ("diloco", "no outer step was taken: all 6 job(s) failed"),  # 3 nodes x 2 rounds, every one fails
        ("dips", "stopped after 0 outer step(s): no live node to train on"),  # benched after 3 failures each
    ],
)
def test_run_where_every_job_fails_exits_1_and_is_marked(tmp_path, capsys, monkeypatch, strategy: str,
                                                         reason: str) -> None:
    # Every ClientApp job raises, as when a deployed node's GPU is gone (in simulation the device
    # is checked before the run starts, above).
    def no_device(self, site):
        raise RuntimeError("device 'cuda' requested but unavailable")

    monkeypatch.setattr(DatacenterClient, "device", no_device)
    out = tmp_path / "runs"
    code = main(["run", *TINY, f"strategy.name={strategy}", f"run.name={strategy}", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert f"fl-geo: run {strategy}" not in captured.out  # the reason goes to stderr, the table to stdout
    assert f"| {strategy} FAILED |" in captured.out and reason in captured.out
    assert f"fl-geo: run {strategy} FAILED: {reason}" in captured.err
    summary = json.loads((out / strategy / "summary.json").read_text())
    assert summary["outer_steps"] == 0 and summary["accepted_updates"] == 0 and reason in summary["failure"]
    # compare reads it back and marks it, but a finished run read with --runs does not fail compare
    assert main(["compare", "--runs", str(out / strategy), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert f"| {strategy} FAILED |" in table and f"- {strategy} FAILED: {reason}" in table


def test_a_run_that_trains_is_not_marked(tmp_path, capsys) -> None:
    assert main(["run", *TINY, "run.name=ok", "--out", str(tmp_path / "runs")]) == 0
    summary = json.loads((tmp_path / "runs" / "ok" / "summary.json").read_text())
    assert summary["failure"] is None and summary["outer_steps"] == 2 and summary["failed_jobs"] == 0
    assert summary["accepted_updates"] == 6
    assert "FAILED" not in capsys.readouterr().out
