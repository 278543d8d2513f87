"""The app folder that ``flwr run`` packs, without the folders it would walk only to drop.

``flwr run <app>`` builds the FAB (Flower app bundle) from ``<app>``: Flower 1.42 first lists
and resolves *every* file under it, then keeps those its include rules and the app's
``.gitignore`` allow. A project folder holding its virtual environment (``make setup`` puts
``.venv`` there) has ~50,000 files, so each submission spent 4-5 s of CPU walking them for a FAB
of ~250 files. :func:`staged_app` hard-links (or copies) the project into a temporary folder,
leaving out only directories that ``.gitignore`` or Flower's own exclude rules drop as a whole
(and ``.git``), and ``flwr run`` packs that: the FAB holds the same files (a test compares the two builds).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

PROBE = "x.py"  # a name Flower's include rules keep: a directory whose probe is dropped is dropped whole
# Repository metadata: no app file lives there. In a git worktree or submodule ``.git`` is a file
# (a pointer to the repository), left out too: Flower's include rules would drop it anyway.
VCS_DIRS = frozenset({".git", ".hg", ".svn"})


def _dropped_dir_rule(app: Path):
    """A predicate on a directory's POSIX path relative to ``app``: True when Flower would drop
    every file in it (its FAB exclude rules, or the app's ``.gitignore``)."""
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns
    from flwr.common.constant import FAB_EXCLUDE_PATTERNS

    gitignore = app / ".gitignore"
    patterns = [*FAB_EXCLUDE_PATTERNS, *(load_gitignore_patterns(gitignore) if gitignore.is_file() else [])]
    if any(p.lstrip().startswith("!") for p in patterns):
        # A re-included path could sit inside an ignored folder: prune nothing, let Flower decide.
        return lambda rel: rel.rpartition("/")[2] in VCS_DIRS
    with warnings.catch_warnings():  # Flower 1.42 builds specs with a pattern class pathspec deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        spec = build_pathspec(patterns)
        spec.match_file(PROBE)  # pathspec compiles lazily on some versions: warn here, not per directory
    return lambda rel: rel.rpartition("/")[2] in VCS_DIRS or spec.match_file(f"{rel}/{PROBE}")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy packs the same bytes
        shutil.copy2(src, dst)


def stage_app(app: Path, dest: Path) -> Path:
    """Mirror ``app`` into the empty folder ``dest`` (hard links where possible), skipping the
    directories Flower would drop whole and every symbolic link (Flower skips those too).
    Returns ``dest``."""
    app = app.resolve()
    dropped = _dropped_dir_rule(app)
    for dirpath, dirnames, filenames in os.walk(app, followlinks=False):
        here = Path(dirpath)
        rel = here.relative_to(app)
        dirnames[:] = [d for d in dirnames
                       if not (here / d).is_symlink() and not dropped((rel / d).as_posix())]
        target = dest / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            src = here / name
            if not src.is_symlink() and name not in VCS_DIRS:
                _link_or_copy(src, target / name)
    return dest


@contextlib.contextmanager
def staged_app(app: Path, parent: Path | None = None) -> Iterator[Path]:
    """The staged copy of ``app`` in a fresh temporary folder (under ``parent`` if given), removed
    on exit. Each caller gets its own folder, so concurrent submissions do not meet."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="app-", dir=parent))
    try:
        # Flower names the FAB after pyproject.toml, not the folder: any folder name will do.
        yield stage_app(app, tmp / "app")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
