"""Optional experiment trackers (run.loggers: wandb, mlflow): every logged record reaches them, a
missing package is one line before the run, and a tracker that fails never ends the run.

The packages are not dependencies, so the tests put small stand-ins with the same calls into
``sys.modules``; what is checked is fl-geo's side of the contract.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from fl_geo.cli import main
from fl_geo.errors import ConfigError
from fl_geo.runtime.loggers import check_trackers
from tests.conftest import TINY


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()

    class Run:
        def log(self, metrics, step):
            rec.calls.append(("log", step, dict(metrics)))

        def finish(self):
            rec.calls.append(("finish",))

    module = _module("wandb")

    def init(**kwargs):
        rec.calls.append(("init", kwargs))
        return Run()

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return rec


@pytest.fixture
def fake_mlflow(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    module = _module("mlflow")
    module.set_experiment = lambda name: rec.calls.append(("experiment", name))
    module.start_run = lambda run_name: rec.calls.append(("start", run_name))
    module.log_params = lambda params: rec.calls.append(("params", dict(params)))
    module.set_tag = lambda key, value: rec.calls.append(("tag", key, value))
    module.log_metrics = lambda metrics, step: rec.calls.append(("log", step, dict(metrics)))
    module.end_run = lambda: rec.calls.append(("end",))
    monkeypatch.setitem(sys.modules, "mlflow", module)
    return rec


def test_both_trackers_get_every_record(tmp_path, fake_wandb: _Recorder, fake_mlflow: _Recorder) -> None:
    assert main(["run", *TINY, "run.name=tracked", "run.loggers=[wandb,mlflow]", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "tracked" / "metrics.jsonl").read_text().splitlines()]
    for rec in (fake_wandb, fake_mlflow):
        logged = [(c[1], c[2]) for c in rec.calls if c[0] == "log"]
        assert [step for step, _ in logged] == [r["step"] for r in rows]
        assert [m["val/loss"] for _, m in logged] == [r["val/loss"] for r in rows]
        assert all(v is not None for _, m in logged for v in m.values())  # JSONL nulls are not sent
    init = fake_wandb.calls[0]
    assert init[0] == "init" and init[1]["name"] == "tracked" and init[1]["config"]["strategy"]["name"] == "diloco"
    assert fake_wandb.calls[-1] == ("finish",)
    assert fake_mlflow.calls[:2] == [("experiment", "fl-geo"), ("start", "tracked")]
    params = next(c[1] for c in fake_mlflow.calls if c[0] == "params")
    assert params["run.rounds"] == "2" and params["strategy.name"] == "diloco"
    assert fake_mlflow.calls[-1] == ("end",)


def test_a_failing_tracker_is_dropped_and_the_run_goes_on(tmp_path, fake_wandb: _Recorder, caplog) -> None:
    module = sys.modules["wandb"]

    class Broken:
        def log(self, metrics, step):
            raise ConnectionError("wandb.ai unreachable")

        def finish(self):
            raise ConnectionError("wandb.ai unreachable")

    module.init = lambda **kwargs: Broken()
    assert main(["run", *TINY, "run.name=broken", "run.loggers=[wandb]", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and summary["failure"] is None
    assert "experiment tracker WandbTracker failed (wandb.ai unreachable)" in caplog.text


def test_missing_or_unknown_tracker_is_one_line(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import of wandb fails, as when not installed
    with pytest.raises((ConfigError, ValueError)):
        check_trackers(["wandb"])
    assert main(["config", "run.loggers=[neptune]"]) == 2
    assert "run.loggers ['neptune'] unknown; valid: wandb, mlflow" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "wandb")
    if importlib.util.find_spec("wandb") is None:  # the usual case: not installed here
        assert main(["run", *TINY, "run.loggers=[wandb]", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "fl-geo: config error: run.loggers includes wandb, which is not installed: pip install 'fl-geo[wandb]'"
        assert not any(tmp_path.iterdir())
