"""Atomic, verified, rotating server checkpoints (framework-free).

Why this shape:
- **Atomic**: a checkpoint is written to ``<name>.tmp``, flushed and fsynced, then renamed over its
  final name (a rename within one directory is atomic on POSIX), and the directory is fsynced.
  A crash mid-write leaves a ``.tmp`` file that is never read, never a half-written checkpoint;
  a failed write (a full disk) removes it and is one line naming the file (`fl_geo.atomic`).
- **Verified**: each file starts with a magic tag, the run identity (below), the payload's length
  and a sha256 over identity and payload. A file that was truncated, bit-flipped or written by
  something else fails the check and is skipped with a logged warning;
  :meth:`CheckpointStore.load_latest` falls back to the newest one that verifies.
- **Owned**: a store may carry a run identity (a JSON object: for the ServerApp, the resolved
  config minus what may change on resume, `fl_geo.run_identity.run_identity`). Its sha256, the run id,
  sits in every file's header next to the identity itself, so who wrote a file is known from its
  first bytes, without loading a model-sized payload. A store only ever deletes or overwrites
  files that carry its own run id; a store without an identity is "anonymous" (run id all zeros)
  and owns the anonymous files (the sharded parameter server's follower stores are such).
- **Rotating**: only the newest ``keep`` checkpoints of this run stay on disk (a model-sized file
  each); files of another run are never pruned.
- **Safe to load**: payloads are read with ``torch.load(weights_only=True)``: tensors, numbers,
  strings, lists, tuples and dicts only, no pickled code.

The payload is whatever the outer loop's ``state_dict()`` returns (model, outer optimizer state,
penalty statistics, counters, versions, clock, RNG); this module does not know what is inside.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fl_geo.atomic import atomic_path

log = logging.getLogger("fl_geo")

MAGIC = b"FLGEOCK2"
OLD_MAGIC = b"FLGEOCK1"  # before run identities: refused with a message that says so
# magic, run id (sha256 of the identity bytes), identity length, payload length,
# sha256(identity bytes + payload); then the identity bytes (UTF-8 JSON), then the payload.
_HEADER = struct.Struct(">8s32sIQ32s")
_OWNER = struct.Struct(">8s32s")  # the header's first fields: enough to tell who wrote a file
MAX_IDENTITY_BYTES = 1 << 20  # a resolved config is a few KiB; a header claiming more is damage
ANONYMOUS = b"\0" * 32  # the run id of a store (and its files) without an identity
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


def identity_bytes(identity: Mapping[str, Any] | None) -> bytes:
    """The canonical bytes of a run identity (sorted-key JSON); empty for no identity."""
    if identity is None:
        return b""
    return json.dumps(dict(identity), sort_keys=True, separators=(",", ":")).encode()


def run_id_of(ident: bytes) -> bytes:
    """The 32-byte run id of identity bytes: their sha256, or `ANONYMOUS` for none."""
    return hashlib.sha256(ident).digest() if ident else ANONYMOUS


def identity_diff(ours: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None, limit: int = 6) -> str:
    """What differs between two identities, for an error message: ``key: A in the checkpoint,
    B now``, at most ``limit`` keys (then a count)."""
    if ours is None or theirs is None:
        return "one of them has no run identity (anonymous store, or another program)"
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k, "<unset>") != theirs.get(k, "<unset>"))
    parts = [f"{k}: {theirs.get(k, '<unset>')!r} in the checkpoint, {ours.get(k, '<unset>')!r} now"
             for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts) if parts else "nothing visible (same keys and values)"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupt, not ours)."""


@dataclass(frozen=True)
class Checkpoint:
    """One verified checkpoint: its step, file, payload, and the identity of the run that wrote
    it (None: an anonymous store)."""

    step: int
    path: Path
    state: dict[str, Any]
    identity: dict[str, Any] | None = None


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


def _header(ident: bytes, length: int, digest: bytes) -> bytes:
    return _HEADER.pack(MAGIC, run_id_of(ident), len(ident), length, digest) + ident


def encode_checkpoint(state: dict[str, Any], identity: Mapping[str, Any] | None = None) -> bytes:
    """Header (magic, run id, lengths, sha256), identity JSON + the ``torch.save`` bytes of ``state``."""
    ident = identity_bytes(identity)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    digest = hashlib.sha256(ident)
    digest.update(payload)
    return _header(ident, len(payload), digest.digest()) + bytes(payload)


