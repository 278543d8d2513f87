import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fl_geo.config import (
    ConfigError,
    config_from_yaml_string,
    load_config,
    schedule_length,
    to_dict,
    to_yaml,
    warmup_length,
)
from fl_geo.server_app import config_from_run_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_are_diloco_with_the_measured_outer_step():
    """DiLoCo with Nesterov lr 0.7 / momentum 0.5, not the paper's 0.9 (docs/benchmarks.md: the
    registry default outer step at H = 50)."""
    cfg = load_config()
    assert cfg.strategy.name == "diloco"
    assert (cfg.strategy.outer_optimizer, cfg.strategy.outer_lr, cfg.strategy.outer_momentum) == ("nesterov", 0.7, 0.5)
    assert cfg.run.num_clients == 4


@pytest.mark.parametrize(
    "name,opt,lr,mom",
    [("fedavg", "avg", 1.0, 0.0), ("fedavgm", "sgdm", 0.7, 0.5), ("fedadam", "fedadam", 0.1, 0.0), ("fedyogi", "fedyogi", 0.01, 0.0)],
)
def test_strategy_presets_fill_unset_outer_settings(name, opt, lr, mom):
    s = load_config(None, [f"strategy.name={name}"]).strategy
    assert (s.outer_optimizer, s.outer_lr, s.outer_momentum) == (opt, lr, mom)


