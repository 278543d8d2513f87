"""Run directories nobody clobbers, and result files a full disk cannot tear (issue 26, integrity).

- a plain re-run into a directory holding a finished run's results is refused (one line, exit 2)
  and every file stays byte-identical;
- a second run into a directory another run holds (``run.lock``) fails at once, naming the
  holder's pid, and writes nothing there;
- ``run.name`` with a separator, ``..`` or an absolute path is a one-line config error, nothing
  written anywhere;
- a write that fails midway with ``ENOSPC`` (final model, safetensors, summary, checkpoint) is
  one line naming the file, leaves the previous file intact and no ``.tmp`` behind.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fl_geo.runtime.session as session_mod
from fl_geo.atomic import write_text_atomic
from fl_geo.cli import main
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.state import ParamSpec
from fl_geo.errors import OutputError
from fl_geo.runtime.run_lock import LOCK_FILE, RunLock
from fl_geo.runtime.session import RunSession
from tests.conftest import TINY, tiny_config


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(autouse=True)
def _fresh_log_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` binds its log handler to the stderr of the first test that calls it; give each test
    its own, so a run's INFO lines land in this test's capture."""
    monkeypatch.setattr(logging.getLogger("fl_geo"), "handlers", [])


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (but the lock file, whose pid line is informational)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


# ---- re-run, concurrent run, run.name ------------------------------------------------------------
def test_a_plain_rerun_into_a_finished_run_is_refused_and_changes_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    assert main(["run", *TINY, "run.tensorboard=false", "--out", str(out)]) == 0
    capsys.readouterr()
    run_dir = out / "run"
    before = _snapshot(run_dir)
    assert {"summary.json", "final_model.pt", "metrics.jsonl", "config.yaml"} <= set(before)
    err = _one_error_line(capsys, ["run", *TINY, "run.tensorboard=false", "run.seed=7", "--out", str(out)])
    assert err.startswith(f"fl-geo: {run_dir} holds the results of an earlier run (")
    assert "another run.name or --out" in err and "run.resume=true" in err
    assert _snapshot(run_dir) == before
    # the lock was released on the refusal: another name in the same --out runs
    assert main(["run", *TINY, "run.tensorboard=false", "run.name=second", "--out", str(out)]) == 0


def test_a_second_run_into_a_locked_directory_fails_at_once_naming_the_holder(tmp_path, capsys) -> None:
    run_dir = tmp_path / "runs" / "run"
    holder = subprocess.Popen(  # another process holds the directory, as a live run would
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from fl_geo.runtime.run_lock import RunLock
            lock = RunLock({str(run_dir)!r}); lock.acquire()
            print("held", flush=True); sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        err = _one_error_line(capsys, ["run", *TINY, "run.tensorboard=false", "--out", str(tmp_path / "runs")])
        assert err.startswith(f"fl-geo: {run_dir} is in use by another run (pid {holder.pid} on ")
        assert "another run.name / --out" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing of ours written there
    finally:
        holder.communicate("")
    # the holder exited: its lock died with it, and the directory can be used
    assert main(["run", *TINY, "run.tensorboard=false", "--out", str(tmp_path / "runs")]) == 0


def test_the_lock_is_per_open_file_so_a_second_session_in_this_process_is_refused_too(tmp_path) -> None:
    first = RunSession(tiny_config("run.tensorboard=false"), tmp_path)
    first.open()
    try:
        with pytest.raises(OutputError, match=r"in use by another run \(pid \d+ on "):
            RunSession(tiny_config("run.tensorboard=false"), tmp_path).open()
    finally:
        first.close()
    lock = RunLock(tmp_path)
    lock.acquire()  # released by close()
    lock.release()


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs-run", "a/b", "..", ".", "a\\b"])
def test_a_run_name_that_is_not_one_path_component_is_one_line(tmp_path, capsys, monkeypatch, name) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "deep" / "runs"
    err = _one_error_line(capsys, ["run", *TINY, f"run.name={name}", "--out", str(out)])
    assert err.startswith("fl-geo: config error: run.name must be one directory name") and repr(name) in err
    assert list(tmp_path.iterdir()) == []  # nothing written, inside --out or outside it


def test_new_run_dirs_are_claimed_atomically(tmp_path) -> None:
    cfg = tiny_config(f"run.out_dir={tmp_path}")
    dirs = {session_mod.new_run_dir(cfg) for _ in range(3)}  # same second: three directories
    assert len(dirs) == 3 and all(d.is_dir() and d.parent == tmp_path for d in dirs)


# ---- full disk ----------------------------------------------------------------------------------
def _failing_midway(real):
    """``torch.save`` that writes half of what it would, then hits a full disk."""
    def save(obj, f, *args, **kwargs):
        import io

        buf = io.BytesIO()
        real(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise _enospc()
    return save


def test_a_full_disk_while_saving_the_final_model_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch) -> None:
    session = RunSession(tiny_config("run.name=disk"), tmp_path)
    spec = ParamSpec(("w",), ((2, 3),), ("float32",))
    session.save_model(torch.zeros(6), spec)
    before = _snapshot(tmp_path)
    monkeypatch.setattr(torch, "save", _failing_midway(torch.save))
    with pytest.raises(OutputError) as info:
        session.save_model(torch.ones(6), spec)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"cannot write {tmp_path / 'final_model.pt'}: No space left on device")
    assert "previous file is unchanged" in msg
    assert _snapshot(tmp_path) == before  # no .tmp left, the earlier model byte-identical
    assert torch.equal(torch.load(tmp_path / "final_model.pt", weights_only=True)["params"], torch.zeros(6))


def test_a_full_disk_while_writing_a_small_file_keeps_the_previous(tmp_path, monkeypatch) -> None:
    target = tmp_path / "summary.json"
    write_text_atomic(target, '{"old": 1}')
    real = Path.write_bytes

    def half_then_full(self: Path, data: bytes) -> int:
        real(self, data[: len(data) // 2])
        raise _enospc()

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    with pytest.raises(OutputError, match=r"cannot write .*summary\.json: No space left on device"):
        write_text_atomic(target, '{"new": 2, "padding": "' + "x" * 1000 + '"}')
    monkeypatch.undo()
    assert target.read_text() == '{"old": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoints(tmp_path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, {"x": torch.arange(1000.0)})
    before = _snapshot(tmp_path)
    monkeypatch.setattr(torch, "save", _failing_midway(torch.save))
    with pytest.raises(OutputError, match=r"cannot write .*ckpt-00000002\.pt: No space left on device"):
        store.save(2, {"x": torch.arange(1000.0) + 1})
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before
    latest = store.load_latest()
    assert latest is not None and latest.step == 1 and torch.equal(latest.state["x"], torch.arange(1000.0))


def test_a_full_disk_at_the_end_of_a_run_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch) -> None:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if str(getattr(f, "name", "")).endswith("final_model.pt.tmp"):
            return _failing_midway(real)(obj, f, *args, **kwargs)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    assert main(["run", *TINY, "run.tensorboard=false", "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = err.strip().splitlines()[-1]  # after the run's own INFO lines
    final = tmp_path / "runs" / "run" / "final_model.pt"
    assert err.startswith(f"fl-geo: cannot write {final}: No space left on device")
    assert not final.exists() and not final.with_name("final_model.pt.tmp").exists()
    assert (final.parent / "metrics.jsonl").is_file()  # what the run logged is kept
