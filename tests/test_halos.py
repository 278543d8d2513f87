"""HALoS local and global parameter servers (fl_geo.core.halos) against docs/algorithms.md §6 and §2."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fl_geo.core.halos import (
    HALOS_DEFAULTS,
    GlobalParameterServer,
    LocalParameterServer,
    ParameterServer,
)
from fl_geo.core.state import CHUNK_ELEMS

NUMEL = 37


def _rand(seed: int, numel: int = NUMEL, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def _lps(params0: torch.Tensor | None = None, **kwargs: Any) -> LocalParameterServer:
    args: dict[str, Any] = {"lr": 0.4, "momentum": 0.9, "buffer_size": 2, "accumulate": 3,
                            "alpha": 0.25}
    args.update(kwargs)
    return LocalParameterServer(_rand(0) if params0 is None else params0, **args)


def _gps(params0: torch.Tensor | None = None, **kwargs: Any) -> GlobalParameterServer:
    args: dict[str, Any] = {"lr": 0.3, "momentum": 0.5, "buffer_size": 2}
    args.update(kwargs)
    return GlobalParameterServer(_rand(0) if params0 is None else params0, **args)


class RefDelayedNesterov:
    """docs/algorithms.md §2 written out literally, in float64::

        acc += g
        if (t+1) % N == 0:  m = β·m + acc/N;  θ -= lr·((1 − c·N + c)·β·m + g/N);  acc = 0
        else:               θ -= lr·(c·β·m + g/N)
        t += 1
    """

    def __init__(self, numel: int, lr: float, beta: float, n: int, c: float) -> None:
        self.lr, self.beta, self.n, self.c = lr, beta, n, c
        self.m = torch.zeros(numel, dtype=torch.float64)
        self.acc = torch.zeros(numel, dtype=torch.float64)
        self.t = 0

    def step(self, theta: torch.Tensor, g32: torch.Tensor) -> torch.Tensor:
        lr, beta, n, c = self.lr, self.beta, self.n, self.c
        g = g32.double()
        self.acc = self.acc + g
        if (self.t + 1) % n == 0:
            self.m = beta * self.m + self.acc / n
            theta = theta - lr * ((1 - c * n + c) * beta * self.m + g / n)
            self.acc = torch.zeros_like(self.acc)
        else:
            theta = theta - lr * (c * beta * self.m + g / n)
        self.t += 1
        return theta


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-6)


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two snapshots are bit-identical (tensors by torch.equal, the rest by ==)."""
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert isinstance(b[key], torch.Tensor) and a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key] and type(a[key]) is type(b[key]), key


def _send_and_merge(lps: LocalParameterServer, theta_g: torch.Tensor) -> torch.Tensor:
    update = lps.make_global_update()
    lps.merge(theta_g)
    return update


# ---------------------------------------------------------------------------------------------
# Shared interface, constructor, defaults


def test_both_tiers_share_the_interface() -> None:
    for server in (_lps(), _gps()):
        assert isinstance(server, ParameterServer)
        assert server.version == 0
        assert server.params.dtype == torch.float32 and server.params.is_contiguous()
        assert torch.equal(server.params, _rand(0))


def test_constructor_copies_params0_and_converts_to_fp32() -> None:
    params0 = _rand(0)
    lps = _lps(params0)
    params0.add_(1.0)
    assert torch.equal(lps.params, _rand(0))
    assert torch.equal(lps.merged_params, _rand(0))
    assert lps.merged_params.data_ptr() != lps.params.data_ptr()
    gps = _gps(_rand(0).to(torch.bfloat16))
    assert gps.params.dtype == torch.float32
    assert torch.equal(gps.params, _rand(0).to(torch.bfloat16).float())


