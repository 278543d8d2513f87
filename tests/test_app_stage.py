"""The staged app folder that `flwr run` packs (fl_geo/deploy/app_stage.py): the same FAB as
Flower builds from the project itself, without walking the folders Flower drops whole."""

from __future__ import annotations

import os
import zipfile
from io import BytesIO
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fl_geo.deploy.app_stage import stage_app, staged_app

ROOT = Path(__file__).resolve().parents[1]
# Flower 1.42's own FAB build uses a pattern class that pathspec deprecates (not ours).
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")


def _project(tmp: Path, gitignore: str) -> Path:
    app = tmp / "proj"
    (app / "pkg" / "__pycache__").mkdir(parents=True)
    (app / "pyproject.toml").write_text((ROOT / "apps" / "flower-path-probe" / "pyproject.toml").read_text())
    (app / ".gitignore").write_text(gitignore)
    (app / "pkg" / "app.py").write_text("x = 1\n")
    (app / "pkg" / "conf.yaml").write_text("a: 1\n")
    (app / "pkg" / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    for big in (".venv/lib/site", "runs/r-1", ".flwr/apps"):
        (app / big).mkdir(parents=True)
        (app / big / "mod.py").write_text("y = 2\n")  # .py: kept by include rules, dropped by folder
    (app / "runs" / "keep.py").write_text("z = 3\n")
    os.symlink(app / "pkg" / "app.py", app / "pkg" / "link.py")
    (app / "pkg" / ".git").write_text("gitdir: ../.git/modules/pkg\n")  # a submodule's (or worktree's) .git file
    return app


def _names(fab: bytes) -> list[str]:
    return sorted(zipfile.ZipFile(BytesIO(fab)).namelist())


def test_the_staged_fab_is_flowers_fab_without_the_dropped_folders(tmp_path):
    app = _project(tmp_path, ".venv/\nruns/\n")
    staged = stage_app(app, tmp_path / "stage")
    assert not (staged / ".venv").exists() and not (staged / "runs").exists()  # never walked
    assert not (staged / ".flwr").exists() and not (staged / "pkg" / "__pycache__").exists()  # Flower's own rules
    assert not (staged / "pkg" / "link.py").exists()  # Flower skips links; so do we
    assert not (staged / "pkg" / ".git").exists()  # repository metadata, even as a file
    assert (staged / "pkg" / "app.py").read_text() == "x = 1\n"
    fab = build_fab_from_disk(app)
    assert build_fab_from_disk(staged) == fab  # byte for byte
    assert "pkg/app.py" in _names(fab) and not any(n.startswith(("runs/", ".venv/")) for n in _names(fab))


def test_a_re_included_path_prunes_nothing(tmp_path):
    """With a `!pattern` a file inside an ignored folder may come back: staging then walks all
    and leaves every decision to Flower."""
    app = _project(tmp_path, "runs/\n!runs/keep.py\n")
    staged = stage_app(app, tmp_path / "stage")
    assert (staged / "runs" / "keep.py").is_file() and (staged / ".venv" / "lib" / "site" / "mod.py").is_file()
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)


def test_the_project_stages_without_its_venv_and_the_stage_is_removed(tmp_path):
    """The project itself (its FAB is compared byte for byte on the synthetic project above:
    building it from the real folder walks .venv, 4 s of CPU)."""
    with staged_app(ROOT, tmp_path) as staged:
        assert (staged / "pyproject.toml").is_file() and (staged / "fl_geo" / "deploy" / "app_stage.py").is_file()
        assert not (staged / ".venv").exists() and not (staged / ".git").exists()
        assert "fl_geo/deploy/app_stage.py" in _names(build_fab_from_disk(staged))
    assert list(tmp_path.iterdir()) == []


def test_the_federation_config_probe_reads_this_venvs_flower_and_asks_any_other(tmp_path, monkeypatch):
    """`fl-geo flwr-run` uses ``--federation-config`` where Flower has it (1.42): for the ``flwr``
    beside this interpreter the installed version tells, without a process; another ``flwr`` is
    asked for its ``run --help``."""
    import sys
    from importlib.metadata import version

    from fl_geo.deploy import local_run

    installed = tuple(int(x) for x in version("flwr").split(".")[:2])

    def no_process(*args, **kwargs):
        raise AssertionError(f"started a process: {args}")

    with monkeypatch.context() as mp:
        mp.setattr(local_run.subprocess, "run", no_process)
        own = str(Path(sys.executable).parent / "flwr")
        assert local_run._supports_federation_config(own, dict(os.environ)) is (installed >= (1, 42))
    for help_text, expected in (("  --federation-config TEXT  ...", True), ("  --stream  ...", False)):
        other = tmp_path / f"other-{expected}" / "flwr"
        other.parent.mkdir()
        other.write_text(f"#!/bin/sh\necho '{help_text}'\n")
        other.chmod(0o755)
        assert local_run._supports_federation_config(str(other), dict(os.environ)) is expected
