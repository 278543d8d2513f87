"""The follower data path's authentication (fl_geo.ps.auth), over real gRPC on loopback.

Every test runs twice: plaintext and TLS (certificates of `fl-geo deploy certs`). A job's client
holds only what a site gets (its job token and the CA certificate); the leader's client holds the
shared key. Each refusal is checked for its gRPC status and for the follower's state: θ, the
optimizer state, the running sum and every pending push bit-identical (`torch.equal`) to before.
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.core.state import ParamSpec
from fl_geo.ps.auth import (
    KEY_ENV,
    AuthError,
    DataPathAuth,
    key_from_env,
    new_key,
    read_key_file,
    write_key_file,
)
from fl_geo.ps.channel import TlsFiles
from fl_geo.ps.client import FollowerClient
from fl_geo.ps.follower import FollowerShard
from fl_geo.ps.follower_main import load_auth
from fl_geo.ps.frames import DataPathError
from fl_geo.ps.server import FollowerServer

KEY = bytes(range(32))  # fixed: the tests are deterministic
OTHER_KEY = bytes(range(1, 33))
SHARD = 1  # the served follower holds shard 1 of 2
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def plan() -> ShardPlan:
    spec = ParamSpec(names=("a.w", "b.w", "c.w"), shapes=((300,), (200,), (500,)), dtypes=("float32",) * 3)
    return ShardPlan.build(spec, 2)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Any:
    from fl_geo.deploy.certificates import generate_certs

    return generate_certs(tmp_path_factory.mktemp("certs"), ["127.0.0.1", "localhost"], [])


class Rig:
    """One authenticating follower (shard 1) behind gRPC, a leader client and a job's client."""

    def __init__(self, plan: ShardPlan, tls: TlsFiles | None) -> None:
        s = plan.shards[SHARD]
        gen = torch.Generator().manual_seed(0)
        params = torch.randn(s.numel, generator=gen)
        self.follower = FollowerShard(plan, SHARD, build_outer_optimizer("nesterov", s.numel), params=params,
                                      wire="bf16")
        self.auth = DataPathAuth(KEY)
        self.server = FollowerServer(self.follower, tls=tls, auth=self.auth).start()
        self.ca = tls.ca_pem() if tls is not None else None
        self.leader = FollowerClient(self.server.address, retry_s=2.0, root_certificates=self.ca, leader_key=KEY)
        self.site = FollowerClient(self.server.address, retry_s=2.0, root_certificates=self.ca)  # no key
        self.numel = s.numel
        self._seed = 100

    def token(self, job: str, shards: tuple[int, ...] = (SHARD,), version: int = 0, **kw: Any) -> str:
        return self.auth.mint_job(job, shards, version, ttl_s=kw.pop("ttl_s", 600.0), **kw)

    def update(self) -> torch.Tensor:
        self._seed += 1
        return torch.randn(self.numel, generator=torch.Generator().manual_seed(self._seed)).to(torch.bfloat16)

    def push(self, job: str, token: str | None, client: FollowerClient | None = None) -> dict[str, Any]:
        return (client or self.site).push(job, SHARD, self.update(), chunk_bytes=1024, token=token)

    def close(self) -> None:
        self.leader.close()
        self.site.close()
        self.server.stop(grace=0)


@pytest.fixture(params=["plaintext", "tls"])
def rig(request, plan, certs) -> Iterator[Rig]:
    tls = TlsFiles(certs.ca_cert, certs.server_cert, certs.server_key) if request.param == "tls" else None
    r = Rig(plan, tls)
    yield r
    r.close()


