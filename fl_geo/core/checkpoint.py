"""Atomic, verified, rotating server checkpoints (framework-free).

Why this shape:
- **Atomic**: a checkpoint is written to ``<name>.tmp``, flushed and fsynced, then renamed over its
  final name (a rename within one directory is atomic on POSIX), and the directory is fsynced.
  A crash mid-write leaves a ``.tmp`` file that is never read, never a half-written checkpoint.
- **Verified**: each file starts with a magic tag, the payload's length and its sha256. A file that
  was truncated, bit-flipped or written by something else fails the check and is skipped with a
  logged warning; :meth:`CheckpointStore.load_latest` falls back to the newest one that verifies.
- **Rotating**: only the newest ``keep`` checkpoints stay on disk (a model-sized file each).
- **Safe to load**: payloads are read with ``torch.load(weights_only=True)``: tensors, numbers,
  strings, lists, tuples and dicts only, no pickled code.

The payload is whatever the outer loop's ``state_dict()`` returns (model, outer optimizer state,
penalty statistics, counters, versions, clock, RNG); this module does not know what is inside.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("fl_geo")

MAGIC = b"FLGEOCK1"
_HEADER = struct.Struct(">8sQ32s")  # magic, payload length, sha256 digest
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupt, not ours)."""


@dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint: its step, file and payload."""

    step: int
    path: Path
    state: dict[str, Any]


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (best effort: not every filesystem allows opening a directory)."""
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


class _MemoryReader(io.RawIOBase):
    """A read-only, seekable file over a buffer without copying it (``io.BytesIO`` would copy:
    for a model-sized checkpoint that is one more model in memory while it loads)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


class _HashingWriter(io.RawIOBase):
    """Forwards writes to a file and keeps the sha256 and length of what went through."""

    def __init__(self, fh: Any) -> None:
        self._fh, self.digest, self.length = fh, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.digest.update(view)
        self._fh.write(view)
        self.length += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()


def _encode(state: dict[str, Any]) -> tuple[bytes, memoryview]:
    """(header, payload view): written one after the other, never joined into a second copy."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    return _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()), payload


def encode_checkpoint(state: dict[str, Any]) -> bytes:
    """Header (magic, length, sha256) + the ``torch.save`` bytes of ``state``."""
    header, payload = _encode(state)
    return header + bytes(payload)


def decode_checkpoint(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Verify and load bytes written by :func:`encode_checkpoint`; raises CheckpointError."""
    if len(data) < _HEADER.size:
        raise CheckpointError(f"file is {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"not an fl-geo checkpoint (magic {magic!r})")
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(f"truncated: header says {length} payload bytes, file holds {len(payload)}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("sha256 mismatch: the file was modified or damaged after it was written")
    try:
        state = torch.load(_MemoryReader(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "untrusted"
        raise CheckpointError(f"payload does not load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"payload is a {type(state).__name__}, expected a dict")
    return state


class CheckpointStore:
    """The checkpoints of one run in one directory: ``ckpt-<step>.pt``, newest ``keep`` kept."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = int(keep)

    def path_for(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        return self.directory / f"ckpt-{step:08d}.pt"

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present (verified or not), oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically, then drop all but the newest
        ``keep``. Returns the file's path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path_for(step)
        tmp = target.with_name(target.name + ".tmp")
        with tmp.open("w+b") as fh:
            # Stream torch.save straight into the file behind a placeholder header, hashing as
            # it goes, then fill the header in: no in-memory copy of a model-sized payload.
            fh.write(b"\0" * _HEADER.size)
            sink = _HashingWriter(fh)
            torch.save(state, sink)
            fh.seek(0)
            fh.write(_HEADER.pack(MAGIC, sink.length, sink.digest.digest()))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(target)
        _fsync_dir(self.directory)
        self.prune()
        return target

    def prune(self) -> None:
        """Remove all but the newest ``keep`` checkpoints, and stale ``.tmp`` leftovers."""
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            self.path_for(step).unlink(missing_ok=True)
        for p in self.directory.glob("ckpt-*.pt.tmp"):
            p.unlink(missing_ok=True)

    def load(self, step: int) -> Checkpoint:
        """Load and verify one checkpoint; raises CheckpointError if it does not verify."""
        path = self.path_for(step)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        try:
            return Checkpoint(step, path, decode_checkpoint(data))
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; corrupt or partial ones are skipped with a
        warning. None when there is none."""
        for step in reversed(self.steps()):
            try:
                return self.load(step)
            except CheckpointError as exc:
                log.warning("skipping checkpoint that does not verify: %s", exc)
        return None
