"""A method's defaults are the same however it is built, and its behaviour follows settings.

Why: a method's facts used to live in its public class, the registry, the config schema and the
YAML, and they disagreed (``FedBuff()`` weighted by staleness, a config naming fedbuff did not;
``CoCoDC()`` could not be built at all). Now the registry entry declares what makes a method what
it is (`fl_geo.registry.Method.defaults`), ``load_config`` merges it under every config naming the
method, and the loops read settings (``strategy.grace``, ``strategy.staleness_mixing``,
``strategy.pseudo_grad_base``, ``streaming.rule``), never the method's name.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError, FlGeoConfig, load_config
from fl_geo.core.state import ParamSpec
from fl_geo.registry import METHODS
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.inline import InlineGrid
from fl_geo.server_app import run_server
from fl_geo.strategies import AEDiT, CoCoDC, DiPS, StreamingDiLoCo, strategy_class
from fl_geo.strategies.base import penalty_from_config
from fl_geo.strategies.strategy import COLLABORATORS

STRATEGIES_DIR = Path(__file__).resolve().parents[1] / "strategies"

# A-EDiT's time budget (seconds of inner training per round) depends on the hardware: it has no
# default anywhere (the class requires it, a config naming a_edit must set it), so both ways of
# building it are given the same value.
REQUIRED = {"a_edit": {"time_budget_s": 30.0}}

# The sections a method's settings live in (``run`` holds the class's own run knobs: progress,
# TensorBoard, min_nodes; not the method's).
METHOD_SECTIONS = [f.name for f in fields(FlGeoConfig) if f.name != "run"]


def _from_yaml(tmp_path: Path, name: str) -> FlGeoConfig:
    """``load_config`` of a YAML file naming only the method (and what it requires)."""
    keys = ", ".join(f"{k}: {v}" for k, v in {"name": name, **REQUIRED.get(name, {})}.items())
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"strategy: {{{keys}}}\n", encoding="utf-8")
    return load_config(path)


@pytest.mark.parametrize("name", [n for n in METHODS if n not in REQUIRED])
def test_every_public_class_builds_with_no_arguments(name):
    strategy = strategy_class(name)()
    assert strategy.config.strategy.name == name


def test_a_edit_alone_needs_its_time_budget(tmp_path):
    """The one method without a full set of defaults, and it says so both ways."""
    assert inspect.signature(AEDiT).parameters["time_budget_s"].default is inspect.Parameter.empty
    with pytest.raises(TypeError, match="time_budget_s"):
        AEDiT()  # type: ignore[call-arg]
    (tmp_path / "a.yaml").write_text("strategy: {name: a_edit}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="time_budget_s"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("name", list(METHODS))
def test_public_class_and_config_resolve_to_the_same_settings(tmp_path, name):
    built = strategy_class(name)(**REQUIRED.get(name, {})).config
    loaded = _from_yaml(tmp_path, name)
    diffs = [f"{section}.{f.name}: class {getattr(getattr(built, section), f.name)!r}, "
             f"config {getattr(getattr(loaded, section), f.name)!r}"
             for section in METHOD_SECTIONS for f in fields(getattr(built, section))
             if getattr(getattr(built, section), f.name) != getattr(getattr(loaded, section), f.name)]
    assert not diffs, f"{name}: " + "; ".join(diffs)
    for section in METHOD_SECTIONS:  # the section objects themselves, as the loops receive them
        assert getattr(built, section) == getattr(loaded, section), f"{name}: {section}"


@pytest.mark.parametrize("name", list(METHODS))
def test_public_class_keyword_arguments_are_its_settings_fields(name):
    """The class takes exactly its settings dataclass's fields (same names, same defaults), plus
    the collaborators every class shares; the registry points at that class and dataclass."""
    cls = strategy_class(name)
    settings = METHODS[name].settings
    assert METHODS[name].strategy_class is cls and cls.Settings is settings and settings.method == name
    params = inspect.signature(cls).parameters
    own = {n: p for n, p in params.items() if n not in COLLABORATORS}
    assert list(own) == [f.name for f in fields(settings)]
    for f in fields(settings):
        expected = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert own[f.name].default == expected, f.name
        assert own[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert set(params) - set(own) == set(COLLABORATORS)
    # the constructor really accepts them all, and nothing else
    defaults = cls(**REQUIRED.get(name, {})).settings  # built once: each build loads a config
    cls(**{f.name: getattr(defaults, f.name) for f in fields(settings)})
    with pytest.raises(TypeError, match="no_such_setting"):
        cls(no_such_setting=1, **REQUIRED.get(name, {}))


@pytest.mark.parametrize("name", list(METHODS))
def test_config_and_class_give_equal_settings_dataclasses(tmp_path, name):
    """The settings a config naming only the method resolves to and those of the class built with
    defaults are equal, field by field (and a config holds the class's settings after a round trip)."""
    cls = strategy_class(name)
    built = cls(**REQUIRED.get(name, {})).settings
    loaded = cls.Settings.from_config(_from_yaml(tmp_path, name))
    diffs = [f"{f.name}: class {getattr(built, f.name)!r}, config {getattr(loaded, f.name)!r}"
             for f in fields(built) if getattr(built, f.name) != getattr(loaded, f.name)]
    assert not diffs, f"{name}: " + "; ".join(diffs)
    assert built == loaded
    assert cls.from_config(_from_yaml(tmp_path, name)).settings == built


def test_a_strategy_key_the_method_has_no_field_for_is_refused(tmp_path):
    """The ``strategy:`` section of a config is checked against the method's settings dataclass:
    a key the method would ignore is a one-line error naming the dataclass."""
    (tmp_path / "d.yaml").write_text("strategy: {name: diloco, grace_s: 5}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"strategy.grace_s is not a setting of strategy 'diloco' \(DiLoCoSettings\)"):
        load_config(tmp_path / "d.yaml")
    with pytest.raises(ConfigError, match="strategy.beta1 is not a setting of strategy 'fedbuff'"):
        load_config(None, ["strategy.name=fedbuff", "strategy.beta1=0.5"])
    assert load_config(None, ["strategy.name=fedadam", "strategy.beta1=0.5"]).strategy.beta1 == 0.5


def test_the_documented_defaults(tmp_path):
    """The values docs/algorithms.md ("Defaults") says each method takes, and why."""
    fedbuff = _from_yaml(tmp_path, "fedbuff").strategy
    assert (fedbuff.buffer_size, fedbuff.staleness_weighting) == (2, True)  # FedBuff: K = 2, s(τ) on
    cocodc = _from_yaml(tmp_path, "cocodc").streaming
    assert (cocodc.adaptive, cocodc.rule) == (True, "compensate")  # CoCoDC Algorithms 1 and 2
    alsgd = _from_yaml(tmp_path, "async_local_sgd").strategy
    assert (alsgd.outer_optimizer, alsgd.outer_lr, alsgd.outer_momentum, alsgd.delay_buffer) == (
        "delayed_nesterov", pytest.approx(0.05 * 32), 0.9, 32)  # the HALoS harness: 0.05 × N, N = 32
    fedasync = _from_yaml(tmp_path, "fedasync").strategy
    assert (fedasync.pseudo_grad_base, fedasync.staleness_mixing, fedasync.buffer_size) == ("current", True, 1)
    dips = _from_yaml(tmp_path, "dips")
    assert (dips.strategy.grace, dips.strategy.buffer_size, dips.strategy.weighting) == (True, 1_000_000, "tokens")
    p = dips.penalty
    assert (p.enabled, p.rule, p.keying, p.weighting, p.clip) == (True, "relative_max", "pooled", "tokens", 1.0)
    assert _from_yaml(tmp_path, "halos").strategy.delay_buffer == 2  # 0.15 × N with N = 2
    for name in ("fedavg", "diloco", "async_diloco", "streaming_diloco"):  # no grace, no mixing, blend
        cfg = _from_yaml(tmp_path, name)
        assert (cfg.strategy.grace, cfg.strategy.staleness_mixing, cfg.streaming.rule) == (False, False, "blend")


@pytest.mark.parametrize("cls", [StreamingDiLoCo, CoCoDC])
def test_streaming_defaults_are_a_valid_schedule(cls):
    """P divides H, and τ·P < H: the fixed schedule is valid with every default."""
    cfg = cls().config
    P, H, tau = cfg.streaming.fragments, cfg.strategy.inner_steps, cfg.streaming.overlap
    assert H % P == 0 and tau * P < H


def test_fragments_are_checked_against_the_model_start_is_handed():
    """A public class is not checked against the built-in model it does not run; P larger than the
    blocks of the model ``start()`` is handed is a one-line ConfigError there."""
    options = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 2, "model.max_seq_len": 32,
               "client.seq_len": 32, "client.batch_size": 4, "data.corpus": "pydoc", "run.backend": "inline"}
    strategy = StreamingDiLoCo(fragments=4, overlap=1, inner_steps=8, options=options)  # built: no model yet
    initial = ArrayRecord(make_model(strategy.config.model, 0).state_dict())  # 2 blocks
    with pytest.raises(ConfigError, match=r"streaming.fragments \(P=4\) does not fit the model") as exc:
        strategy.start(InlineGrid(client_app, 2, seed=0), initial, num_rounds=1)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"streaming.fragments \(P=4\) must be <= model.n_layers \(2\)"):
        load_config(None, None, {"strategy": {"name": "streaming_diloco"}, "streaming": {"fragments": 4}})


