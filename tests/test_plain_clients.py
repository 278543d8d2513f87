"""Public strategies with plain Flower ClientApps (no fl-geo code on the nodes): every method that
can take them learns; a malformed or dishonest Flower-convention reply is rejected with the model
intact; the two reply styles give the same DiLoCo model."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.runtime.inline import InlineGrid
from fl_geo.strategies import (
    AEDiT,
    AsyncDiLoCo,
    AsyncLocalSGD,
    CoCoDC,
    DiLoCo,
    DiPS,
    EDiT,
    FedAsync,
    FedBuff,
    HALoS,
    StreamingDiLoCo,
    baselines,
)
from fl_geo.strategies.replies import ReplyError, read_model_reply
from tests import plain_flower_app as plain


def _initial() -> ArrayRecord:
    return ArrayRecord(plain.initial_model().state_dict())


def _flat(arrays: ArrayRecord) -> torch.Tensor:
    return flatten(arrays.to_torch_state_dict())


def _plain_strategies():
    common = {"inner_steps": plain.STEPS}
    return [
        DiLoCo(**common), baselines.FedAvg(**common), baselines.FedAvgM(**common), baselines.FedAdam(**common),
        baselines.FedYogi(**common), EDiT(warmup=1, **common), AEDiT(time_budget_s=5.0, **common),
        FedBuff(**common), FedAsync(**common), AsyncDiLoCo(**common), AsyncLocalSGD(**common),
        DiPS(warmup=1, **common), HALoS(accumulate=2, local_buffer=2, group_size=1, **common),
    ]


@pytest.mark.parametrize("strategy", _plain_strategies(), ids=lambda s: type(s).__name__)
def test_plain_flower_clientapp_learns_with_every_strategy(strategy):
    grid = InlineGrid(plain.app, 3, seed=0)
    result = strategy.start(grid, _initial(), num_rounds=4, evaluate_fn=plain.evaluate_fn,
                            train_config=ConfigRecord({"lr": 0.5}))
    losses = result.evaluate_metrics_serverapp
    assert losses[max(losses)]["loss"] < losses[0]["loss"] - 0.05, losses
    assert strategy.stats.rejected == 0 and strategy.stats.outer_steps >= 4
    # token weights come from num-examples: every accepted reply declared STEPS * BATCH examples
    assert strategy.stats.tokens % (plain.STEPS * plain.BATCH) == 0 and strategy.stats.tokens > 0
    # a plain node was sent fp32 arrays whatever the wire said, and "config" holds the user's keys
    assert all(t == "train" for _, t in grid.executed if t != "query")


@pytest.mark.parametrize("cls", [StreamingDiLoCo, CoCoDC], ids=lambda c: c.__name__)
def test_streaming_methods_refuse_plain_clientapps_with_a_reason(cls):
    with pytest.raises(ConfigError, match="needs fl-geo's ClientApp"):
        cls(inner_steps=4, fragments=2, overlap=1, options={"model.n_layers": 2}).start(
            InlineGrid(plain.app, 2), _initial(), num_rounds=1)


def test_clients_flower_sends_no_profile_query_and_clients_fl_geo_requires_answers():
    grid = InlineGrid(plain.app, 2, seed=0)
    DiLoCo(inner_steps=plain.STEPS, clients="flower").start(grid, _initial(), num_rounds=1)
    assert [t for _, t in grid.executed] == ["train", "train"]
    with pytest.raises(RuntimeError, match="profile query"):
        DiLoCo(clients="fl-geo", wait_nodes_timeout_s=5).start(InlineGrid(plain.app, 2), _initial(), num_rounds=1)
    with pytest.raises(ConfigError, match="clients must be one of"):
        DiLoCo(clients="torch")


def test_sharded_dips_refuses_plain_clientapps():
    with pytest.raises(ConfigError, match="needs fl-geo's ClientApp"):
        DiPS(followers=2).start(InlineGrid(plain.app, 2), _initial(), num_rounds=1)


# ---- dishonest or malformed Flower-convention replies ------------------------------------------------

def _tamper(kind: str):
    def metrics_of(reply: Message) -> MetricRecord:
        return reply.content.metric_records["metrics"]

    def hook(node: int, msg: Message, reply: Message) -> Message:
        if reply.has_error() or msg.metadata.message_type != "train" or node != min(grid_nodes):
            return reply
        arrays = reply.content.array_records["arrays"]
        m = metrics_of(reply)
        if kind == "no-examples":
            m = MetricRecord({"train_loss": 1.0})
        elif kind == "negative":
            m = MetricRecord({"num-examples": -5})
        elif kind == "fractional":
            m = MetricRecord({"num-examples": 2.5})
        elif kind == "nan-count":
            m = MetricRecord({"num-examples": float("nan")})
        elif kind == "nan-tokens":
            m = MetricRecord({"num-examples": 10, "num-tokens": float("inf")})
        elif kind == "nan-model":
            state = arrays.to_torch_state_dict()
            state["head.bias"][0] = float("nan")
            arrays = ArrayRecord(state)
        elif kind == "wrong-shape":
            state = arrays.to_torch_state_dict()
            state["head.bias"] = torch.zeros(3)
            arrays = ArrayRecord(state)
        elif kind == "wrong-key":
            state = arrays.to_torch_state_dict()
            state["intruder"] = state.pop("head.bias")
            arrays = ArrayRecord(state)
        elif kind == "int-model":
            arrays = ArrayRecord({k: Array(v.numpy().astype("int64")) for k, v in arrays.to_torch_state_dict().items()})
        return Message(RecordDict({"arrays": arrays, "metrics": m}), reply_to=msg)

    grid_nodes: list[int] = []
    return hook, grid_nodes


@pytest.mark.parametrize("kind", ["no-examples", "negative", "fractional", "nan-count", "nan-tokens", "nan-model",
                                  "wrong-shape", "wrong-key", "int-model"])
@pytest.mark.parametrize("cls", [DiLoCo, FedBuff], ids=lambda c: c.__name__)
def test_bad_plain_replies_are_rejected_and_the_rest_trains(cls, kind, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    grid = InlineGrid(plain.app, 3, seed=0)
    hook, nodes = _tamper(kind)
    nodes.extend(grid.get_node_ids())
    grid.reply_hook = hook
    strategy = cls(inner_steps=plain.STEPS)
    result = strategy.start(grid, _initial(), num_rounds=3, evaluate_fn=plain.evaluate_fn)
    assert strategy.stats.rejected >= 1, kind
    assert "rejected update from node" in caplog.text
    final = _flat(result.arrays)
    assert torch.isfinite(final).all()
    losses = result.evaluate_metrics_serverapp
    assert losses[max(losses)]["loss"] < losses[0]["loss"]


def test_model_reply_reader_against_the_formula():
    model = plain.initial_model()
    spec = ParamSpec.from_state_dict(model.state_dict())
    base = flatten(model.state_dict())
    trained = {k: v + 0.25 for k, v in model.state_dict().items()}
    reply = Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 7.0})}),
                    reply_to=Message(RecordDict(), dst_node_id=1, message_type="train"))
    r = read_model_reply(reply, spec, base)
    assert torch.equal(r.pieces[0][1], base - flatten(trained)) and r.tokens == 7 and math.isnan(r.loss)
    reply = Message(RecordDict({"arrays": ArrayRecord(trained),
                                "metrics": MetricRecord({"num-examples": 7, "num-tokens": 70, "loss": 2.0})}),
                    reply_to=Message(RecordDict(), dst_node_id=1, message_type="train"))
    r = read_model_reply(reply, spec, base)
    assert r.tokens == 70 and r.loss == 2.0
    bad = Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": [3, 4]})}),
                  reply_to=Message(RecordDict(), dst_node_id=1, message_type="train"))
    with pytest.raises(ReplyError, match="num-examples"):
        read_model_reply(bad, spec, base)


# ---- a plain site's num-examples is judged against the claims accepted so far (issue 26) -------------

def _claiming(first_node: list[int], change):
    """Reply hook: the train replies of the lowest node id pass through ``change(reply, msg)``;
    ``hook.changed`` counts them."""
    def hook(node: int, msg: Message, reply: Message) -> Message:
        if reply.has_error() or msg.metadata.message_type != "train" or node != min(first_node):
            return reply
        hook.changed += 1
        return change(reply, msg)

    hook.changed = 0
    return hook


def _claim(count: int):
    def change(reply: Message, msg: Message) -> Message:
        return Message(RecordDict({"arrays": reply.content.array_records["arrays"],
                                   "metrics": MetricRecord({"num-examples": count})}), reply_to=msg)
    return change


def _nan_model(reply: Message, msg: Message) -> Message:
    state = reply.content.array_records["arrays"].to_torch_state_dict()
    state["head.bias"][0] = float("nan")
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": reply.content.metric_records["metrics"]}),
                   reply_to=msg)


def _start(cls, hook, rounds=3, **kwargs):
    grid = InlineGrid(plain.app, 4, seed=0)
    nodes = list(grid.get_node_ids())
    hook = hook(nodes)
    grid.reply_hook = hook
    strategy = cls(inner_steps=plain.STEPS, weighting="tokens", **kwargs)
    result = strategy.start(grid, _initial(), num_rounds=rounds, evaluate_fn=plain.evaluate_fn)
    return strategy, _flat(result.arrays), hook


def test_a_plain_site_claiming_2_to_the_40_examples_is_refused_every_round(caplog):
    """One of four plain ClientApps replies ``num-examples = 2**40`` (the issue: the model became
    the liar's). Round 1 has no accepted claim yet: the claim is judged against the round's
    four claims (more than 4 x their median); later rounds against the accepted ones. It is
    refused every round, and the model is bit-identical to the run in which the same replies
    were refused for a NaN."""
    caplog.set_level("WARNING", logger="fl_geo")
    strategy, final, hook = _start(DiLoCo, lambda nodes: _claiming(nodes, _claim(2**40)))
    assert hook.changed == 3 and strategy.stats.rejected == 3 and strategy.stats.outer_steps == 3
    assert "num-examples=1099511627776 is more than 4 x the median 160 of the 4 claims this round" in caplog.text
    assert "of the accepted claims so far" in caplog.text
    assert strategy.stats.tokens == 3 * 3 * plain.STEPS * plain.BATCH  # the liar's claim counts nowhere
    nan_strategy, without, _ = _start(DiLoCo, lambda nodes: _claiming(nodes, _nan_model))
    assert nan_strategy.stats.rejected == 3
    assert torch.equal(final, without)


def test_a_plain_claim_within_the_bound_is_folded_and_token_cap_none_trusts_any():
    """A site claiming 4 x the others' examples is within the bound (so its update is folded, the
    claim counts in full); with ``token_cap="none"`` even 2**40 is believed."""
    within, _, _ = _start(DiLoCo, lambda nodes: _claiming(nodes, _claim(4 * plain.STEPS * plain.BATCH)))
    assert within.stats.rejected == 0
    assert within.stats.tokens == 3 * (3 + 4) * plain.STEPS * plain.BATCH  # three honest sites and the 4x claim, 3 rounds
    trusted, _, _ = _start(DiLoCo, lambda nodes: _claiming(nodes, _claim(2**40)), token_cap="none")
    assert trusted.stats.rejected == 0 and trusted.stats.tokens > 2**40


def test_an_asynchronous_run_refuses_a_huge_plain_claim_from_its_first_step(caplog):
    """FedBuff (K = 2): before any claim was accepted, the step's plain replies are held, and the
    step waits for three of them (`AsyncOuterLoop.awaiting_peers`: two claims cannot outvote one)
    before it closes and judges them together: the liar's first claim is refused against the
    step's claims, every later one against the accepted claims. No accepted reply counts more than
    its honest 160 examples (before, the first lie counted as 160, and before that it was believed)."""
    caplog.set_level("WARNING", logger="fl_geo")
    strategy, final, hook = _start(FedBuff, lambda nodes: _claiming(nodes, _claim(2**40)), rounds=6)
    assert hook.changed >= 6 and strategy.stats.rejected >= hook.changed - 1  # the last may be in flight at the end
    assert "num-examples=1099511627776 is more than 4 x the median 160 of the 3 claims this round" in caplog.text
    assert "is more than 4 x the median 160 of the accepted claims so far" in caplog.text
    assert "counted as" not in caplog.text
    assert strategy.stats.tokens == strategy.stats.accepted * plain.STEPS * plain.BATCH
    assert torch.isfinite(final).all()


@pytest.mark.parametrize("cls", [FedAsync, AsyncLocalSGD])
def test_a_one_update_step_waits_for_three_first_claims_so_a_lone_lie_is_not_believed(cls, caplog):
    """FedAsync and Async-Local-SGD close a step per reply: their first step now waits for three
    plain replies before it closes, so the liar's very first claim is judged (and refused) too,
    and no accepted reply ever counts more than its honest examples."""
    caplog.set_level("WARNING", logger="fl_geo")
    strategy, final, hook = _start(cls, lambda nodes: _claiming(nodes, _claim(2**40)), rounds=6)
    assert hook.changed >= 2 and strategy.stats.rejected >= hook.changed - 1
    assert "of the 3 claims this round" in caplog.text
    assert strategy.stats.tokens == strategy.stats.accepted * plain.STEPS * plain.BATCH
    assert torch.isfinite(final).all()


def test_halos_holds_its_first_plain_claims_until_three_can_be_judged(caplog):
    """HALoS applies each reply as it arrives: before any plain claim was accepted it now holds
    them (their workers get no new job meanwhile) until three can be judged together, so the
    liar's first claim is refused too and no accepted reply counts more than its honest examples."""
    caplog.set_level("WARNING", logger="fl_geo")
    strategy, final, hook = _start(HALoS, lambda nodes: _claiming(nodes, _claim(2**40)), rounds=4,
                                   accumulate=2, local_buffer=2, group_size=2)
    assert hook.changed >= 2 and strategy.stats.rejected >= hook.changed - 1
    assert "of the 3 claims this round" in caplog.text
    assert strategy.stats.tokens == strategy.stats.accepted * plain.STEPS * plain.BATCH
    assert torch.isfinite(final).all()


