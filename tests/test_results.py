"""A finished run's results: final_model.safetensors, `fl-geo eval` and `fl-geo sample`.

One tiny simulation (inline grid, pydoc corpus, 1-layer model; a few seconds) is shared by the
module; tests that damage a run work on a copy of its directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import torch

from fl_geo.cli import main
from fl_geo.core.state import ParamSpec, unflatten
from fl_geo.errors import OutputError
from fl_geo.results import load_run_model, sample
from fl_geo.runtime import session as session_mod
from fl_geo.runtime.session import SAFETENSORS_FORMAT, RunSession
from tests.conftest import TINY, tiny_config

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["run", *TINY, "run.name=tiny", "--out", str(out)]) == 0
    return out / "tiny"


def _copy(run_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    return dst


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _error_line(capsys, argv):
    """Run the CLI expecting a user error: exit 2, one line on stderr, nothing on stdout."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


def test_safetensors_holds_the_named_fp32_state_dict(run_dir):
    flat = torch.load(run_dir / "final_model.pt")
    expected = unflatten(flat["params"], ParamSpec.from_json(flat["spec"]))
    tensors = safetensors_torch.load_file(str(run_dir / "final_model.safetensors"))
    assert list(tensors) == sorted(expected)  # safetensors orders names; all of them, nothing else
    for name, t in expected.items():
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], t), name
    from safetensors import safe_open

    with safe_open(str(run_dir / "final_model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == SAFETENSORS_FORMAT and meta["run_name"] == "tiny"
    assert meta["strategy"] == "diloco" and json.loads(meta["model_config"])["d_model"] == 32
    model, cfg = load_run_model(run_dir)
    assert cfg.run.name == "tiny" and not model.training
    assert all(torch.equal(model.state_dict()[n], t) for n, t in expected.items())


def test_eval_reproduces_the_runs_final_val_loss(run_dir, capsys):
    final = _summary(run_dir)["final_val_loss"]
    assert main(["eval", str(run_dir), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["val_loss"] == pytest.approx(final, rel=1e-5)
    assert res["weights"].endswith("final_model.safetensors") and res["batches"] == 2
    assert res["tokens"] == json.loads((run_dir / "meta.json").read_text())["val_tokens"]
    assert main(["eval", str(run_dir)]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"{run_dir}: val loss {final:.4f} nats/byte ({res['tokens']:,} tokens)"
    assert main(["eval", str(run_dir), "--batches", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] < res["tokens"]


def test_final_model_pt_alone_gives_the_same_model(run_dir, tmp_path, capsys):
    """Runs from before the safetensors export (or without the package) load from the .pt file."""
    old = _copy(run_dir, tmp_path)
    (old / "final_model.safetensors").unlink()
    assert main(["eval", str(old), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["weights"].endswith("final_model.pt")
    assert res["val_loss"] == pytest.approx(_summary(run_dir)["final_val_loss"], rel=1e-5)


def test_greedy_sampling_is_deterministic_and_prints_prompt_plus_continuation(run_dir, capsys):
    argv = ["sample", str(run_dir), "--prompt", "def f(x):", "--tokens", "24", "--temperature", "0"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first and first.startswith("def f(x):")
    model, _ = load_run_model(run_dir)
    out = sample(model, "def f(x):", tokens=24, temperature=0)
    assert len(out) == len(b"def f(x):") + 24 and out.startswith(b"def f(x):")
    assert first == out.decode("utf-8", errors="replace") + "\n"


def test_sampling_is_seeded_and_crops_the_context(run_dir):
    model, cfg = load_run_model(run_dir)
    long_prompt = "import os\n" * 10  # 100 bytes > max_seq_len 32
    assert len(long_prompt) > cfg.model.max_seq_len
    a = sample(model, long_prompt, tokens=16, temperature=1.0, top_k=8, seed=3)
    assert a == sample(model, long_prompt, tokens=16, temperature=1.0, top_k=8, seed=3)
    assert len(a) == len(long_prompt) + 16
    others = {sample(model, long_prompt, tokens=16, temperature=1.0, top_k=8, seed=s) for s in range(4, 8)}
    assert others - {a}  # the seed matters


def test_user_errors_are_one_line_and_exit_2(run_dir, tmp_path, capsys):
    err = _error_line(capsys, ["eval", str(tmp_path / "nope")])
    assert "run directory not found" in err and "nope" in err
    err = _error_line(capsys, ["sample", str(tmp_path / "nope"), "--prompt", "x"])
    assert "run directory not found" in err
    err = _error_line(capsys, ["sample", str(run_dir), "--prompt", "x", "--temperature", "-1"])
    assert "--temperature" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.yaml" in _error_line(capsys, ["eval", str(empty)])
    no_model = _copy(run_dir, tmp_path)
    for name in ("final_model.pt", "final_model.safetensors"):
        (no_model / name).unlink()
    assert "no final_model.pt or final_model.safetensors" in _error_line(capsys, ["eval", str(no_model)])


def test_corrupt_or_mismatched_weights_are_one_line_naming_the_file(run_dir, tmp_path, capsys):
    bad = _copy(run_dir, tmp_path)
    st = bad / "final_model.safetensors"
    st.write_bytes(st.read_bytes()[:100])  # truncated
    err = _error_line(capsys, ["eval", str(bad)])
    assert str(st) in err and "unreadable" in err
    # a model of another shape: the safetensors file does not fit config.yaml's model
    tensors = safetensors_torch.load_file(str(run_dir / "final_model.safetensors"))
    tensors["embed.weight"] = tensors["embed.weight"][:, :16].contiguous()
    safetensors_torch.save_file(tensors, str(st))
    err = _error_line(capsys, ["sample", str(bad), "--prompt", "x"])
    assert str(st) in err and "embed.weight" in err
    # the .pt file: garbage, then a flat buffer that does not fit its own layout
    st.unlink()
    pt = bad / "final_model.pt"
    pt.write_bytes(b"not a torch file")
    err = _error_line(capsys, ["eval", str(bad)])
    assert str(pt) in err and "unreadable" in err
    blob = torch.load(run_dir / "final_model.pt")
    torch.save({"params": blob["params"][:-1].clone(), "spec": blob["spec"]}, pt)
    err = _error_line(capsys, ["eval", str(bad)])
    assert str(pt) in err


def test_without_safetensors_only_the_pt_file_is_written_and_the_hint_logged_once(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import -> ImportError
    monkeypatch.setattr(session_mod, "_safetensors_hint_given", False)
    monkeypatch.setattr(logging.getLogger("fl_geo"), "propagate", True)
    caplog.set_level(logging.INFO, logger="fl_geo")
    cfg = tiny_config("run.name=plain")
    params = torch.arange(6, dtype=torch.float32)
    spec = ParamSpec(("w",), ((2, 3),), ("float32",))
    for _ in range(2):
        session = RunSession(cfg, tmp_path)
        session.save_model(params, spec)
    assert (tmp_path / "final_model.pt").is_file() and not (tmp_path / "final_model.safetensors").exists()
    # one record (caplog can receive the same record through more than one of its handlers)
    hints = list({id(r): r for r in caplog.records if "fl-geo[safetensors]" in r.getMessage()}.values())
    assert len(hints) == 1 and hints[0].levelno == logging.INFO


def test_a_new_run_in_a_directory_with_a_stale_safetensors_file_is_refused(tmp_path):
    """The stale file is never inherited by a new run's results, and never deleted either: a
    new run into the directory is refused (`OutputError`, tests/test_run_dirs.py for the CLI)."""
    (tmp_path / "final_model.safetensors").write_bytes(b"stale")
    with pytest.raises(OutputError, match=r"holds the results of an earlier run \(final_model\.safetensors\)"):
        RunSession(tiny_config("run.tensorboard=false"), tmp_path).open()
    assert (tmp_path / "final_model.safetensors").read_bytes() == b"stale"
