"""Authentication of the data path: per-job tokens for clients, a leader credential for control.

The leader (the ServerApp) and the followers it runs share one secret key (32 random bytes,
`new_key`); clients never see it. Two credentials are derived from it, with separate subkeys so
that one can never be passed off as the other:

- a **job token** (`DataPathAuth.mint_job`), sent to a client inside its job's Flower message:
  ``base64url(claims) "." base64url(HMAC-SHA256(job subkey, claims))`` where the claims (JSON)
  name the job id, the shard indices the job may push to and pull from, the model version it
  was given and an expiry time (Unix seconds). A client forwards it untouched; the follower
  checks it once per ``Push``/``Pull`` stream (`DataPathAuth.verify_job`).
- a **leader MAC** (`DataPathAuth.sign_leader`): HMAC-SHA256(leader subkey, method name and the
  exact request bytes), sent in the gRPC metadata ``flgeo-leader-mac`` of every ``Control``
  call and of the leader's own pulls. Binding the method and the bytes means a MAC cannot be
  moved to another request; a client, which holds only tokens, cannot make one.

Every comparison of a MAC is `hmac.compare_digest` (constant time). What the follower does with
a verified token (one push per job, refused once the job is folded or dropped) is for the
follower service to decide (`fl_geo.ps.access`). The key travels to follower processes in a 0600 file
(`write_key_file`, ``--key-file``) or the environment variable `KEY_ENV`, never on a command
line, where ``ps`` would show it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KEY_ENV", "LEADER_MAC_HEADER", "AuthError", "DataPathAuth", "JobClaims", "key_from_env",
           "new_key", "read_key_file", "write_key_file"]

KEY_BYTES = 32
KEY_ENV = "FLGEO_PS_KEY"  # hex of the key, for follower processes started without --key-file
LEADER_MAC_HEADER = "flgeo-leader-mac"  # gRPC metadata key (lower case, as gRPC requires)
_JOB_CONTEXT = b"flgeo data path job token v1"
_LEADER_CONTEXT = b"flgeo data path leader request v1"
_MAX_TOKEN_CHARS = 4096  # far above a real token; refuse the rest before decoding anything


class AuthError(Exception):
    """A credential that does not verify. ``forged`` tells a missing, garbled or forged
    credential (gRPC UNAUTHENTICATED) from a genuine one used beyond its scope (PERMISSION_DENIED)."""

    def __init__(self, message: str, *, forged: bool) -> None:
        super().__init__(message)
        self.forged = forged


@dataclass(frozen=True)
class JobClaims:
    """What a verified job token allows: ``job`` may push to and pull from ``shards``; it was
    given model ``version``; the token is void after ``expires`` (Unix seconds)."""

    job: str
    shards: tuple[int, ...]
    version: int
    expires: float


def new_key() -> bytes:
    """A fresh shared secret (the leader makes one per run unless ``ps.key_file`` names one)."""
    return secrets.token_bytes(KEY_BYTES)


MAX_KEY_FILE_BYTES = 4096  # a hex key and a newline; anything longer is not a key file
MIN_DISTINCT_BYTES = 8  # a random 32-byte key has ~28 distinct values; 8 or fewer is a pattern


def _check_key(key: bytes, where: str = "a data path key") -> bytes:
    """``key`` unless it is too short or plainly not random: all zeros, one byte repeated, or any
    other pattern of fewer than `MIN_DISTINCT_BYTES` byte values (a random key of `KEY_BYTES`
    bytes is refused by this with probability below 1e-20)."""
    if not isinstance(key, bytes) or len(key) < KEY_BYTES:
        raise ValueError(f"{where} needs at least {KEY_BYTES} bytes")
    if len(set(key)) < MIN_DISTINCT_BYTES:
        raise ValueError(f"{where} is not random ({len(set(key))} distinct byte values); make one with: "
                         f"(umask 077; openssl rand -hex {KEY_BYTES} > ps.key)")
    return key


def write_key_file(path: str | os.PathLike[str], key: bytes) -> Path:
    """Write ``key`` as hex to a new file readable by its owner alone (mode 0600 from creation,
    so there is no moment where others could read it). Refuses to overwrite."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_check_key(key).hex() + "\n")
    return path