def test_halos_judges_its_held_first_claims_when_nobody_else_can_reply():
    """HALoS holds a first plain claim while other workers train; when every other worker fails
    (errors until benched), the held claim must be judged (alone: believed) and the run go on,
    not wait for peers that will never reply nor stop with its only live worker held."""
    def others_fail(node: int, msg: Message, reply: Message) -> Message:
        if msg.metadata.message_type == "train" and node != min(nodes):
            return Message(Error(code=0, reason="this site is down"), reply_to=msg)
        return reply

    grid = InlineGrid(plain.app, 4, seed=0)
    nodes = list(grid.get_node_ids())
    grid.reply_hook = others_fail
    strategy = HALoS(inner_steps=plain.STEPS, weighting="tokens", accumulate=2, local_buffer=2, group_size=2)
    result = strategy.start(grid, _initial(), num_rounds=2, evaluate_fn=plain.evaluate_fn)
    assert strategy.stats.outer_steps == 2 and strategy.stats.stop_reason is None
    # the lone live worker's honest claims were believed and applied: every accepted reply is its
    assert strategy.stats.accepted >= 4 and strategy.stats.rejected == 0
    assert strategy.stats.tokens == strategy.stats.accepted * plain.STEPS * plain.BATCH
    assert torch.isfinite(_flat(result.arrays)).all()