def test_explicit_values_win_over_presets():
    s = load_config(None, ["strategy.name=diloco", "strategy.outer_lr=1.0", "strategy.outer_momentum=0.0"]).strategy
    assert (s.outer_lr, s.outer_momentum) == (1.0, 0.0)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("strategy.outr_lr=1", "'outer_lr'"),
        ("strategy.outr_lr=1", "Valid keys here: name, outer_optimizer"),
        ("bogus.key=1", "Valid keys here: run, strategy"),
        ("strategy.outer_lr=abc", "could not be converted"),
        ("strategy.name=fedprox", "valid: diloco, fedavg"),
        ("wire.up=int3", "wire.up must be one of"),
        ("run.backend=spark", "run.backend"),
        ("client.seq_len=512", "exceeds model.max_seq_len"),
        ("noequals", "key=value"),
        ("data.noise_fraction=1.5", "data.noise_fraction"),
        ("data.noise_fraction=-0.1", "data.noise_fraction"),
        ("data.noise_kind=zeros", "data.noise_kind"),
        ("data.noise_block=0", "data.noise_block"),
        ("data.noise_partitions=[4]", "data.noise_partitions"),  # default run.num_clients = 4
        ("data.noise_partitions=[-1]", "data.noise_partitions"),
        ("data.noise_partitions=[1,1]", "data.noise_partitions has duplicates"),
    ],
)
def test_bad_config_is_a_clear_error(override, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        load_config(None, [override])
    assert needle in str(exc.value)


def test_strategy_and_optimizer_must_agree():
    with pytest.raises(ConfigError, match="fedavg' uses outer_optimizer avg"):
        load_config(None, ["strategy.name=fedavg", "strategy.outer_optimizer=nesterov"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.rounds >= 1


def test_yaml_round_trip_and_schedule():
    cfg = load_config(None, ["run.rounds=7", "strategy.inner_steps=11", "wire.up=bf16"])
    again = config_from_yaml_string(to_yaml(cfg))
    assert again == cfg
    assert schedule_length(cfg) == 77


def test_flower_run_config_path_and_overrides():
    cfg = config_from_run_config({"config": "configs/fedavg.yaml", "overrides": "run.rounds=3 run.name='my run'"})
    assert cfg.strategy.name == "fedavg" and cfg.run.rounds == 3 and cfg.run.name == "my run"
    with pytest.raises(ConfigError):
        config_from_run_config({"config": ""})


def test_async_schedule_counts_every_workers_steps():
    # token budget 3,276,800 = 1,600 worker steps of 16 x 128 tokens (4 workers x 400 in sync)
    cfg = load_config("configs/bench/eta_dips.yaml")
    sync = load_config("configs/bench/eta_diloco.yaml")
    assert schedule_length(cfg) == 1600 == 4 * schedule_length(sync)
    assert warmup_length(cfg) == 4 * warmup_length(sync) == 4 * cfg.client.warmup_steps
    # no budget: buffer 1 means one worker's H steps per outer step
    one = load_config(None, ["strategy.name=async_diloco", "run.rounds=40", "strategy.inner_steps=20"])
    assert schedule_length(one) == 40 * 20
    assert schedule_length(load_config(None, ["strategy.name=async_diloco", "client.total_steps=77"])) == 77
    # a site with 2 devices consumes twice the tokens per step: half the steps fit the budget
    two = load_config("configs/bench/eta_dips.yaml", ["client.devices=2"])
    assert schedule_length(two) == 800
    budget = ["run.max_tokens=1638400"]  # 200 steps per worker at one device: the budget binds
    assert schedule_length(load_config("configs/bench/eta_diloco.yaml", budget)) == 200
    assert schedule_length(load_config("configs/bench/eta_diloco.yaml", [*budget, "client.devices=2"])) == 100


def test_noise_keys_default_off_and_accept_valid_values():
    d = load_config().data
    assert (d.noise_partitions, d.noise_fraction, d.noise_kind, d.noise_block) == ([], 0.0, "random", 1)
    d = load_config(None, ["data.noise_partitions=[0,3]", "data.noise_fraction=0.25", "data.noise_kind=shuffle", "data.noise_block=25"]).data
    assert (d.noise_partitions, d.noise_fraction, d.noise_kind, d.noise_block) == ([0, 3], 0.25, "shuffle", 25)
    load_config(None, ["data.noise_fraction=0.5"])  # no partitions: a no-op, not an error
    load_config(None, ["data.noise_partitions=[1]"])  # fraction 0: also fine


def test_flat_run_config_keys_set_settings_without_nested_quoting():
    # what `flwr run . --run-config 'run.rounds=3 run.name="a b" run.resume=true'` hands the ServerApp
    flat = {"config": "configs/diloco.yaml", "overrides": "run.rounds=7 strategy.outer_lr=0.5", "run.rounds": 3,
            "run.name": "a b", "run.resume": True, "client.device": "cuda:1", "wire.up": "",
            "strategy.inner_steps": 10}
    cfg = config_from_run_config(flat)
    assert cfg.run.rounds == 3  # a flat key wins over `overrides`
    assert cfg.strategy.outer_lr == 0.5 and cfg.strategy.inner_steps == 10 and cfg.run.resume is True
    assert cfg.run.name == "a b"
    assert cfg.client.device == "cuda:1" and cfg.wire.up == "fp32"  # "" leaves the YAML's value


def test_every_flat_key_in_pyproject_is_a_config_key():
    import tomllib
    from dataclasses import fields, is_dataclass
    from pathlib import Path

    from flwr.common.config import flatten_dict

    from fl_geo.config import FlGeoConfig

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = flatten_dict(pyproject["tool"]["flwr"]["app"]["config"])
    flat = {k: v for k, v in declared.items() if k not in ("config", "overrides")}
    assert len(flat) >= 20 and all(v == "" for v in flat.values())
    root = FlGeoConfig()
    for key in flat:
        section, name = key.split(".")
        obj = getattr(root, section)
        assert is_dataclass(obj) and name in {f.name for f in fields(obj)}, key
    # all unset: exactly the YAML
    assert config_from_run_config({"config": "configs/diloco.yaml", "overrides": "", **flat}) == \
        config_from_run_config({"config": "configs/diloco.yaml"})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_to_yaml_gives_the_text_omegaconf_gives(path):
    """`to_yaml` dumps `to_dict` with PyYAML; OmegaConf's own dump of the structured config is
    the reference, text for text (what `fl-geo config` prints and every run's config.yaml)."""
    from fl_geo.config import to_yaml

    cfg = load_config(path, [])
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_to_dict_gives_what_omegaconf_gives(path):
    """`to_dict` walks the dataclasses itself (building the structured config cost ~30 ms a call);
    it must give exactly what OmegaConf's conversion gives, types included (JSON tells 1 from 1.0)."""
    cfg = load_config(path, [])
    for value in (cfg, cfg.client, cfg.data, cfg.model, cfg.strategy):
        mine, theirs = to_dict(value), OmegaConf.to_container(OmegaConf.structured(value), resolve=True)
        assert json.dumps(mine, sort_keys=True) == json.dumps(theirs, sort_keys=True)


def test_a_parsed_override_is_shared_and_no_load_changes_it():
    """Each ``key=value`` is parsed once per process (fl_geo.config_files._parse_override) and
    merged from by every later load; neither the merge nor a load that sets the key again (or a
    section under it) may change the parsed one."""
    from omegaconf import OmegaConf

    from fl_geo.config_files import _parse_override

    parsed = _parse_override("strategy.inner_steps=3")
    assert _parse_override("strategy.inner_steps=3") is parsed
    before = OmegaConf.to_container(parsed)
    assert load_config(None, ["strategy.inner_steps=3", "strategy.inner_steps=5"]).strategy.inner_steps == 5
    assert load_config(None, ["strategy.inner_steps=3", "strategy.name=edit"]).strategy.inner_steps == 3
    assert OmegaConf.to_container(parsed) == before == {"strategy": {"inner_steps": 3}}
    with pytest.raises(ConfigError, match="run.rounds"):  # a bad value is still its own one-line error
        load_config(None, ["run.rounds=three"])


def test_a_repeated_load_is_a_copy_of_the_first_and_a_changed_file_is_read_again(tmp_path):
    """load_config keeps finished configs by their inputs (fl_geo.config._cache_key): a second load
    of the same inputs is an equal config of its own, and the key is the file's bytes, not its name."""
    from fl_geo import config as config_module

    path = tmp_path / "c.yaml"
    path.write_text("strategy: {name: diloco, outer_lr: 0.5}\n", encoding="utf-8")
    first = load_config(path, ["run.rounds=3"])
    again = load_config(path, ["run.rounds=3"])
    assert again == first and again is not first and again.strategy is not first.strategy
    again.strategy.outer_lr = 9.0  # a caller changing its copy changes no later load
    assert load_config(path, ["run.rounds=3"]).strategy.outer_lr == 0.5
    path.write_text("strategy: {name: diloco, outer_lr: 0.25}\n", encoding="utf-8")
    assert load_config(path, ["run.rounds=3"]).strategy.outer_lr == 0.25
    # types are part of the key: True, 1 and 1.0 are different inputs (and 1 vs "1")
    keys = {config_module._cache_key(None, None, {"strategy": {"x": v}}, False) for v in (True, 1, 1.0, "1")}
    assert len(keys) == 4
    assert config_module._cache_key(None, None, {"strategy": {"x": object()}}, False) is None  # not plain data
    assert config_module._cache_key(tmp_path / "missing.yaml", None, None, False) is None
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