def _parse_hex_key(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where} does not hold a hex key") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"{where} holds {len(key)} bytes; a data path key needs at least {KEY_BYTES} "
                         f"(make one with: (umask 077; openssl rand -hex {KEY_BYTES} > ps.key))")
    return _check_key(key, where)


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The key in ``path`` (hex). Refused when the file is readable or writable by anyone but its
    owner (a key others can read authenticates nobody: the rule ssh applies to private keys), when
    it is not a regular file of at most `MAX_KEY_FILE_BYTES` (a FIFO would block the reader), or
    when the key is weak (`_check_key`)."""
    path = Path(path)
    # Non-blocking: a FIFO opens at once (and is refused below) instead of waiting for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)  # of what was opened, not of what the name points to a moment later
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"data path key file {path} is not a regular file ({stat.filemode(st.st_mode)})")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"data path key file {path} has mode {stat.filemode(st.st_mode)}; "
                                  f"it must be private to its owner (chmod 600 {path})")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"data path key file {path} is over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"data path key file {path} does not hold a hex key") from None
    return _parse_hex_key(text, f"data path key file {path}")


def key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The key in `KEY_ENV` (hex), or None when it is unset."""
    value = (os.environ if environ is None else environ).get(KEY_ENV)
    return None if value is None else _parse_hex_key(value, f"${KEY_ENV}")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class DataPathAuth:
    """Mints and verifies the data path's credentials with one shared key (see the module)."""

    def __init__(self, key: bytes) -> None:
        key = _check_key(key)
        self._job_key = hmac.new(key, _JOB_CONTEXT, hashlib.sha256).digest()
        self._leader_key = hmac.new(key, _LEADER_CONTEXT, hashlib.sha256).digest()

    # -- job tokens --------------------------------------------------------------------------
    def mint_job(self, job: str, shards: Iterable[int], version: int, ttl_s: float,
                 now: float | None = None) -> str:
        """A token letting ``job`` push to and pull from ``shards`` for ``ttl_s`` seconds."""
        if not job:
            raise ValueError("a job token needs a job id")
        issued = time.time() if now is None else now
        claims = {"job": job, "shards": sorted({int(s) for s in shards}), "version": int(version),
                  "exp": issued + float(ttl_s)}
        body = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
        return f"{_b64(body)}.{_b64(self._job_mac(body))}"

    def _job_mac(self, body: bytes) -> bytes:
        return hmac.new(self._job_key, body, hashlib.sha256).digest()

    def verify_job(self, token: object, job: str | None, shard: int, now: float | None = None) -> JobClaims:
        """The claims of ``token`` if it is genuine, unexpired, for ``job`` (any job for None: a
        pull names its job in the token alone) and covers ``shard``; `AuthError` otherwise. The MAC is checked before the claims are parsed, so nothing a
        forger wrote is interpreted."""
        if not isinstance(token, str) or not token:
            raise AuthError("no job token", forged=True)
        if len(token) > _MAX_TOKEN_CHARS or token.count(".") != 1:
            raise AuthError("malformed job token", forged=True)
        body_text, mac_text = token.split(".")
        try:
            body, mac = _unb64(body_text), _unb64(mac_text)
        except (binascii.Error, ValueError):
            raise AuthError("malformed job token (not base64url)", forged=True) from None
        if not hmac.compare_digest(mac, self._job_mac(body)):
            raise AuthError("job token does not verify (forged, garbled or from another key)", forged=True)
        claims = _parse_claims(body)
        if job is not None and claims.job != job:
            raise AuthError(f"job token is for job {claims.job!r}, not {job!r}", forged=False)
        if shard not in claims.shards:
            raise AuthError(f"job token of {job!r} covers shards {list(claims.shards)}, not {shard}", forged=False)
        if (time.time() if now is None else now) >= claims.expires:
            raise AuthError(f"job token of {job!r} expired", forged=False)
        return claims

    # -- leader requests ---------------------------------------------------------------------
    def sign_leader(self, method: str, request: bytes) -> str:
        """The leader MAC (hex) of one request to ``method`` (``Control`` or ``Pull``)."""
        return hmac.new(self._leader_key, method.encode() + b"\n" + request, hashlib.sha256).hexdigest()

    def verify_leader(self, method: str, request: bytes, mac: object) -> None:
        """`AuthError` unless ``mac`` is the leader MAC of exactly this request."""
        if not isinstance(mac, str) or not mac:
            raise AuthError(f"{method} request carries no leader credential", forged=True)
        if not hmac.compare_digest(mac.encode("ascii", "replace"), self.sign_leader(method, request).encode()):
            raise AuthError(f"{method} request's leader credential does not verify", forged=True)


def _parse_claims(body: bytes) -> JobClaims:
    """Claims of a token whose MAC verified (so written by the leader; checked all the same)."""
    try:
        c = json.loads(body)
        job, shards, version, exp = c["job"], c["shards"], c["version"], c["exp"]
        if not (isinstance(job, str) and isinstance(shards, list) and all(type(s) is int for s in shards)
                and type(version) is int and isinstance(exp, int | float)):
            raise TypeError("claim of the wrong type")
    except (ValueError, KeyError, TypeError) as exc:
        raise AuthError(f"job token claims are malformed: {exc}", forged=True) from None
    return JobClaims(job, tuple(shards), version, float(exp))