def test_an_asynchronous_first_step_of_three_or_more_claims_refuses_the_lie():
    """FedBuff with K = 4: the first step holds four plain replies, so the liar's first claim is
    judged against the step's lower median of claims and refused, like a synchronous first round."""
    strategy, _, hook = _start(FedBuff, lambda nodes: _claiming(nodes, _claim(2**40)), rounds=6, buffer_size=4)
    assert hook.changed >= 6 and strategy.stats.rejected >= hook.changed - 1  # the last may be in flight at the end
    assert strategy.stats.tokens == strategy.stats.accepted * plain.STEPS * plain.BATCH


def test_a_resumed_asynchronous_run_judges_its_first_claims_against_the_checkpointed_ones(tmp_path, caplog):
    """The accepted claims are part of the checkpoint: after a resume, the liar's very first
    claim is refused against them (without them, the first step judges its claims only among
    themselves: the tests above)."""
    from fl_geo.core.checkpoint import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    first, _, _ = _start(FedBuff, lambda nodes: _claiming(nodes, lambda reply, msg: reply), rounds=2,
                         checkpoints=store, checkpoint_every=1)
    assert first.stats.rejected == 0
    ckpt = store.load_latest()
    assert ckpt is not None and ckpt.state["claims"]["history"]  # what the bound had accepted
    caplog.set_level("WARNING", logger="fl_geo")
    resumed, final, hook = _start(FedBuff, lambda nodes: _claiming(nodes, _claim(2**40)), rounds=4, resume_from=ckpt)
    # every lie judged was refused, the first included: no accepted reply claimed 2**40 (the last
    # lie may still be in flight when the run ends; in-flight replies are drained unjudged)
    assert hook.changed >= 2 and resumed.stats.rejected >= 1
    assert resumed.stats.tokens == resumed.stats.accepted * plain.STEPS * plain.BATCH
    assert "of the accepted claims so far" in caplog.text and torch.isfinite(final).all()