@pytest.mark.parametrize(
    "kwargs",
    [{"momentum": 1.0}, {"buffer_size": 0}, {"lr": -1.0}, {"accumulate": 0}, {"alpha": 1.5},
     {"alpha": float("nan")}, {"accumulate": True}],
)
def test_constructor_rejects_bad_hyperparameters(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _lps(**kwargs)


@pytest.mark.parametrize("params0", [torch.zeros(2, 3), torch.zeros(0), torch.arange(4),
                                     torch.tensor([0.0, float("nan")])])
def test_constructor_rejects_bad_params0(params0: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        _gps(params0)


def test_halos_defaults_are_the_papers_and_build_servers() -> None:
    d = HALOS_DEFAULTS
    assert (d["local_steps"], d["accumulate"], d["alpha"]) == (8, 32, 0.25)
    assert d["global_lr"] == pytest.approx(0.15 * 2)
    assert (d["global_momentum"], d["global_buffer_size"]) == (0.5, 2)
    assert d["local_lr"] == pytest.approx(0.2 * 16)
    assert (d["local_momentum"], d["local_buffer_size"]) == (0.9, 16)
    lps = LocalParameterServer(
        _rand(0), lr=d["local_lr"], momentum=d["local_momentum"],
        buffer_size=d["local_buffer_size"], activation=d["local_activation"],
        accumulate=d["accumulate"], alpha=d["alpha"],
    )
    gps = GlobalParameterServer(
        _rand(0), lr=d["global_lr"], momentum=d["global_momentum"],
        buffer_size=d["global_buffer_size"], activation=d["global_activation"],
    )
    assert lps.accumulate == 32 and lps.alpha == 0.25
    assert lps.optimizer.buffer_size == 16 and gps.optimizer.buffer_size == 2


def test_pseudo_gradient_sign_moves_both_tiers_toward_the_sender() -> None:
    """Δ = base − local: with lr/N = 1 and no momentum, one step lands on the sender's model."""
    theta0 = _rand(0)
    worker = _rand(1)
    lps = _lps(theta0, lr=1.0, momentum=0.0, buffer_size=1, accumulate=1)
    lps.apply(theta0 - worker)
    _close(lps.params, worker)
    gps = _gps(theta0, lr=2.0, momentum=0.0, buffer_size=2)
    gps.apply(lps.make_global_update())  # U = θ^merged − θ_k = θ0 − θ_k
    _close(gps.params, lps.params)


# ---------------------------------------------------------------------------------------------
# Merge convention


@pytest.mark.parametrize("alpha", [1.0, 0.0, 0.25])
def test_merge_convention_alpha_is_the_weight_of_the_global_model(alpha: float) -> None:
    lps = _lps(alpha=alpha, accumulate=1)
    lps.apply(_rand(2, scale=0.1))
    local = lps.params.clone()
    theta_g = _rand(3)
    lps.make_global_update()
    assert lps.outstanding
    lps.merge(theta_g)
    if alpha == 1.0:
        assert torch.equal(lps.params, theta_g)
    elif alpha == 0.0:
        assert torch.equal(lps.params, local)
    else:
        torch.testing.assert_close(lps.params, 0.75 * local + 0.25 * theta_g,
                                   rtol=1e-6, atol=1e-7)
    assert torch.equal(lps.merged_params, lps.params)
    assert lps.merged_params.data_ptr() != lps.params.data_ptr()
    assert lps.merged_version == lps.version == 1
    assert not lps.outstanding
    theta_g.add_(1.0)  # the merge copied θ_g
    assert torch.equal(lps.merged_params, lps.params)


def test_merge_without_an_outstanding_send_raises() -> None:
    lps = _lps(accumulate=1)
    with pytest.raises(RuntimeError, match="outstanding"):
        lps.merge(_rand(3))
    lps.apply(_rand(2))
    _send_and_merge(lps, _rand(3))
    before = lps.snapshot()
    with pytest.raises(RuntimeError, match="outstanding"):
        lps.merge(_rand(4))  # a duplicated reply
    _assert_same_state(before, lps.snapshot())


# ---------------------------------------------------------------------------------------------
# Send condition: version == merged_version + K, at most one send outstanding


def test_send_window() -> None:
    k = 4
    lps = _lps(accumulate=k, buffer_size=2)
    merged0 = lps.params.clone()
    for i in range(k):
        assert not lps.ready_to_send()
        with pytest.raises(RuntimeError, match="not ready"):
            lps.make_global_update()
        lps.apply(_rand(10 + i, scale=0.1))
    assert lps.ready_to_send() and lps.version == k

    update = lps.make_global_update()
    assert torch.equal(update, merged0 - lps.params)
    assert update.data_ptr() not in (lps.params.data_ptr(), lps.merged_params.data_ptr())
    assert lps.outstanding and lps.sends == 1
    with pytest.raises(RuntimeError, match="outstanding"):
        lps.make_global_update()

    # Updates between the send and its merge (here up to version 2K and past it) are not sent.
    for i in range(k + 1):
        lps.apply(_rand(20 + i, scale=0.1))
        assert not lps.ready_to_send()
    assert lps.version == 2 * k + 1 and lps.merged_version == 0

    lps.merge(_rand(5))
    base = lps.params.clone()
    assert lps.merged_version == 2 * k + 1 and not lps.ready_to_send()
    for i in range(k):
        assert not lps.ready_to_send()
        lps.apply(_rand(30 + i, scale=0.1))
    assert lps.ready_to_send()
    assert torch.equal(lps.make_global_update(), base - lps.params)
    assert lps.sends == 2


def test_apply_refuses_while_a_send_is_due() -> None:
    """One more update would pass merged_version + K and the LPS would never send again."""
    lps = _lps(accumulate=2)
    lps.apply(_rand(1))
    lps.apply(_rand(2))
    before = lps.snapshot()
    with pytest.raises(RuntimeError, match="make_global_update"):
        lps.apply(_rand(3))
    _assert_same_state(before, lps.snapshot())
    lps.make_global_update()
    lps.apply(_rand(3))  # allowed while the send is outstanding
    assert lps.version == 3


# ---------------------------------------------------------------------------------------------
# Delayed Nesterov at both tiers against docs/algorithms.md §2


@pytest.mark.parametrize("tier", ["local", "global"])
@pytest.mark.parametrize(("n", "c"), [(2, 0.0), (4, 0.0), (4, 0.5)])
def test_delayed_nesterov_matches_the_formula(tier: str, n: int, c: float) -> None:
    lr, beta, steps = 0.7, 0.8, 13  # 13: several full windows and a partial one
    theta0 = _rand(0)
    if tier == "local":
        server: ParameterServer = _lps(theta0, lr=lr, momentum=beta, buffer_size=n,
                                       activation=c, accumulate=1000)
    else:
        server = _gps(theta0, lr=lr, momentum=beta, buffer_size=n, activation=c)
    ref = RefDelayedNesterov(NUMEL, lr, beta, n, c)
    theta = theta0.double()
    for t in range(steps):
        g = _rand(100 + t, scale=0.1)
        server.apply(g)
        theta = ref.step(theta, g)
        _close(server.params, theta)
    assert server.version == steps
    state = server.optimizer.state_dict()
    _close(state["momentum_buffer"], ref.m)
    _close(state["accumulator"], ref.acc)


@pytest.mark.parametrize("c", [0.0, 0.5])
def test_global_momentum_zero_is_plain_sgd_with_lr_over_n(c: float) -> None:
    """β = 0 zeroes both coefficients on m: θ −= lr·(0·m + g/N) on every step, boundary or not."""
    lr, n = 0.3, 2
    gps = _gps(lr=lr, momentum=0.0, buffer_size=n, activation=c)
    theta = _rand(0)
    for t in range(7):
        u = _rand(200 + t, scale=0.1)
        gps.apply(u)
        theta.add_(u / n, alpha=-lr)  # the kernel's own operations: g/N, then θ += −lr·(g/N)
        assert torch.equal(gps.params, theta)
    theta64 = _rand(0).double()
    for t in range(7):
        theta64 -= (lr / n) * _rand(200 + t, scale=0.1).double()
    _close(gps.params, theta64)


def test_lps_optimizer_state_persists_across_merges() -> None:
    lr, beta, n, k, alpha = 0.4, 0.9, 2, 3, 0.25  # K = 3, N = 2: windows straddle merges
    lps = _lps(lr=lr, momentum=beta, buffer_size=n, accumulate=k, alpha=alpha)
    ref = RefDelayedNesterov(NUMEL, lr, beta, n, 0.0)
    theta = _rand(0).double()
    for merge in range(3):
        for i in range(k):
            g = _rand(300 + 10 * merge + i, scale=0.1)
            lps.apply(g)
            theta = ref.step(theta, g)
        theta_g = _rand(400 + merge)
        _send_and_merge(lps, theta_g)
        theta = (1 - alpha) * theta + alpha * theta_g.double()
        _close(lps.params, theta)
        state = lps.optimizer.state_dict()
        assert state["steps"] == ref.t == lps.version
        assert state["momentum_buffer"].abs().sum() > 0
        _close(state["momentum_buffer"], ref.m)
        _close(state["accumulator"], ref.acc)
    g = _rand(500, scale=0.1)
    lps.apply(g)
    _close(lps.params, ref.step(theta, g))


# ---------------------------------------------------------------------------------------------
# Bad input leaves everything bit-identical


def _bad_inputs(server: ParameterServer) -> list[Any]:
    nan = _rand(7)
    nan[5] = float("nan")
    inf = _rand(7)
    inf[-1] = float("-inf")
    return [nan, inf, _rand(7, NUMEL + 1), _rand(7, NUMEL - 1), _rand(7).reshape(1, NUMEL),
            _rand(7).double(), _rand(7).to(torch.bfloat16), _rand(7).tolist(), server.params]


def _server_with_history(tier: str) -> ParameterServer:
    """A server with allocated optimizer buffers (LPS: with a send outstanding)."""
    server: ParameterServer = _lps(accumulate=3) if tier == "local" else _gps()
    for i in range(3):
        server.apply(_rand(600 + i, scale=0.1))
    if isinstance(server, LocalParameterServer):
        server.make_global_update()
    return server


@pytest.mark.parametrize("tier", ["local", "global"])
def test_bad_updates_raise_and_change_nothing(tier: str) -> None:
    server = _server_with_history(tier)
    before = server.snapshot()
    for bad in _bad_inputs(server):
        with pytest.raises(ValueError):
            server.apply(bad)
        _assert_same_state(before, server.snapshot())


def test_bad_global_params_raise_and_change_nothing() -> None:
    lps = _server_with_history("local")
    assert isinstance(lps, LocalParameterServer)
    before = lps.snapshot()
    for bad in _bad_inputs(lps)[:-1]:  # merging θ_k with itself would be harmless
        with pytest.raises(ValueError):
            lps.merge(bad)
        _assert_same_state(before, lps.snapshot())
    assert lps.outstanding


def test_non_finite_value_past_the_first_chunk_is_found() -> None:
    numel = CHUNK_ELEMS + 5
    gps = GlobalParameterServer(torch.zeros(numel), lr=0.1, momentum=0.5, buffer_size=2)
    update = torch.zeros(numel)
    update[-1] = float("nan")
    with pytest.raises(ValueError, match="1 NaN"):
        gps.apply(update)
    assert gps.version == 0 and torch.equal(gps.params, torch.zeros(numel))


# ---------------------------------------------------------------------------------------------
# Snapshot / restore


def _continue(server: ParameterServer, seed: int) -> list[torch.Tensor]:
    """Drive a server through more events; return what it emitted (LPS sends, GPS replies)."""
    out: list[torch.Tensor] = []
    for i in range(7):
        if isinstance(server, LocalParameterServer):
            if server.outstanding and i == 2:
                server.merge(_rand(seed + 50))
            if server.ready_to_send():
                out.append(server.make_global_update())
        server.apply(_rand(seed + i, scale=0.1))
        out.append(server.params.clone())
    return out


@pytest.mark.parametrize("tier", ["local", "global"])
def test_snapshot_restore_continues_bit_identically(tier: str) -> None:
    original = _server_with_history(tier)
    snap = original.snapshot()
    # A server built differently (other params0 and hyperparameters) takes on the whole state.
    if tier == "local":
        copy: ParameterServer = _lps(_rand(9), lr=0.1, momentum=0.5, buffer_size=4,
                                     accumulate=5, alpha=0.5)
    else:
        copy = _gps(_rand(9), lr=0.1, momentum=0.0, buffer_size=4, activation=0.5)
    copy.restore(snap)
    _assert_same_state(snap, copy.snapshot())
    a, b = _continue(original, 700), _continue(copy, 700)
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    _assert_same_state(original.snapshot(), copy.snapshot())


@pytest.mark.parametrize("tier", ["local", "global"])
def test_snapshot_and_restore_never_alias(tier: str) -> None:
    server = _server_with_history(tier)
    snap = server.snapshot()
    kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in snap.items()}
    server.apply(_rand(800, scale=0.1))  # the snapshot does not follow the server
    assert torch.equal(snap["params"], kept["params"])

    server.restore(snap)
    restored = server.snapshot()
    for value in snap.values():
        if isinstance(value, torch.Tensor):
            value.add_(1.0)
    for value in snap["optimizer"].values():
        if isinstance(value, torch.Tensor):
            value.add_(1.0)
    _assert_same_state(restored, server.snapshot())


def _corruptions(snap: dict[str, Any]) -> list[dict[str, Any]]:
    def with_(key: str, value: Any) -> dict[str, Any]:
        return {**snap, key: value}

    def with_opt(key: str, value: Any) -> dict[str, Any]:
        return {**snap, "optimizer": {**snap["optimizer"], key: value}}

    bad = [
        with_("params", torch.zeros(NUMEL + 1)),
        with_("params", torch.zeros(1, NUMEL)),
        with_("params", torch.zeros(NUMEL, dtype=torch.float64)),
        with_opt("momentum_buffer", torch.zeros(NUMEL - 1)),
        with_opt("accumulator", torch.zeros(NUMEL, dtype=torch.float16)),
        with_opt("numel", NUMEL + 1),
        with_opt("buffer_size", 0),
        with_opt("steps", snap["version"] + 1),  # optimizer steps must equal version
        with_("version", -1),
        with_("version", 1.5),
        with_("optimizer", None),
        with_("kind", "other"),
        {k: v for k, v in snap.items() if k != "params"},
        {**snap, "extra": 1},
        [],
    ]
    if "merged_params" in snap:
        bad += [
            with_("merged_params", torch.zeros(NUMEL + 1)),
            with_("merged_params", torch.zeros(NUMEL, dtype=torch.bfloat16)),
            with_("merged_version", snap["version"] + 1),
            with_("outstanding", 1),
            with_("outstanding", False),  # 3 updates since the merge with K = 3 and no send: ok
            with_("accumulate", 0),
            with_("alpha", 2.0),
            with_("sends", -1),
        ]
    return bad


@pytest.mark.parametrize("tier", ["local", "global"])
def test_bad_snapshots_raise_and_change_nothing(tier: str) -> None:
    server = _server_with_history(tier)
    server.apply(_rand(900, scale=0.1))
    snap = server.snapshot()
    before = server.snapshot()
    optimizer = server.optimizer
    rejected = 0
    for bad in _corruptions(snap):
        if isinstance(bad, dict) and bad.get("outstanding") is False and tier == "local":
            continue  # consistent (see below)
        with pytest.raises(ValueError):
            server.restore(bad)  # type: ignore[arg-type]
        rejected += 1
        _assert_same_state(before, server.snapshot())
        assert server.optimizer is optimizer
    assert rejected >= 15


def test_send_window_of_a_snapshot_must_be_consistent() -> None:
    """Before a send, version − merged_version <= K; with a send outstanding, >= K."""
    lps = _lps(accumulate=3)
    for i in range(3):
        lps.apply(_rand(i))
    at_k = lps.snapshot()  # version 3, merged_version 0, nothing sent
    lps.make_global_update()
    lps.apply(_rand(4))
    before = lps.snapshot()  # version 4, send outstanding
    for bad in (
        {**before, "outstanding": False},  # 4 > K updates unsent: the LPS would never send
        {**at_k, "accumulate": 4, "outstanding": True, "sends": 1},  # sent after 3 < K
    ):
        with pytest.raises(ValueError, match="inconsistent"):
            lps.restore(bad)
        _assert_same_state(before, lps.snapshot())
    other = _lps(accumulate=3)
    other.restore({**at_k, "outstanding": True, "sends": 1})  # sent exactly at K: consistent
    assert other.outstanding and not other.ready_to_send()


def test_restoring_a_global_snapshot_into_a_local_server_fails() -> None:
    gps, lps = _gps(), _lps()
    with pytest.raises(ValueError):
        lps.restore(gps.snapshot())
    with pytest.raises(ValueError):
        gps.restore(lps.snapshot())