def decode_checkpoint_with_identity(data: bytes | bytearray | memoryview
                                    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(identity, state) of bytes written by :func:`encode_checkpoint`; raises CheckpointError.

    Every length is checked against the data before it is used, and the identity length against
    `MAX_IDENTITY_BYTES`, so a damaged header cannot make this read or allocate more than the
    file holds."""
    if len(data) >= len(OLD_MAGIC) and bytes(data[:len(OLD_MAGIC)]) == OLD_MAGIC:
        raise CheckpointError("written by an older fl-geo (format FLGEOCK1, without a run identity); "
                              "this version cannot resume from it")
    if len(data) < _HEADER.size:
        raise CheckpointError(f"file is {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, run_id, ident_len, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(f"not an fl-geo checkpoint (magic {magic!r})")
    if ident_len > MAX_IDENTITY_BYTES:
        raise CheckpointError(f"header claims a {ident_len}-byte run identity (limit {MAX_IDENTITY_BYTES})")
    view = memoryview(data)
    ident = bytes(view[_HEADER.size:_HEADER.size + ident_len])
    payload = view[_HEADER.size + ident_len:]
    if len(ident) != ident_len or len(payload) != length:
        raise CheckpointError(f"truncated: header says {ident_len} + {length} bytes, file holds "
                              f"{len(view) - _HEADER.size}")
    check = hashlib.sha256(ident)
    check.update(payload)
    if check.digest() != digest:
        raise CheckpointError("sha256 mismatch: the file was modified or damaged after it was written")
    if run_id_of(ident) != run_id:  # the digest does not cover the header's id: owner_of reads it alone
        raise CheckpointError("the header's run id is not the one of the run identity it carries "
                              "(the header was rewritten)")
    try:
        identity = json.loads(ident) if ident else None
    except ValueError as exc:
        raise CheckpointError(f"run identity is not JSON: {exc}") from None
    if identity is not None and not isinstance(identity, dict):
        raise CheckpointError(f"run identity is a {type(identity).__name__}, expected an object")
    try:
        state = torch.load(_MemoryReader(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "untrusted"
        raise CheckpointError(f"payload does not load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"payload is a {type(state).__name__}, expected a dict")
    return identity, state


def decode_checkpoint(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Verify and load bytes written by :func:`encode_checkpoint`; raises CheckpointError."""
    return decode_checkpoint_with_identity(data)[1]


def owner_of(path: Path) -> bytes | None:
    """The run id in a checkpoint file's header (read from its first bytes only), or None when the
    file cannot be read or does not start like a current fl-geo checkpoint. Not verified: a
    damaged id reads as another run's, so the worst a bit flip here can do is keep a file."""
    try:
        with path.open("rb") as fh:
            head = fh.read(_OWNER.size)
    except OSError:
        return None
    if len(head) < _OWNER.size:
        return None
    magic, run_id = _OWNER.unpack(head)
    return run_id if magic == MAGIC else None


class CheckpointStore:
    """The checkpoints of one run in one directory: ``ckpt-<step>.pt``, newest ``keep`` kept.

    ``identity``: the run identity written into every file's header (module docstring, "Owned").
    The store prunes and overwrites only files that carry its run id; `foreign_steps` lists the
    others, which the caller decides about (the ServerApp refuses to mix runs)."""

    def __init__(self, directory: str | Path, keep: int = 3, identity: Mapping[str, Any] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = int(keep)
        self.identity = dict(identity) if identity is not None else None
        self._ident = identity_bytes(identity)
        if len(self._ident) > MAX_IDENTITY_BYTES:
            raise ValueError(f"run identity of {len(self._ident)} bytes exceeds {MAX_IDENTITY_BYTES}")
        self.run_id = run_id_of(self._ident)

    def path_for(self, step: int) -> Path:
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        return self.directory / f"ckpt-{step:08d}.pt"

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present (verified or not, any owner), oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def owns(self, step: int) -> bool:
        """Whether the file of ``step`` carries this store's run id (read from its header only)."""
        return owner_of(self.path_for(step)) == self.run_id

    def own_steps(self) -> list[int]:
        """Steps of the files this run wrote (by run id), oldest first."""
        return [s for s in self.steps() if self.owns(s)]

    def foreign_steps(self) -> list[int]:
        """Steps of the files present that this store does not own: another run's, damaged
        beyond reading their header, or of an older format."""
        return [s for s in self.steps() if not self.owns(s)]

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically, then drop all but the newest
        ``keep`` of this run's. Returns the file's path. Refuses (CheckpointError, nothing
        written) to replace a file of that step that another run wrote."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path_for(step)
        if target.exists() and not self.owns(step):
            raise CheckpointError(f"{target} exists and was not written by this run (another run id); "
                                  "refusing to overwrite it: give each run its own run.checkpoint_dir")
        # Streamed straight into the file behind a header whose digest is filled in at the end
        # (hashing as it goes): no in-memory copy of a model-sized payload. The run id is in place
        # from the first write, so even a torn .tmp names its owner. `atomic_path` fsyncs and
        # renames; a full disk is a one-line OutputError and the previous checkpoints stay.
        with atomic_path(target) as tmp, tmp.open("w+b") as fh:
            fh.write(_header(self._ident, 0, b"\0" * 32))
            sink = _HashingWriter(fh)
            sink.digest.update(self._ident)
            torch.save(state, sink)
            fh.seek(0)
            fh.write(_header(self._ident, sink.length, sink.digest.digest()))
            fh.flush()
        self.prune()
        return target

    def prune(self) -> None:
        """Remove all but the newest ``keep`` of this run's checkpoints, and this run's stale
        ``.tmp`` leftovers. Files with another run id (or none readable) are never touched."""
        own = self.own_steps()
        for step in own[: max(0, len(own) - self.keep)]:
            self.path_for(step).unlink(missing_ok=True)
        for p in self.directory.glob("ckpt-*.pt.tmp"):
            if owner_of(p) == self.run_id:
                p.unlink(missing_ok=True)

    def load(self, step: int) -> Checkpoint:
        """Load and verify one checkpoint; raises CheckpointError if it does not verify."""
        path = self.path_for(step)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        try:
            identity, state = decode_checkpoint_with_identity(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        return Checkpoint(step, path, state, identity)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, whoever wrote it (the caller compares
        `Checkpoint.identity`); corrupt or partial ones are skipped with a warning. None when
        there is none."""
        for step in reversed(self.steps()):
            try:
                return self.load(step)
            except CheckpointError as exc:
                log.warning("skipping checkpoint that does not verify: %s", exc)
        return None