def test_the_claim_bound_against_its_formula():
    from fl_geo.core.claims import ClaimBound

    bound = ClaimBound(factor=4.0)
    assert bound.judge(2**40) is None and bound.judge(2**40, [2**40, 160]) is None  # nothing to compare yet
    assert "4 claims this round" in bound.judge(2**40, [160, 170, 2**40, 150])
    assert bound.judge(640, [160, 160, 640]) is None  # 4 x the round's median is within
    bound.accepted("liar", 2**40)
    bound.accepted("liar", 2**40)
    assert bound.judge(2**40) is None  # only the liar has a history
    bound.accepted("a", 160)
    assert bound.reference() == 160  # one vote per site, the lower median
    assert "accepted claims so far" in bound.judge(2**40) and bound.judge(640) is None
    assert bound.judge(641) is not None
    restored = ClaimBound(factor=4.0)
    restored.load_state_dict(bound.state_dict())  # a checkpoint keeps each site with its key's type
    assert restored.reference() == 160 and restored.judge(641) is not None and restored.judge(640) is None
    for bad in ({"factor": 2.0, "history": []}, {"factor": 4.0, "history": [["a", [-1]]]},
                {"factor": 4.0, "history": [[1.5, [3]]]}, {"factor": 4.0, "history": [["a", [True]]]}):
        with pytest.raises(ValueError):
            restored.load_state_dict(bad)
    assert restored.reference() == 160  # a refused state changes nothing


