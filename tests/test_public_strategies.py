"""The public Flower strategies: every method built from keyword arguments alone and driven through
Flower's ``start()`` contract on a grid, with fl-geo's ClientApp on the nodes."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Result, Strategy

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.state import flatten
from fl_geo.registry import METHODS
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.evaluation import GlobalEvaluator
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.protocol import is_profile_probe
from fl_geo.strategies import (
    DDP,
    AEDiT,
    AsyncDiLoCo,
    AsyncLocalSGD,
    CoCoDC,
    DiLoCo,
    DiPS,
    EDiT,
    FedAsync,
    FedBuff,
    FlGeoStrategy,
    HALoS,
    StreamingDiLoCo,
    baselines,
    build_strategy,
    strategy_class,
)
from fl_geo.strategies.strategy import spec_and_params
from tests.conftest import tiny_scenario_dict

# fl-geo's ClientApp trains the built-in decoder: keep it tiny (as tests/conftest.py's TINY).
TINY_OPTIONS = {
    "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 2, "model.max_seq_len": 32,
    "client.seq_len": 32, "client.batch_size": 4, "client.warmup_steps": 2, "client.eval_batches": 2,
    "data.corpus": "pydoc", "data.partition": "iid", "run.eval_batches": 2, "run.backend": "inline",
}


def _scenario(tmp_path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_scenario_dict()))
    return str(path)


def _cases(tmp_path) -> list[tuple[FlGeoStrategy, int]]:
    """Every public class, keyword arguments only (and the steps each should reach)."""
    common = {"inner_steps": 4, "options": TINY_OPTIONS}
    scenario = _scenario(tmp_path)
    return [
        (DiLoCo(**common), 2),
        (DiLoCo(outer_optimizer="delayed_nesterov", delay_buffer=2, **common), 2),
        (baselines.FedAvg(**common), 2),
        (baselines.FedAvgM(**common), 2),
        (baselines.FedAdam(**common), 2),
        (baselines.FedYogi(**common), 2),
        (EDiT(warmup=1, **common), 2),
        (AEDiT(time_budget_s=3.0, step_weight_ratio=0.5, scenario=scenario, **common), 2),
        (FedBuff(buffer_size=2, **common), 2),
        (FedAsync(**common), 2),
        (AsyncDiLoCo(**common), 2),
        (AsyncLocalSGD(delay_buffer=2, **common), 2),
        (DiPS(warmup=1, scenario=scenario, **common), 2),
        (DiPS(warmup=1, followers=2, scenario=scenario, **common), 2),
        (HALoS(accumulate=2, local_buffer=2, scenario=scenario, inner_steps=2, options=TINY_OPTIONS), 2),
        (StreamingDiLoCo(fragments=2, overlap=1, **common), 2),
        (CoCoDC(fragments=2, overlap=1, scenario=scenario, **common), 2),
        (DDP(scenario=scenario, options=TINY_OPTIONS), 4),  # one inner step per round: H = 1
    ]


def _initial(strategy: FlGeoStrategy) -> ArrayRecord:
    return ArrayRecord(make_model(strategy.config.model, strategy.config.run.seed).state_dict())


def _evaluate_fn(strategy: FlGeoStrategy):
    """A Flower-style centralised evaluation: (server_round, arrays) -> MetricRecord."""
    evaluator = GlobalEvaluator(strategy.config, 3)
    calls: list[int] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        calls.append(server_round)
        return MetricRecord({"loss": evaluator.evaluate(flatten(arrays.to_torch_state_dict()))})

    return evaluate, calls


def test_every_method_has_a_public_class():
    for name, entry in METHODS.items():
        cls = strategy_class(name)
        assert cls.__name__ == entry.class_name and cls.method == name
        assert issubclass(cls, Strategy) and cls.__doc__ and "Parameters" in cls.__doc__


def test_every_strategy_from_kwargs_learns_through_start(tmp_path):
    for strategy, steps in _cases(tmp_path):
        evaluate_fn, calls = _evaluate_fn(strategy)
        initial = _initial(strategy)
        grid = InlineGrid(client_app, 3, seed=0)
        result = strategy.start(grid, initial, num_rounds=steps, evaluate_fn=evaluate_fn)
        name = type(strategy).__name__
        assert isinstance(result, Result), name
        assert list(result.arrays.keys()) == list(initial.keys()), name
        final = flatten(result.arrays.to_torch_state_dict())
        assert torch.isfinite(final).all() and not torch.equal(final, flatten(initial.to_torch_state_dict())), name
        assert strategy.stats.outer_steps >= 1 and strategy.stats.tokens > 0, name
        assert calls[0] == 0 and len(calls) >= 2, name
        losses = result.evaluate_metrics_serverapp
        first, last = losses[0]["loss"], losses[max(losses)]["loss"]
        assert last < first, f"{name}: {first} -> {last}"
        assert result.train_metrics_clientapp, name


def test_cli_path_and_public_class_give_the_same_model(tiny, tmp_path):
    """``fl-geo run`` builds the public class from the config: a user building it from keyword
    arguments gets the same bits."""
    from fl_geo.server_app import run_server

    cfg = tiny("strategy.name=diloco", "strategy.outer_lr=0.5", "strategy.weighting=tokens")
    run_server(InlineGrid(client_app, 3, seed=0), cfg, tmp_path / "cli")
    cli = torch.load(tmp_path / "cli" / "final_model.pt")["params"]
    options = {"model.n_layers": 1, **{k: v for k, v in TINY_OPTIONS.items() if k != "model.n_layers"},
               "run.num_clients": 3}
    strategy = DiLoCo(outer_lr=0.5, weighting="tokens", inner_steps=3, options=options)
    result = strategy.start(InlineGrid(client_app, 3, seed=0), _initial(strategy), num_rounds=2, timeout=0)
    assert torch.equal(flatten(result.arrays.to_torch_state_dict()), cli)


def test_build_strategy_names_the_class(tiny):
    cfg = tiny("strategy.name=dips")
    assert type(build_strategy(cfg)) is DiPS
    with pytest.raises(ConfigError, match="runs strategy 'diloco'"):
        DiLoCo.from_config(cfg)


def test_bad_keyword_values_are_one_line_errors():
    with pytest.raises(ConfigError, match="weighting"):
        DiLoCo(weighting="by_vibes")
    with pytest.raises(ConfigError, match="outer_lr"):
        DiLoCo(outer_lr=-1.0)
    with pytest.raises(ConfigError, match="penalty.nope"):
        DiPS(options={"penalty.nope": 1})
    with pytest.raises(TypeError):
        DiLoCo(no_such_argument=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        AEDiT()  # type: ignore[call-arg]  # the time budget is required
    with pytest.raises(ConfigError, match="num_rounds"):
        DiLoCo().start(InlineGrid(client_app, 1), _initial(DiLoCo()), num_rounds=0)


def test_follower_processes_without_a_directory_are_a_one_line_error():
    """A public strategy's default logger keeps no run directory: follower processes (ps.transport
    grpc) need ps.workdir for their checkpoints, said before any process starts."""
    dips = DiPS(warmup=1, followers=2, transport="grpc", inner_steps=2, options=TINY_OPTIONS)
    with pytest.raises(ConfigError, match="set ps.workdir"):
        dips.start(InlineGrid(client_app, 2, seed=0), _initial(dips), num_rounds=1)


def test_initial_arrays_are_checked():
    with pytest.raises(ConfigError, match="non-empty"):
        spec_and_params(ArrayRecord())
    with pytest.raises(ConfigError, match="non-floating"):
        spec_and_params(ArrayRecord({"w": torch.zeros(2), "count": torch.zeros(1, dtype=torch.int64)}))
    with pytest.raises(ConfigError, match="NaN"):
        spec_and_params(ArrayRecord({"w": torch.tensor([1.0, float("nan")])}))


def test_flower_round_hooks_say_to_call_start():
    with pytest.raises(RuntimeError, match="start"):
        DiLoCo().configure_train(1, ArrayRecord(), None, None)  # type: ignore[arg-type]


def test_collaborators_are_passed_in(tmp_path):
    """A metrics logger (JSONL + TensorBoard), a checkpoint store, a resume point and a Scenario
    object are handed to the strategy, not looked up; resuming continues to the same bits."""
    from fl_geo.core.checkpoint import CheckpointStore
    from fl_geo.runtime.metrics import MetricsLogger, read_metrics
    from fl_geo.scenario_files import load_scenario

    scenario = load_scenario(_scenario(tmp_path))
    logger = MetricsLogger(tmp_path / "dips", tensorboard=True)
    dips = DiPS(inner_steps=3, options=TINY_OPTIONS, scenario=scenario, warmup=1, logger=logger)
    dips.start(InlineGrid(client_app, 3, seed=0), _initial(dips), num_rounds=3)
    logger.close()
    rows = read_metrics(tmp_path / "dips")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["time/virtual_s"] > 0  # no evaluator: no step 0
    assert list((tmp_path / "dips" / "tb").iterdir())
    assert dips.stats.virtual_s >= rows[-1]["time/virtual_s"] and dips.stats.scenario == scenario.name

    def diloco(**kwargs) -> DiLoCo:
        return DiLoCo(inner_steps=3, options=TINY_OPTIONS, scenario=scenario, checkpoint_every=1, **kwargs)

    full = diloco()
    full_result = full.start(InlineGrid(client_app, 3, seed=0), _initial(full), num_rounds=3)
    store = CheckpointStore(tmp_path / "ckpt", keep=5)
    grid = InlineGrid(client_app, 3, seed=0)  # the nodes outlive the server that is restarted
    trains = {"n": 0}

    def crash_in_round_3(node, msg, reply):  # the server dies on the first reply of round 3
        trains["n"] += msg.metadata.message_type == "train" and not is_profile_probe(msg)
        if trains["n"] == 7:
            raise KeyboardInterrupt("server killed")
        return reply

    grid.reply_hook = crash_in_round_3
    part = diloco(checkpoints=store)
    with pytest.raises(KeyboardInterrupt):
        part.start(grid, _initial(part), num_rounds=3)
    grid.reply_hook = None
    checkpoint = store.load_latest()
    assert checkpoint is not None and checkpoint.state["counters"]["version"] == 2
    resumed = diloco(resume_from=checkpoint)
    resumed_result = resumed.start(grid, _initial(resumed), num_rounds=3)
    assert resumed.stats.outer_steps == 3
    assert torch.equal(flatten(resumed_result.arrays.to_torch_state_dict()),
                       flatten(full_result.arrays.to_torch_state_dict()))


def test_every_strategy_learns_a_users_model_through_the_client_wrapper(tmp_path):
    """A user's own model (not fl-geo's decoder) in fl-geo's client wrapper, with every public
    strategy built from keyword arguments, the streaming ones cutting fragments from its blocks."""
    from flwr.app import MetricRecord as Metrics

    from tests import wrapped_user_app as user

    def evaluate(server_round: int, arrays: ArrayRecord) -> Metrics:
        model = user.TinyResidualLM()
        model.load_state_dict(arrays.to_torch_state_dict())
        return Metrics({"loss": user.heldout_loss(model)})

    inner = {"client.lr": 0.05, "client.seq_len": user.SEQ, "client.batch_size": 8, "client.warmup_steps": 1,
             "run.backend": "inline"}
    scenario = _scenario(tmp_path)
    common = {"inner_steps": 4, "options": inner}
    strategies = [
        DiLoCo(**common), baselines.FedAvg(**common), EDiT(warmup=1, **common),
        AEDiT(time_budget_s=3.0, scenario=scenario, **common), FedBuff(**common), FedAsync(**common),
        AsyncDiLoCo(outer_lr=0.3, **common), AsyncLocalSGD(**common), DiPS(warmup=1, scenario=scenario, **common),
        HALoS(accumulate=2, local_buffer=2, scenario=scenario, **common),
        StreamingDiLoCo(fragments=2, overlap=1, **common), CoCoDC(fragments=2, overlap=1, scenario=scenario, **common),
    ]
    for strategy in strategies:
        grid = InlineGrid(user.app, 3, seed=0)
        result = strategy.start(grid, ArrayRecord(user.initial_model().state_dict()), num_rounds=3,
                                evaluate_fn=evaluate)
        losses = result.evaluate_metrics_serverapp
        name = type(strategy).__name__
        assert losses[max(losses)]["loss"] < losses[0]["loss"] - 0.05, (name, losses)
        assert strategy.stats.rejected == 0 and strategy.stats.tokens > 0, name


def test_the_hardening_and_quorum_settings_are_keyword_arguments():
    """token_cap, robust, quorum and late_replies reach the run's config; a combination a method
    cannot run is a one-line ConfigError at construction, not at the first round."""
    from fl_geo.config import ConfigError
    from fl_geo.strategies import DiLoCo, DiPS, HALoS

    s = DiLoCo(quorum=0.75, late_replies="fold", token_cap="none").config.strategy
    assert (s.quorum, s.late_replies, s.robust, s.token_cap) == (0.75, "fold", "none", "none")
    assert DiLoCo(quorum=0.75, robust="median_norm").config.strategy.robust == "median_norm"
    assert DiPS(robust="median_norm").config.strategy.robust == "median_norm"
    with pytest.raises(ConfigError, match="strategy.quorum is for synchronous strategies"):
        DiPS(quorum=0.5)
    with pytest.raises(ConfigError, match="strategy.robust=median_norm is for the synchronous"):
        HALoS(robust="median_norm")
