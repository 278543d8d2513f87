"""Replace a file so that a reader finds the old content or the new, never a torn mix.

Every result file a run leaves behind (``final_model.pt``, ``final_model.safetensors``,
checkpoints, ``summary.json``, ``meta.json``, ``config.yaml``) and every cache entry goes through
`atomic_path`: the content is written to ``<name>.tmp`` in the *same* directory (a rename is only
atomic within one filesystem), flushed and fsynced, renamed over the target with ``os.replace``,
and the directory is fsynced so the rename survives a power cut. If anything fails on the way —
the disk fills up (``ENOSPC``), the quota runs out, the writer raises — the temporary file is
removed and the previous file at the target is left exactly as it was. An ``OSError`` becomes
`fl_geo.errors.OutputError`, one line naming the file and what to do, instead of a traceback
from deep inside ``torch.save``.

The temporary name of a run's files is fixed (not random) on purpose: the run directory is held
by one writer (`fl_geo.runtime.run_lock`), and a fixed name lets a later save remove what a crash
left. Caches that several processes fill at once ask for a per-process name (``shared=True``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from fl_geo.errors import OutputError

__all__ = ["atomic_path", "fsync_dir", "tmp_path_for", "write_bytes_atomic", "write_text_atomic"]


def tmp_path_for(path: Path, shared: bool = False) -> Path:
    """The temporary file `atomic_path` writes for ``path``: ``<name>.tmp`` beside it, or with
    ``shared`` (a cache several processes may fill at once) ``<name>.<pid>.<random>.tmp``."""
    if shared:
        return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return path.with_name(path.name + ".tmp")


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every filesystem lets a directory be
    opened or fsynced, and a rename that is merely not yet durable is still atomic)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _explain(path: Path, exc: OSError) -> str:
    """One line: which file, what the OS said, and what the operator can do about it."""
    what = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free space there or point run.out_dir / the cache elsewhere; the previous file is unchanged"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "make the directory writable or write elsewhere; the previous file is unchanged"
    else:
        hint = "the previous file is unchanged"
    return f"cannot write {path}: {what} ({hint})"


@contextlib.contextmanager
def atomic_path(path: str | Path, shared: bool = False) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s new content to; on a clean exit it replaces
    ``path`` (fsync, ``os.replace``, fsync of the directory). On any exception the temporary file
    is removed and ``path`` is untouched; an ``OSError`` (the body's or the commit's) is raised as
    `OutputError` naming ``path``. The parent directory is created if missing. ``shared``: a
    temporary name of this process's own (`tmp_path_for`), for files no lock guards."""
    path = Path(path)
    tmp = tmp_path_for(path, shared)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise OutputError(_explain(path, exc)) from None
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """``data`` as the new content of ``path`` (`atomic_path`); returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) as the new content of ``path`` (`atomic_path`); returns ``path``."""
    return write_bytes_atomic(path, text.encode("utf-8"))