# ---- the two reply styles give the same DiLoCo model ------------------------------------------------

def test_diloco_gives_the_same_model_with_both_reply_styles():
    """fl-geo's ClientApp replies Δ; an adapter around the very same training replies the trained
    model θ = θ_sent − Δ and ``num-tokens`` the Flower way (and answers no profile query, so the
    server treats it as a plain Flower ClientApp). The final models agree to fp32 rounding."""
    from fl_geo.clients.datacenter import app as fl_geo_app
    from fl_geo.core.state import ParamSpec as Spec
    from fl_geo.runtime.builders import make_model
    from tests.test_public_strategies import TINY_OPTIONS

    options = {**TINY_OPTIONS, "model.n_layers": 1}
    adapter = ClientApp()

    @adapter.train()
    def train(msg: Message, context):  # noqa: ANN001
        reply = fl_geo_app(msg, context)
        base = msg.content.array_records["arrays"].to_torch_state_dict()
        delta = reply.content.array_records["arrays"].to_torch_state_dict()
        model = {k: base[k] - delta[k] for k in base}
        tokens = int(reply.content.metric_records["metrics"]["tokens"])
        metrics = MetricRecord({"num-examples": 1, "num-tokens": tokens})
        return Message(RecordDict({"arrays": ArrayRecord(model), "metrics": metrics}), reply_to=msg)

    finals = []
    for app in (fl_geo_app, adapter):
        strategy = DiLoCo(inner_steps=3, weighting="tokens", options=options)
        initial = ArrayRecord(make_model(strategy.config.model, 0).state_dict())
        result = strategy.start(InlineGrid(app, 3, seed=0), initial, num_rounds=2)
        finals.append(_flat(result.arrays))
        assert strategy.stats.rejected == 0
    assert Spec.from_state_dict(initial.to_torch_state_dict()).numel == finals[0].numel()
    torch.testing.assert_close(finals[0], finals[1], rtol=0, atol=1e-5)
    assert not torch.equal(finals[0], _flat(initial))


# ---- Flower's Ray simulation: a hand-written ServerApp, the plain ClientApp ---------------------------

@pytest.mark.slow(seconds=33)
@pytest.mark.xdist_group("ray")  # starts Ray: one at a time with the other Ray tests under `make test`
def test_public_strategies_under_flowers_ray_simulation(capfd, caplog):
    """A user's own ServerApp (no fl-geo config, no fl-geo ClientApp) runs every strategy that takes
    a plain Flower ClientApp, one after another, on Flower's Ray simulation runtime; under the
    default ``clients="auto"`` Flower logs no error (no node is sent a message type it lacks)."""
    import warnings

    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    results: dict[str, tuple[float, float, int]] = {}
    server = ServerApp()
    strategies = _plain_strategies()  # every method that takes a plain Flower ClientApp

    @server.main()
    def main(grid: Grid, context) -> None:  # noqa: ANN001
        for strategy in strategies:
            result = strategy.start(grid, _initial(), num_rounds=4, evaluate_fn=plain.evaluate_fn)
            losses = result.evaluate_metrics_serverapp
            results[type(strategy).__name__] = (losses[0]["loss"], losses[max(losses)]["loss"], strategy.stats.rejected)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # one Ray actor serves the three SuperNodes: each actor costs ~11 CPU-s to start, and the
        # claim is the strategies on Flower's runtime, not actors in parallel (test_simulation.py)
        run_simulation(server_app=server, client_app=plain.app, num_supernodes=3,
                       backend_config={"init_args": {"num_cpus": 1, "include_dashboard": False},
                                       "client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    logged = caplog.text + "".join(capfd.readouterr())  # Flower's records reach caplog; Ray's actors print
    assert "No query function registered" not in logged and "ClientAppException" not in logged
    assert set(results) == {type(s).__name__ for s in strategies}, results
    for name, (first, last, rejected) in results.items():
        assert last < first and rejected == 0, (name, first, last)
