"""Outer optimizers against their references: torch SGD, docs/algorithms.md §2, Flower 1.41."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam as FlowerFedAdam
from flwr.serverapp.strategy import FedAvgM as FlowerFedAvgM
from flwr.serverapp.strategy import FedYogi as FlowerFedYogi
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.outer import (
    OUTER_OPTIMIZERS,
    SGD,
    DelayedNesterov,
    FedAdam,
    FedYogi,
    Nesterov,
    build_outer_optimizer,
)
from fl_geo.core.state import CHUNK_ELEMS, ParamSpec, flatten, pseudo_grad, unflatten

# Crosses a chunk boundary of the kernels, with a ragged tail.
NUMEL = CHUNK_ELEMS + 4099


def _grads(steps: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * 0.01 for _ in range(steps)]


def _params(numel: int = NUMEL, seed: int = 1) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# DiLoCo with lr 1, momentum 0 is FedAvg


def test_outer_sgd_lr1_momentum0_equals_fedavg_exactly() -> None:
    """θ − mean(θ − θ_i) == mean(θ_i) bit for bit on dyadic data.

    In exact arithmetic the identity always holds. In fp32 it holds bit for bit only when every
    intermediate is representable (here: multiples of 1/64 in a small range, 4 workers so the
    division by Σw is exact); on random data the two sides differ by the rounding of θ − θ_i and
    θ − Δ̄, which the second half checks with an ulp-level tolerance.
    """
    gen = torch.Generator().manual_seed(0)
    numel, workers = 10_000, 4
    theta = torch.randint(-512, 512, (numel,), generator=gen).float() / 8
    locals_ = [theta + torch.randint(-64, 64, (numel,), generator=gen).float() / 64
               for _ in range(workers)]
    acc = WeightedAccumulator(numel)
    for local in locals_:
        acc.add(pseudo_grad(theta, local), 1.0)
    fedavg = torch.stack(locals_).sum(0) / workers

    for name, kwargs in (("nesterov", {"lr": 1.0, "momentum": 0.0}), ("avg", {})):
        params = theta.clone()
        build_outer_optimizer(name, numel, **kwargs).step(params, acc.mean(out=torch.empty(numel)))
        assert torch.equal(params, fedavg), name

    # random data: equal up to fp32 rounding of the pseudo-gradients
    theta = torch.randn(numel, generator=gen)
    locals_ = [theta + 0.01 * torch.randn(numel, generator=gen) for _ in range(3)]
    acc = WeightedAccumulator(numel)
    for local in locals_:
        acc.add(pseudo_grad(theta, local), 1.0)
    params = theta.clone()
    Nesterov(numel, lr=1.0, momentum=0.0).step(params, acc.mean())
    torch.testing.assert_close(params, torch.stack(locals_).mean(0), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Nesterov and DelayedNesterov


@pytest.mark.parametrize("foreach", [False, True])
def test_nesterov_equals_torch_sgd(foreach: bool) -> None:
    grads = _grads(6)
    ours, ref = _params(), _params().requires_grad_(True)
    opt = Nesterov(NUMEL, lr=0.7, momentum=0.9)
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True, dampening=0,
                              weight_decay=0, foreach=foreach)
    for g in grads:
        g_before = g.clone()
        opt.step(ours, g)
        assert torch.equal(g, g_before)  # grad is not modified
        ref.grad = g.clone()
        ref_opt.step()
        assert torch.equal(ours, ref.detach())
    assert torch.equal(opt.state_dict()["momentum_buffer"],
                       ref_opt.state[ref]["momentum_buffer"])


def _delayed_nesterov_reference(params: torch.Tensor, grads: list[torch.Tensor], lr: float,
                                beta: float, n: int, c: float) -> torch.Tensor:
    """docs/algorithms.md §2, transcribed literally (independent of fl_geo.core.outer)."""
    theta = params.clone()
    m = torch.zeros_like(theta)
    acc = torch.zeros_like(theta)
    for t, g in enumerate(grads):
        acc += g
        if (t + 1) % n == 0:
            m = beta * m + acc / n
            theta -= lr * ((1 - c * n + c) * beta * m + g / n)
            acc = torch.zeros_like(theta)
        else:
            theta -= lr * (c * beta * m + g / n)
    return theta


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("c", [0.0, 0.3])
def test_delayed_nesterov_matches_pseudo_code(n: int, c: float) -> None:
    numel = 50_000
    grads = _grads(9, numel)
    params = _params(numel)
    opt = DelayedNesterov(numel, lr=0.15 * n, momentum=0.5, buffer_size=n, activation=c)
    ours = params.clone()
    for g in grads:
        opt.step(ours, g)
    ref = _delayed_nesterov_reference(params, grads, 0.15 * n, 0.5, n, c)
    # Our kernel fuses k·m + g/N like torch's add(alpha=...); the literal transcription rounds
    # the product separately, so agreement is to fp32 rounding.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert opt.steps == 9
    assert ("accumulator" in opt.state_dict()) == (n > 1)


def test_delayed_nesterov_n1_c0_equals_torch_sgd() -> None:
    grads = _grads(5)
    ours, ref = _params(), _params().requires_grad_(True)
    opt = DelayedNesterov(NUMEL, lr=0.7, momentum=0.9, buffer_size=1, activation=0.0)
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        opt.step(ours, g)
        ref.grad = g.clone()
        ref_opt.step()
    assert torch.equal(ours, ref.detach())


# ---------------------------------------------------------------------------------------------
# Flower's FedAvgM, FedAdam, FedYogi


def _spec() -> ParamSpec:
    return ParamSpec(("w", "b"), ((40, 25), (25,)), ("float32", "float32"))


def _record(flat: torch.Tensor, spec: ParamSpec) -> ArrayRecord:
    return ArrayRecord({k: Array(v.numpy().copy()) for k, v in unflatten(flat, spec).items()})


def _flat(record: ArrayRecord, spec: ParamSpec) -> torch.Tensor:
    return flatten({k: torch.from_numpy(np.asarray(a.numpy(), dtype=np.float32))
                    for k, a in record.items()}, spec)


def _replies(locals_: list[torch.Tensor], tokens: list[int], spec: ParamSpec) -> list[Message]:
    """Replies as delivered to a ServerApp (metadata set explicitly: outside a running app the
    process has no TaskIdentity, which ``Message(..., reply_to=...)`` needs)."""
    out = []
    for node, (local, tok) in enumerate(zip(locals_, tokens, strict=True), start=2):
        meta = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=1,
                        reply_to_message_id=f"i{node}", group_id="1", created_at=0.0,
                        ttl=3600.0, message_type=MessageType.TRAIN)
        content = RecordDict({"arrays": _record(local, spec),
                              "metrics": MetricRecord({"num-examples": tok})})
        out.append(Message(content, metadata=meta))
    return out


def _configure(strategy: object, current: ArrayRecord) -> None:
    """What Flower's ``configure_train`` records about the current model.

    ``configure_train`` itself builds instruction Messages, which need a running app's
    TaskIdentity; the two Flower lines that matter for aggregation are mirrored here.
    """
    if isinstance(strategy, FlowerFedAvgM):
        if strategy.current_arrays is None:  # FedAvgM: first round only
            strategy.current_arrays = current
    else:  # FedOpt: every round
        strategy.current_arrays = {k: a.numpy() for k, a in current.items()}


FLOWER_CASES = [
    ("sgdm", {"lr": 0.8, "momentum": 0.9},
     lambda: FlowerFedAvgM(server_learning_rate=0.8, server_momentum=0.9)),
    ("fedadam", {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
     lambda: FlowerFedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ("fedyogi", {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
     lambda: FlowerFedYogi(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3)),
]


@pytest.mark.parametrize(("name", "kwargs", "make_flower"), FLOWER_CASES,
                         ids=[c[0] for c in FLOWER_CASES])
def test_matches_flower_strategy(name: str, kwargs: dict, make_flower) -> None:
    """Drive Flower's strategy and ours through 5 rounds of 3 token-weighted clients.

    Our Δ̄ comes from our own accumulator (Σ w·(θ − θ_i) / Σ w) and Flower's from its weighted
    average of the θ_i, so inputs differ by fp32 rounding; FedAdam additionally runs in float64
    inside Flower (its bias-corrected step is a NumPy float64 scalar). Hence allclose here; the
    next test removes the input difference and compares bit for bit.
    """
    spec = _spec()
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(spec.numel, generator=gen)
    flower_theta = theta.clone()
    ours = build_outer_optimizer(name, spec.numel, **kwargs)
    flower = make_flower()
    tokens = [1000, 3000, 6000]
    for server_round in range(1, 6):
        deltas = [0.01 * torch.randn(spec.numel, generator=gen) for _ in tokens]
        # ours
        acc = WeightedAccumulator(spec.numel)
        for delta, tok in zip(deltas, tokens, strict=True):
            acc.add(pseudo_grad(theta, theta - delta), float(tok))
        ours.step(theta, acc.mean())
        # Flower, from its own current model
        _configure(flower, _record(flower_theta, spec))
        new, _ = flower.aggregate_train(
            server_round, _replies([flower_theta - d for d in deltas], tokens, spec))
        flower_theta = _flat(new, spec)
        torch.testing.assert_close(theta, flower_theta, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "kwargs", "make_flower"), FLOWER_CASES,
                         ids=[c[0] for c in FLOWER_CASES])
def test_flower_same_input_bitwise(name: str, kwargs: dict, make_flower) -> None:
    """Given Flower's own averaged model, our step reproduces Flower's numbers.

    Δ̄ = current − Flower's aggregate (computed with the same ``aggregate_arrayrecords`` Flower
    uses) is exactly −Δ_flower, and our kernels follow Flower's rounding order, so FedAvgM agrees
    bit for bit. FedYogi agrees to an ulp: torch's vectorised CPU sqrt is not always correctly
    rounded (NumPy's is). FedAdam agrees to fp32 rounding: Flower evaluates its update in
    float64 (and returns a float64 model — a deviation we do not copy: state stays fp32).
    """
    spec = _spec()
    gen = torch.Generator().manual_seed(4)
    theta = torch.randn(spec.numel, generator=gen)
    ours = build_outer_optimizer(name, spec.numel, **kwargs)
    flower = make_flower()
    tokens = [1000, 3000, 6000]
    for server_round in range(1, 5):
        current = _record(theta, spec)
        _configure(flower, current)
        replies = _replies([theta - 0.01 * torch.randn(spec.numel, generator=gen)
                            for _ in tokens], tokens, spec)
        aggregate = _flat(aggregate_arrayrecords([m.content for m in replies], "num-examples"),
                          spec)
        new, _ = flower.aggregate_train(server_round, replies)
        ours.step(theta, theta - aggregate)
        expected = _flat(new, spec)
        if name == "sgdm":
            assert torch.equal(theta, expected), f"round {server_round}"
        else:
            torch.testing.assert_close(theta, expected, rtol=1e-6, atol=1e-7)
            theta = expected.clone()  # continue from Flower's (fp32-rounded) model
        if name == "sgdm":
            flower.current_arrays = _record(theta, spec)  # Flower keeps its own copy


def test_fedadam_bias_correction_modes() -> None:
    g = torch.full((4,), 0.5)
    steps = {}
    for mode in ("flower", "adam", "none"):
        params = torch.zeros(4)
        FedAdam(4, lr=0.1, bias_correction=mode).step(params, g)
        steps[mode] = -params[0].item()
    # first step: m = 0.1·g = 0.05, v = 0.01·g² → √v = 0.05, so m/(√v + τ) = 0.05/0.051
    ratio = 0.05 / 0.051
    assert steps["none"] == pytest.approx(0.1 * ratio, rel=1e-5)
    # Kingma & Ba (exponent 1): √(1 − 0.99)/(1 − 0.9) = 1
    assert steps["adam"] == pytest.approx(0.1 * ratio, rel=1e-5)
    # Flower (server_round 1 → exponent 2)
    assert steps["flower"] == pytest.approx(0.1 * (0.0199**0.5 / 0.19) * ratio, rel=1e-5)
    with pytest.raises(ValueError, match="bias_correction"):
        FedAdam(4, bias_correction="kingma")


# ---------------------------------------------------------------------------------------------
# State, factory, validation


@pytest.mark.parametrize("name", list(OUTER_OPTIMIZERS))
def test_state_dict_round_trip_mid_run(name: str) -> None:
    numel = 20_000
    kwargs = {"buffer_size": 2, "activation": 0.2} if name == "delayed_nesterov" else {}
    grads = _grads(7, numel, seed=5)
    a = build_outer_optimizer(name, numel, **kwargs)
    params_a = _params(numel)
    for g in grads[:3]:
        a.step(params_a, g)
    snapshot = {k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in a.state_dict().items()}
    b = build_outer_optimizer(name, numel)  # default hyperparameters: restored from the state
    b.load_state_dict(snapshot)
    params_b = params_a.clone()
    for g in grads[3:]:
        a.step(params_a, g)
        b.step(params_b, g)
    assert torch.equal(params_a, params_b)
    assert a.steps == b.steps == 7
    for key, value in a.state_dict().items():
        other = b.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_lazy_allocation_and_load_validation() -> None:
    opt = Nesterov(100)
    assert set(opt.state_dict()) == {"numel", "steps", "lr", "momentum"}
    avg = SGD(100)
    avg.step(torch.zeros(100), torch.ones(100))
    assert "momentum_buffer" not in avg.state_dict()
    opt.step(torch.zeros(100), torch.ones(100))
    state = opt.state_dict()
    with pytest.raises(ValueError, match="for 100 parameters, this optimizer has 50"):
        Nesterov(50).load_state_dict(state)
    with pytest.raises(ValueError, match="unexpected keys"):
        Nesterov(100).load_state_dict({**state, "exp_avg": torch.zeros(100)})
    with pytest.raises(ValueError, match="lacks keys"):
        Nesterov(100).load_state_dict({"numel": 100})
    with pytest.raises(ValueError, match="momentum_buffer"):
        Nesterov(100).load_state_dict({**state, "momentum_buffer": torch.zeros(99)})
    with pytest.raises(ValueError, match=r"fedyogi state lacks keys \['beta1', 'beta2', 'tau'\]"):
        FedYogi(100).load_state_dict(state)
    # a bad hyperparameter after a good one changes nothing (all are checked before any is set)
    dn = DelayedNesterov(100, lr=0.7, buffer_size=2)
    bad = {**dn.state_dict(), "lr": 0.1, "buffer_size": 0}
    with pytest.raises(ValueError):
        dn.load_state_dict(bad)
    assert dn.lr == 0.7 and dn.buffer_size == 2


def test_step_argument_checks() -> None:
    opt = FedAdam(10)
    with pytest.raises(ValueError, match="float32"):
        opt.step(torch.zeros(10, dtype=torch.float64), torch.zeros(10))
    with pytest.raises(ValueError, match="grad"):
        opt.step(torch.zeros(10), torch.zeros(11))
    p = torch.zeros(10)
    with pytest.raises(ValueError, match="alias"):
        opt.step(p, p)
    with pytest.raises(ValueError, match="momentum"):
        Nesterov(10, momentum=1.0)


def test_factory_errors_list_valid_choices() -> None:
    with pytest.raises(ValueError, match="valid names: nesterov, delayed_nesterov, avg, sgdm"):
        build_outer_optimizer("adamw", 10)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['momentum'\].*valid: lr"):
        build_outer_optimizer("avg", 10, momentum=0.9)
    assert build_outer_optimizer("sgdm", 10).momentum == 0.9
    assert build_outer_optimizer("avg", 10).name == "avg"
    assert isinstance(build_outer_optimizer("fedyogi", 10, lr=0.02), FedYogi)


def test_delayed_nesterov_without_momentum_keeps_no_buffers() -> None:
    opt = DelayedNesterov(64, lr=0.3, momentum=0.0, buffer_size=4)
    p = torch.zeros(64)
    ref = torch.zeros(64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        g = torch.randn(64, generator=gen)
        opt.step(p, g)
        ref.add_(g / 4, alpha=-0.3)
    assert torch.equal(p, ref)
    assert "momentum_buffer" not in opt.state_dict() and "accumulator" not in opt.state_dict()