# ---- Di-PS's weighting --------------------------------------------------------------------------


def test_dips_weighting_is_the_penalty_weighting():
    """Di-PS weights the accepted updates inside its penalty (docs/algorithms.md §4, step 4):
    ``DiPS(weighting=...)`` sets that weighting, and without the penalty the plain one."""
    spec = ParamSpec.from_state_dict({"w": torch.zeros(3)})
    for weighting in ("uniform", "tokens"):
        cfg = DiPS(weighting=weighting).config
        assert (cfg.strategy.weighting, cfg.penalty.weighting) == (weighting, weighting)
        penalty = penalty_from_config(cfg, spec)
        assert penalty is not None and list(penalty.weighting) == [weighting]
    plain = DiPS(weighting="uniform", penalty=False).config
    assert plain.strategy.weighting == "uniform" and penalty_from_config(plain, spec) is None


def test_a_weighting_the_penalty_would_ignore_is_a_one_line_error():
    with pytest.raises(ConfigError, match="strategy.weighting=uniform disagrees with penalty.weighting=tokens") as exc:
        load_config(None, None, {"strategy": {"name": "dips", "weighting": "uniform"}})
    assert "\n" not in str(exc.value)
    agreed = load_config(None, None, {"strategy": {"name": "dips", "weighting": "uniform"},
                                      "penalty": {"weighting": "uniform"}})
    assert agreed.penalty.weighting == "uniform"
    with pytest.raises(ConfigError, match="strategy.staleness_weighting=true has no effect"):
        load_config(None, None, {"strategy": {"name": "fedbuff", "weighting": "tokens"}, "penalty": {"enabled": True}})
    # A synchronous method's warm-up rounds use strategy.weighting: EDiT keeps its own pair.
    assert load_config(None, None, {"strategy": {"name": "edit", "weighting": "tokens"}}).penalty.weighting == "norm_softmax"