def _state(f: FollowerShard) -> dict[str, Any]:
    """Everything a request could change: θ, version, optimizer state, the sum, pending pushes."""
    opt = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in f.optimizer.state_dict().items()}
    return {"version": f.version, "params": f.params.clone(), "optimizer": opt, "acc_live": f._acc_live,
            "acc": f._acc.clone() if f._acc_live else None, "folded": f._folded,
            "pending": {j: (b.data.clone(), b.received, b.complete) for j, b in f.pending.items()}}


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _refused(code: grpc.StatusCode, fn: Any, *args: Any, **kwargs: Any) -> DataPathError:
    with pytest.raises(DataPathError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, info.value
    return info.value


def _with_pending_and_sum(r: Rig) -> None:
    """A follower mid-window: one update folded into the sum, another push pending."""
    r.push("folded", r.token("folded"))
    r.leader.control("fold", job="folded", weight=0.5)
    r.push("pending", r.token("pending"))


# ---- the legitimate path ------------------------------------------------------------------------

def test_leader_and_job_clients_complete_an_outer_step(rig):
    """A job pulls and pushes with its token, the leader folds and steps with its key; the pulled
    model is the follower's, the step moves θ, and a job of the new version pulls it."""
    f = rig.follower
    token = rig.token("j1")
    version, theta = rig.site.pull(0, rig.numel, wire="fp32", token=token)
    assert version == 0 and torch.equal(theta, f.params)
    assert rig.push("j1", token) == {"ok": True, "job": "j1", "received": rig.numel}
    before = f.params.clone()
    assert rig.leader.control("has", job="j1") == {"has": True}
    rig.leader.control("norms", job="j1")
    rig.leader.control("fold", job="j1", weight=1.0)
    rig.leader.control("mean_sq_sums", total_weight=1.0)
    assert rig.leader.control("step", clip_factor=1.0, lr=0.5)["version"] == 1
    assert not torch.equal(f.params, before)
    version, theta = rig.site.pull(0, rig.numel, wire="fp32", token=rig.token("j2", version=1))
    assert version == 1 and torch.equal(theta, f.params)
    assert rig.leader.pull(0, rig.numel, wire="fp32")[0] == 1  # the leader pulls with its key


# ---- refusals -----------------------------------------------------------------------------------

def test_unauthenticated_push_and_pull_are_refused(rig, caplog):
    _with_pending_and_sum(rig)
    before = _state(rig.follower)
    _refused(UNAUTHENTICATED, rig.push, "intruder", None)
    _refused(UNAUTHENTICATED, rig.push, "pending", None)  # overwriting a pending push
    _refused(UNAUTHENTICATED, rig.site.pull, 0, rig.numel, token=None)
    assert _same(_state(rig.follower), before)
    assert "refused push of job 'intruder'" in caplog.text and "no job token" in caplog.text


def test_a_token_for_another_job_or_shard_is_refused(rig, caplog):
    _with_pending_and_sum(rig)
    before = _state(rig.follower)
    token_a = rig.token("job-a")
    err = _refused(DENIED, rig.push, "job-b", token_a)  # A's token for B
    assert "is for job 'job-a'" in err.detail
    _refused(DENIED, rig.push, "pending", token_a)  # ... or to overwrite another job's push
    err = _refused(DENIED, rig.push, "job-c", rig.token("job-c", shards=(0,)))  # another shard
    assert "covers shards [0], not 1" in err.detail
    _refused(DENIED, rig.site.pull, 0, rig.numel, token=rig.token("job-c", shards=(0,)))
    assert _same(_state(rig.follower), before)
    assert caplog.text.count("refused") >= 4


def test_a_replayed_job_token_is_refused(rig):
    """Once the leader folded (or dropped) a job, its token can neither push nor pull again."""
    token = rig.token("j1")
    rig.push("j1", token)
    rig.leader.control("fold", job="j1", weight=1.0)
    dropped = rig.token("j2")
    rig.push("j2", dropped)
    rig.leader.control("drop", job="j2")
    never = rig.token("j3")  # a job that failed before it pushed: the leader drops it anyway
    rig.leader.control("drop", job="j3")
    before = _state(rig.follower)
    for job, tok in (("j1", token), ("j2", dropped), ("j3", never)):
        err = _refused(DENIED, rig.push, job, tok)
        assert "token is spent" in err.detail
        _refused(DENIED, rig.site.pull, 0, rig.numel, token=tok)
    assert _same(_state(rig.follower), before)
    assert rig.leader.control("has", job="j1") == {"has": False}


def test_a_window_reset_spends_the_tokens_of_the_pushes_it_drops(rig):
    token = rig.token("j1")
    rig.push("j1", token)
    rig.leader.control("reset_window", drop_pending=True)
    before = _state(rig.follower)
    _refused(DENIED, rig.push, "j1", token)
    assert _same(_state(rig.follower), before)


def test_control_from_a_non_leader_is_refused(rig):
    """A site holds a valid job token and the CA certificate, but no leader key: no control op
    runs for it, neither bare nor with a MAC of another key or of another request."""
    _with_pending_and_sum(rig)
    rig.push("mine", rig.token("mine"))
    before = _state(rig.follower)
    ops = [("step", {"clip_factor": 1.0, "lr": 100.0}), ("fold", {"job": "mine", "weight": 1e6}),
           ("drop", {"job": "pending"}), ("mean_sq_sums", {"total_weight": 1e-9}),
           ("reset_window", {"drop_pending": True}), ("norms", {"job": "pending"}), ("health", {})]
    forger = FollowerClient(rig.server.address, retry_s=1.0, root_certificates=rig.ca, leader_key=OTHER_KEY)
    try:
        for op, args in ops:
            _refused(UNAUTHENTICATED, rig.site.control, op, **args)
            _refused(UNAUTHENTICATED, forger.control, op, **args)
        _refused(UNAUTHENTICATED, forger.pull, 0, rig.numel)
    finally:
        forger.close()
    # a genuine leader MAC moved onto another request (e.g. captured from a health call)
    health = b'{"op":"health","args":{},"id":"h1"}'
    mac = rig.auth.sign_leader("Control", health)
    step = b'{"op":"step","args":{"clip_factor":1.0,"lr":100.0},"id":"h1"}'
    target = "/flgeo.Follower/Control"
    channel = (grpc.secure_channel(rig.server.address, grpc.ssl_channel_credentials(rig.ca)) if rig.ca
               else grpc.insecure_channel(rig.server.address))
    with channel:
        call = channel.unary_unary(target)
        with pytest.raises(grpc.RpcError) as info:
            call(step, metadata=[("flgeo-leader-mac", mac)], timeout=5)
        assert info.value.code() == UNAUTHENTICATED
        assert b'"index":1' in call(health, metadata=[("flgeo-leader-mac", mac)], timeout=5)
    assert _same(_state(rig.follower), before)


@pytest.mark.parametrize("garble", ["mac_bit", "claims_bit", "truncated", "not_base64", "no_dot",
                                    "other_key", "empty"])
def test_a_garbled_or_forged_token_is_refused(rig, garble):
    _with_pending_and_sum(rig)
    good = rig.token("pending")
    body, mac = good.split(".")
    flip = {"A": "B"}.get(mac[5], "A")
    bad = {
        "mac_bit": f"{body}.{mac[:5]}{flip}{mac[6:]}",
        "claims_bit": f"{body[:7]}{'x' if body[7] != 'x' else 'y'}{body[8:]}.{mac}",
        "truncated": good[:-4],
        "not_base64": f"{body}.{mac[:-2]}!!",
        "no_dot": body + mac,
        "other_key": DataPathAuth(OTHER_KEY).mint_job("pending", [SHARD], 0, ttl_s=600.0),
        "empty": "",
    }[garble]
    before = _state(rig.follower)
    code = UNAUTHENTICATED
    _refused(code, rig.push, "pending", bad or None)
    _refused(code, rig.site.pull, 0, rig.numel, token=bad or None)
    assert _same(_state(rig.follower), before)


def test_an_expired_token_is_refused(rig):
    _with_pending_and_sum(rig)
    before = _state(rig.follower)
    stale = rig.token("late", now=time.time() - 700.0)  # issued 700 s ago, valid for 600 s
    _refused(DENIED, rig.push, "late", stale)
    _refused(DENIED, rig.site.pull, 0, rig.numel, token=stale)
    assert _same(_state(rig.follower), before)


# ---- the key: minting, files, environment -------------------------------------------------------

def test_tokens_bind_job_shards_version_and_expiry():
    auth = DataPathAuth(KEY)
    token = auth.mint_job("j", [1, 0, 1], 3, ttl_s=10.0, now=1000.0)
    claims = auth.verify_job(token, "j", 0, now=1005.0)
    assert (claims.job, claims.shards, claims.version, claims.expires) == ("j", (0, 1), 3, 1010.0)
    assert auth.verify_job(token, None, 1, now=1005.0).job == "j"
    with pytest.raises(AuthError, match="expired"):
        auth.verify_job(token, "j", 0, now=1010.0)
    with pytest.raises(AuthError) as info:
        DataPathAuth(OTHER_KEY).verify_job(token, "j", 0, now=1005.0)
    assert info.value.forged
    # the leader MAC and the job token use separate subkeys: neither passes for the other
    with pytest.raises(AuthError):
        auth.verify_leader("Control", b"{}", token.split(".")[1])
    with pytest.raises(ValueError, match="at least 32 bytes"):
        DataPathAuth(b"short")


def test_key_file_is_private_and_never_on_the_command_line(tmp_path, monkeypatch):
    path = write_key_file(tmp_path / "ps.key", KEY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_key_file(path) == KEY
    with pytest.raises(FileExistsError):
        write_key_file(path, KEY)  # never overwrites a key
    loose = tmp_path / "loose.key"
    loose.write_text(KEY.hex())
    loose.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_key_file(loose)
    short = write_key_file(tmp_path / "short.key", KEY)
    short.write_text("abcd")
    with pytest.raises(ValueError, match="at least 32"):
        read_key_file(short)
    assert key_from_env({KEY_ENV: KEY.hex()}) == KEY and key_from_env({}) is None
    # the follower process: --key-file, else the environment, else it refuses to start
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(SystemExit, match="no data path key"):
        load_auth(argparse.Namespace(key_file=None, index=0))
    load_auth(argparse.Namespace(key_file=str(path), index=0))
    monkeypatch.setenv(KEY_ENV, new_key().hex())
    load_auth(argparse.Namespace(key_file=None, index=0))
    with pytest.raises(SystemExit, match="chmod 600"):
        load_auth(argparse.Namespace(key_file=str(loose), index=0))
    # the leader: ps.key_file, else a fresh key per run
    from fl_geo.config import ConfigError
    from fl_geo.ps.backend import data_path_key

    assert data_path_key(str(path)) == KEY and len(data_path_key("")) == 32
    assert data_path_key("") != data_path_key("")  # fresh each time
    with pytest.raises(ConfigError, match="ps.key_file: .*chmod 600"):
        data_path_key(str(loose))


def test_a_leader_mac_wrong_only_at_its_end_is_refused():
    """The whole MAC is compared: one differing in its last hex digit, cut to a prefix, or with
    a digit appended does not verify (a comparison of a prefix would let each of these through)."""
    auth = DataPathAuth(KEY)
    request = b'{"op":"step","args":{"clip_factor":1.0},"id":"s1"}'
    mac = auth.sign_leader("Control", request)
    auth.verify_leader("Control", request, mac)
    last = "0" if mac[-1] != "0" else "1"
    for forged in (mac[:-1] + last, mac[:2], mac[:2] + "0" * (len(mac) - 2), mac + "0"):
        with pytest.raises(AuthError, match="does not verify"):
            auth.verify_leader("Control", request, forged)


@pytest.mark.parametrize("weak", [bytes(32), b"\xff" * 32, bytes(range(4)) * 8, bytes(range(7)) * 5])
def test_a_key_that_is_not_random_is_refused_everywhere_a_key_enters(weak, tmp_path, monkeypatch):
    """All zeros, one byte repeated or a short pattern: refused as a key object, as a key file
    (written or read) and from the environment; a random key of the same length is accepted."""
    with pytest.raises(ValueError, match="not random"):
        DataPathAuth(weak)
    with pytest.raises(ValueError, match="not random"):
        write_key_file(tmp_path / "w.key", weak)
    path = tmp_path / "r.key"
    path.write_text(weak.hex())
    path.chmod(0o600)
    with pytest.raises(ValueError, match="not random"):
        read_key_file(path)
    with pytest.raises(ValueError, match="not random"):
        key_from_env({KEY_ENV: weak.hex()})
    DataPathAuth(new_key())


def test_a_key_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO would block a plain read until someone writes to it (the follower would hang at
    start); a directory or a device is no key either. Each is a one-line error, at once."""
    import threading

    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    folder = tmp_path / "key.dir"
    folder.mkdir(mode=0o700)
    for path, kind in ((fifo, "p"), (folder, "d"), (Path("/dev/null"), "c")):
        errors: list[BaseException] = []
        reader = threading.Thread(target=_capture, args=(errors, read_key_file, path), daemon=True)
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), f"reading {path} blocked"
        assert len(errors) == 1 and isinstance(errors[0], ValueError), errors
        assert "not a regular file" in str(errors[0]) and f"({kind}" in str(errors[0])


def test_a_follower_serves_plaintext_only_on_loopback_unless_the_host_is_named_twice(plan, tmp_path):
    """`python -m fl_geo.ps.follower_main` (and the supervisor that starts it): no plaintext on a
    public address by a default or a typo; TLS anywhere; plaintext elsewhere only when the
    operator names that very host in --allow-plaintext-host (ps.allow_insecure_remote)."""
    from fl_geo.ps.follower_main import check_bind
    from fl_geo.ps.supervisor import FollowerSupervisor

    def bind(host, tls_ca=None, allow=None):
        check_bind(argparse.Namespace(index=0, host=host, tls_ca=tls_ca, allow_plaintext_host=allow))

    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        bind(host)
    bind("0.0.0.0", tls_ca="ca.crt")
    bind("10.0.0.5", allow="10.0.0.5")
    for host, allow in (("0.0.0.0", None), ("10.0.0.5", None), ("10.0.0.5", "10.0.0.6"), ("dc1.example", "")):
        with pytest.raises(SystemExit, match="not a loopback address"):
            bind(host, allow=allow)
    with pytest.raises(ValueError, match="without TLS"):
        FollowerSupervisor(plan, tmp_path / "sup", host="0.0.0.0")
    assert FollowerSupervisor(plan, tmp_path / "sup", host="0.0.0.0", allow_plaintext_remote=True).host == "0.0.0.0"


def _capture(errors: list[BaseException], fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


def test_supervisor_gives_followers_the_key_in_the_environment_not_argv(plan, tmp_path, monkeypatch):
    """A follower started as a fresh interpreter (``FL_GEO_RANK_START=spawn``; every other
    supervisor test forks them from the fork server, whose pickled arguments carry the key)
    verifies the supervisor's tokens and leader MAC; its command line (what `ps` shows) holds no
    key."""
    from fl_geo.ps.supervisor import FollowerSupervisor

    monkeypatch.setenv("FL_GEO_RANK_START", "spawn")
    key = new_key()
    one = ShardPlan.build(plan.spec, 1)  # one process is enough
    with FollowerSupervisor(one, tmp_path, optimizer_name="avg", keep=1, key=key) as sup:
        sup.start(torch.zeros(plan.spec.numel))
        for i in range(sup.num):
            cmdline = Path(f"/proc/{sup.pid(i)}/cmdline").read_bytes().decode()
            assert "fl_geo.ps.follower_main" in cmdline  # a fresh interpreter, not a forked one
            assert key.hex() not in cmdline and key.hex() not in " ".join(sup._procs[i].process.args)
            assert key.hex() in Path(f"/proc/{sup.pid(i)}/environ").read_bytes().decode(errors="replace")
        with FollowerClient(sup.addresses[0], retry_s=1.0) as site:
            _refused(UNAUTHENTICATED, site.control, "health")
            token = sup.auth.mint_job("j", [0], 0, ttl_s=60.0)
            site.push("j", 0, torch.zeros(one.shards[0].numel, dtype=torch.bfloat16), token=token)
        with sup.client(0) as leader:
            assert leader.control("has", job="j") == {"has": True}
    assert os.environ.get(KEY_ENV) != key.hex()  # only the followers' environment holds it
