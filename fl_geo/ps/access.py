"""Who may push to, pull from and control one follower: the service's side of `fl_geo.ps.auth`.

`DataPathAuth` verifies a credential; `FollowerAccess` decides what a verified credential may do
on this follower, and remembers what it must: a push's header must carry a job token for that
job and this shard, a pull a job token for this shard (or the leader's MAC), and every control
request the leader's MAC. A job that the leader folded or dropped is *closed*: its token can
neither push nor pull again, so a replayed token cannot overwrite or re-add an update. Every
refusal is logged and becomes the gRPC status the client sees (`RequestError`). Without a key
(in-process tests) everything is allowed, and the log says so once.

It lives apart from `fl_geo.ps.service` so that the service's stream handling reads without the
credential rules in between, and the rules read in one place.
"""

from __future__ import annotations

import collections
import logging
import time

import grpc

from fl_geo.ps.auth import LEADER_MAC_HEADER, AuthError, DataPathAuth, JobClaims
from fl_geo.ps.frames import RequestError

__all__ = ["MAX_CLOSED_JOBS", "FollowerAccess"]

log = logging.getLogger("fl_geo")
MAX_CLOSED_JOBS = 1 << 16  # closed job ids remembered (beyond their token's expiry: none)


class FollowerAccess:
    """The credential checks of the follower holding shard ``shard``, and its closed jobs.

    Not thread-safe on its own: `check_open`, `check_pull_scope`, `opened` and `close` are
    called under the service's ``lock``, with the follower state they guard."""

    def __init__(self, auth: DataPathAuth | None, shard: int) -> None:
        self.auth = auth
        self.shard = shard
        if auth is None:
            log.warning("follower %d: the data path is NOT authenticated (no key): anyone who reaches "
                        "its port can push, pull and send control requests", shard)
        # job -> its token's expiry: jobs the leader folded or dropped; their tokens are spent
        self._closed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._expiry: dict[str, float] = {}  # job -> its token's expiry, while its push is pending

    def refuse(self, exc: AuthError, what: str, peer: str) -> RequestError:
        """Log a refused request and turn it into its gRPC status: UNAUTHENTICATED for a missing,
        garbled or forged credential, PERMISSION_DENIED for a genuine one used beyond its scope."""
        code = grpc.StatusCode.UNAUTHENTICATED if exc.forged else grpc.StatusCode.PERMISSION_DENIED
        log.warning("follower %d refused %s from %s: %s (%s)", self.shard, what, peer, exc, code.name)
        return RequestError(code, f"follower {self.shard} refused {what}: {exc}")

    def check_token(self, token: object, job: str | None, what: str, peer: str) -> JobClaims | None:
        """The claims of a job token valid for ``job`` (any job for None) on this shard; None
        without a key (open data path). Raises the refusal otherwise."""
        if self.auth is None:
            return None
        try:
            claims = self.auth.verify_job(token, job, self.shard)
        except AuthError as exc:
            raise self.refuse(exc, what, peer) from None
        return claims

    def check_open(self, job: str, what: str, peer: str) -> None:
        """Refuse a job the leader has closed (its token is spent)."""
        if self.auth is not None and job in self._closed:
            raise self.refuse(AuthError(f"job {job!r} was already folded or dropped: its token is spent "
                                        "(replay?)", forged=False), what, peer)

    def check_pull_scope(self, claims: JobClaims, version: int, peer: str) -> None:
        """A job pulls while it is open, models no older than the one it was given."""
        what = f"pull of job {claims.job!r}"
        self.check_open(claims.job, what, peer)
        if version < claims.version:
            raise self.refuse(AuthError(f"job token is for model version {claims.version}, this follower "
                                        f"holds the older {version}", forged=False), what, peer)

    def is_leader(self, method: str, request: bytes, context: grpc.ServicerContext) -> bool:
        """True when the request carries a valid leader MAC, or when there is no key (open data
        path); False when it carries none. A MAC that does not verify is refused outright."""
        if self.auth is None:
            return True
        mac = dict(context.invocation_metadata() or ()).get(LEADER_MAC_HEADER)
        if mac is None:
            return False
        try:
            self.auth.verify_leader(method, request, mac)
        except AuthError as exc:
            raise self.refuse(exc, f"{method} request", context.peer()) from None
        return True

    def opened(self, job: str, claims: JobClaims | None) -> None:
        """A push of ``job`` (with ``claims``; None without a key) is pending: keep its token's
        expiry until `close`."""
        if claims is not None:
            self._expiry[job] = claims.expires

    def close(self, jobs: list[str]) -> None:
        """Mark ``jobs`` closed (their tokens are spent). Entries are kept until their token
        expires (a spent, expired token is refused anyway); at most `MAX_CLOSED_JOBS`, oldest
        first out."""
        if self.auth is None:
            return
        now = time.time()
        for job in jobs:
            self._closed[job] = self._expiry.pop(job, float("inf"))
            self._closed.move_to_end(job)
        if len(self._closed) > MAX_CLOSED_JOBS // 2:
            for job in [j for j, exp in self._closed.items() if exp <= now]:
                del self._closed[job]
        while len(self._closed) > MAX_CLOSED_JOBS:
            self._closed.popitem(last=False)