# ---- behaviour follows settings, not names ------------------------------------------------------

VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16", "run.rounds=4"]
DIPS_SETTINGS = ["strategy.outer_lr=0.7", "strategy.outer_momentum=0.8", "strategy.buffer_size=1000000",
                 "strategy.grace=true", "strategy.weighting=tokens", "penalty.enabled=true",
                 "penalty.rule=relative_max", "penalty.keying=pooled", "penalty.weighting=tokens", "penalty.clip=1.0",
                 "penalty.clip_mode=absolute", "penalty.warmup=2"]
FEDASYNC_SETTINGS = ["strategy.buffer_size=1", "strategy.staleness_weighting=false", "strategy.staleness_mixing=true",
                     "strategy.pseudo_grad_base=current"]
FIXED_STREAM = ["model.n_layers=2", "strategy.inner_steps=4", "streaming.fragments=2", "streaming.overlap=1",
                "streaming.adaptive=false"]


def _final(tiny, tmp_path, run: str, *overrides: str) -> tuple[torch.Tensor, list[dict]]:
    from fl_geo.runtime.metrics import read_metrics

    cfg = tiny(*overrides)
    run_server(InlineGrid(client_app, cfg.run.num_clients, seed=0), cfg, tmp_path / run)
    return torch.load(tmp_path / run / "final_model.pt")["params"], read_metrics(tmp_path / run)


@pytest.mark.parametrize(
    ("method", "other", "settings"),
    [
        ("fedasync", "fedbuff", [*VIRTUAL, *FEDASYNC_SETTINGS]),
        ("dips", "async_diloco", [*VIRTUAL, *DIPS_SETTINGS]),
        ("cocodc", "streaming_diloco", [*FIXED_STREAM, "streaming.rule=compensate"]),
    ],
    ids=["fedasync", "dips", "cocodc"],
)
def test_another_name_with_the_same_settings_computes_the_same_bits(tiny, tmp_path, method, other, settings):
    """A method is its settings: another method's name given them computes the same model."""
    ours, ours_rows = _final(tiny, tmp_path, method, f"strategy.name={method}", *settings)
    theirs, theirs_rows = _final(tiny, tmp_path, other, f"strategy.name={other}", *settings)
    assert torch.equal(ours, theirs)
    assert [r.get("val/loss") for r in ours_rows] == [r.get("val/loss") for r in theirs_rows]


def test_the_settings_switch_the_behaviour(tiny, tmp_path):
    """Di-PS without its grace window steps without one (no outer/grace_s), FedBuff with one logs it;
    CoCoDC's rule set to blend is Streaming DiLoCo's merge, not its own."""
    _, no_grace = _final(tiny, tmp_path, "dips", "strategy.name=dips", *VIRTUAL, "strategy.grace=false", "penalty.warmup=2")
    assert all("outer/grace_s" not in r for r in no_grace)
    _, grace = _final(tiny, tmp_path, "fedbuff", "strategy.name=fedbuff", *VIRTUAL, "strategy.grace=true")
    assert any("outer/grace_s" in r for r in grace[1:])
    blend, _ = _final(tiny, tmp_path, "c", "strategy.name=cocodc", *FIXED_STREAM, "streaming.rule=blend")
    streaming, _ = _final(tiny, tmp_path, "s", "strategy.name=streaming_diloco", *FIXED_STREAM)
    compensate, _ = _final(tiny, tmp_path, "cc", "strategy.name=cocodc", *FIXED_STREAM)
    assert torch.equal(blend, streaming) and not torch.equal(compensate, streaming)


def test_no_method_name_comparison_switches_behaviour_in_the_loops():
    """Alongside the behavioural tests above: no ``<...>.name == "dips"``-style comparison (or
    ``in`` a tuple of names) is left in strategies/; the loops read settings."""
    names = "|".join(re.escape(n) for n in METHODS)
    compare = re.compile(rf"""\.name\s*(==|!=|(not\s+)?in\b)\s*[(\[{{]?\s*["']({names})["']"""
                         rf"""|["']({names})["']\s*(==|!=)\s*[\w.]*\.name\b""")
    hits = [f"{path.name}:{i}: {line.strip()}"
            for path in sorted(STRATEGIES_DIR.glob("*.py"))
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if compare.search(line)]
    assert not hits, hits
    assert compare.search('if s.name == "dips" and x') and compare.search("cfg.strategy.name in ('fedasync', 'x')")


# ---- the strategy is not the application --------------------------------------------------------


def test_inner_loop_settings_are_typed_and_not_held_to_the_builtin_model():
    """``inner=`` (a `ClientSection`) is what reaches fl-geo's ClientApps; a public strategy runs
    the caller's model, so its sequence length is not checked against the built-in decoder's
    positions, while ``fl-geo run`` (which builds that decoder) still checks it."""
    import json

    from fl_geo.clients.settings import ClientSection
    from fl_geo.strategies.base import client_config_record

    strategy = DiPS(inner=ClientSection(lr=1e-3, seq_len=512))
    assert (strategy.config.client.lr, strategy.config.client.seq_len) == (1e-3, 512)
    assert json.loads(client_config_record(strategy.config)["client"])["seq_len"] == 512
    with pytest.raises(ConfigError, match="inner= and client"):
        DiPS(inner=ClientSection(), options={"client.lr": 1e-3})
    with pytest.raises(ConfigError, match="is a setting of DiPS"):
        DiPS(options={"penalty.warmup": 3})
    with pytest.raises(ConfigError, match=r"client.seq_len \(512\) exceeds model.max_seq_len"):
        load_config(None, ["client.seq_len=512"])
