"""Hugging Face causal LMs (``model.kind: hf``, fl_geo/inner/hf.py), offline: the CPU-sized presets
train in simulation through ``fl-geo run`` and the public strategies, the per-module penalty groups
and Streaming DiLoCo's fragments follow each architecture's own layer list, a tied head is one
tensor on the wire, a local pretrained checkpoint scores what a plain ``transformers`` forward
pass gives, and bad settings are one-line errors."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import yaml

# Found, not imported: importing transformers costs each pytest worker ~0.5 s (its models ~2 s
# more) at collection; the tests that build a model import it when they run.
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install -e '.[hf]')", allow_module_level=True)

from flwr.app import ArrayRecord  # noqa: E402

from fl_geo.cli import main as cli_main  # noqa: E402
from fl_geo.clients import causal_lm  # noqa: E402
from fl_geo.clients.datacenter import app as client_app  # noqa: E402
from fl_geo.config import ConfigError, load_config  # noqa: E402
from fl_geo.core.groups import layer_container, module_groups  # noqa: E402
from fl_geo.core.penalty import Penalty  # noqa: E402
from fl_geo.core.shards import ShardPlan  # noqa: E402
from fl_geo.core.state import ParamSpec, flatten, load_flat_into  # noqa: E402
from fl_geo.core.streaming import Fragments, fragment_spec  # noqa: E402
from fl_geo.inner import hf  # noqa: E402
from fl_geo.results import evaluate_run, load_run_weights  # noqa: E402
from fl_geo.runtime.builders import make_model  # noqa: E402
from fl_geo.runtime.evaluation import GlobalEvaluator  # noqa: E402
from fl_geo.runtime.inline import InlineGrid  # noqa: E402
from fl_geo.runtime.metrics import read_metrics  # noqa: E402
from fl_geo.strategies import DiLoCo, DiPS  # noqa: E402
from tests.conftest import TINY  # noqa: E402

# Both tiny presets: 2 layers of width 64, byte vocabulary (256).
LAYERS = {"pythia-tiny": "gpt_neox.layers", "smollm-tiny": "model.layers"}
# What the model's own layer list gives as EDiT modules, in spec order.
MODULES = {
    "pythia-tiny": ["gpt_neox.embed_in", "gpt_neox.layers.0", "gpt_neox.layers.1", "gpt_neox.final_layer_norm",
                    "embed_out"],
    "smollm-tiny": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"],
}
HF = ["model.kind=hf", "client.lr=3e-3", "client.warmup_steps=2"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _cfg(preset: str, *overrides: str):
    return load_config(None, [*TINY, *HF, f"model.preset={preset}", *overrides])


def _built(preset: str, seed: int = 0):
    return make_model(_cfg(preset).model, seed)


# ---- presets, tied weights, layer lists ---------------------------------------------------------


@pytest.mark.parametrize("preset", list(LAYERS))
def test_preset_is_the_architecture_seeded_and_one_copy_per_tensor(preset):
    model = _built(preset)
    numbers = hf.PRESETS[preset]
    config = model.wrapped.config
    assert config.model_type == numbers["model_type"] and config.num_hidden_layers == 2
    assert config.hidden_size == 64 and config.vocab_size == 256  # the tokenizer's, not the preset's
    state = model.state_dict()
    spec = ParamSpec.from_state_dict(state)
    # every parameter once: the flat buffer is exactly the trainable scalars
    assert spec.numel == sum(p.numel() for p in model.parameters())
    same = make_model(_cfg(preset).model, 0)
    other = make_model(_cfg(preset).model, 1)
    assert torch.equal(flatten(state), flatten(same.state_dict(), spec))
    assert not torch.equal(flatten(state), flatten(other.state_dict(), spec))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert model(ids).shape == (2, 16, 256)


def test_a_tied_head_is_held_once_and_stays_tied_through_loads():
    model = _built("smollm-tiny")
    assert model.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    spec = ParamSpec.from_state_dict(model.state_dict())
    assert "lm_head.weight" not in spec.names and "model.embed_tokens.weight" in spec.names
    flat = torch.randn(spec.numel, generator=torch.Generator().manual_seed(1))
    load_flat_into(model, flat, spec)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(flatten(model.state_dict(), spec), flat)
    # a full Hugging Face state dict (with the alias) and a deduplicated one both load, tie kept
    fresh = _built("smollm-tiny", seed=5)
    fresh.load_state_dict(model.wrapped.state_dict())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    fresh = _built("smollm-tiny", seed=5)
    fresh.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    assert torch.equal(fresh(ids), model(ids))
    # Pythia's head is untied: both matrices travel
    pythia = ParamSpec.from_state_dict(_built("pythia-tiny").state_dict())
    assert {"embed_out.weight", "gpt_neox.embed_in.weight"} <= set(pythia.names)


@pytest.mark.parametrize("preset", list(LAYERS))
def test_modules_and_fragments_follow_the_models_own_layer_list(preset):
    model = _built(preset)
    spec = ParamSpec.from_state_dict(model.state_dict())
    # the module tree and the parameter names name the same layer list
    assert hf.decoder_layers(model) == model.layer_list == layer_container(spec.names, spec.numels) == LAYERS[preset]
    groups = module_groups(spec, "module")
    assert [name for name, _ in groups] == MODULES[preset]
    # each layer's group is exactly that layer's parameters
    for i, layer in enumerate(model.get_submodule(LAYERS[preset])):
        want = sum(p.numel() for p in layer.parameters())
        (ranges,) = [r for name, r in groups if name == f"{LAYERS[preset]}.{i}"]
        assert sum(e - b for b, e in ranges) == want
    # Streaming DiLoCo: two fragments, one layer each, embedding with the first, the rest last
    frags = Fragments(spec, 2)
    assert frags.num_blocks == 2
    first, last = frags.names(0), frags.names(1)
    def layer_names(names, i=None):
        prefix = f"{LAYERS[preset]}." if i is None else f"{LAYERS[preset]}.{i}."
        return {n for n in names if n.startswith(prefix)}

    # each fragment holds all of its own layer's parameters and none of the other layer's
    assert layer_names(first) == layer_names(spec.names, 0) != set()
    assert layer_names(last) == layer_names(spec.names, 1) != set()
    assert MODULES[preset][0] + ".weight" in first and MODULES[preset][-1] + ".weight" in last
    assert sum(fragment_spec(frags, p).numel for p in range(2)) == spec.numel
    # the same fragments from the client API's block list (container path of the module tree)
    from fl_geo.clients.api import blocks_of

    by_module = Fragments.from_blocks(spec, 2, blocks_of(model, model.layer_list))
    assert [by_module.ranges(p) for p in range(2)] == [frags.ranges(p) for p in range(2)]
    with pytest.raises(ValueError, match=f"2 layers of {LAYERS[preset]}"):
        Fragments(spec, 3)
    # the sharded parameter server's units are the same modules
    assert [u for s in ShardPlan.build(spec, 2).shards for u in s.units] == MODULES[preset]


@pytest.mark.parametrize("preset", list(LAYERS))
def test_edit_clips_each_layer_of_the_model_on_its_own(preset):
    """EDiT's per-module clip (φ = 10) on the model's modules: only the layer whose part of the
    averaged update is too long is scaled, to norm φ; the others are untouched."""
    spec = ParamSpec.from_state_dict(_built(preset).state_dict())
    penalty = Penalty(spec, granularity="module", clip=10.0)
    assert penalty.group_names == MODULES[preset]
    update = torch.full((spec.numel,), 1e-3)
    (big,) = [r for name, r in penalty.groups if name == f"{LAYERS[preset]}.1"]
    for b, e in big:
        update[b:e] = 1.0  # norm sqrt(n) >> 10
    before = update.clone()
    factors = penalty.clip_(update)
    for (name, ranges), factor in zip(penalty.groups, factors.tolist(), strict=True):
        part = torch.cat([update[b:e] for b, e in ranges])
        if name == f"{LAYERS[preset]}.1":
            assert factor < 1 and abs(float(part.norm()) - 10.0) < 1e-3
        else:
            assert factor == 1.0 and torch.equal(part, torch.cat([before[b:e] for b, e in ranges]))


def test_fragment_count_is_checked_against_the_real_layer_count():
    cfg = _cfg("pythia-tiny", "strategy.name=streaming_diloco", "streaming.fragments=2", "streaming.overlap=0",
               "strategy.inner_steps=4")
    assert cfg.streaming.fragments == 2
    with pytest.raises(ConfigError, match=r"fragments \(P=4\) must be <= the layers of the model \(preset pythia-tiny\) \(2\)"):
        _cfg("pythia-tiny", "strategy.name=streaming_diloco", "streaming.fragments=4", "strategy.inner_steps=8",
             "streaming.overlap=1")


# ---- training in simulation -------------------------------------------------------------------


def _val_losses(run_dir) -> list[float]:
    return [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]


DIPS = ["strategy.name=dips", "run.clock=virtual", "penalty.warmup=1"]


@pytest.mark.parametrize("preset,strategy", [("pythia-tiny", "diloco"), ("smollm-tiny", "dips")])
def test_fl_geo_run_trains_the_preset_on_bpe_tokens_and_its_loss_falls(tmp_path, preset, strategy, capsys):
    extra = DIPS if strategy == "dips" else []
    code = cli_main(["run", "configs/quickstart_hf_pythia.yaml", *TINY, f"model.preset={preset}", "run.rounds=2",
                     "strategy.inner_steps=4", "client.warmup_steps=2", "run.name=hf", *extra,
                     "data.tokenizer=bpe", "data.bpe_vocab_size=512", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["outer_steps"] >= 2
    losses = _val_losses(tmp_path / "hf")
    assert losses[-1] < losses[0] - 0.2, losses
    # on BPE tokens: the model's vocabulary is the tokenizer's (model.vocab_size resolved from it)
    config = yaml.safe_load((tmp_path / "hf" / "config.yaml").read_text())
    assert config["model"]["vocab_size"] == 512
    weights = load_run_weights(tmp_path / "hf")[0]
    assert weights[MODULES[preset][0] + ".weight"].shape == (512, 64)
    # the saved final model (a tied head saved once) loads back and scores the run's last val/loss
    assert "lm_head.weight" not in weights
    assert evaluate_run(tmp_path / "hf").loss == pytest.approx(summary["final_val_loss"], abs=1e-6)


@pytest.mark.parametrize("cls,preset", [(DiPS, "pythia-tiny"), (DiLoCo, "smollm-tiny")])
def test_public_strategies_train_the_preset(cls, preset):
    options = {o.split("=")[0]: o.split("=")[1] for o in [*TINY, *HF]
               if not o.startswith(("run.rounds", "strategy."))}  # strategy settings are keyword arguments
    kwargs = {"warmup": 1} if cls is DiPS else {}
    if cls is DiPS:
        options["run.clock"] = "virtual"
    strategy = cls(inner_steps=4, options={**options, "model.preset": preset}, **kwargs)
    evaluator = GlobalEvaluator(strategy.config, 3)
    initial = ArrayRecord(make_model(strategy.config.model, strategy.config.run.seed).state_dict())
    assert "lm_head.weight" not in initial
    before = evaluator.evaluate(flatten(initial.to_torch_state_dict()))
    result = strategy.start(InlineGrid(client_app, 3, seed=0), initial, num_rounds=2)
    assert list(result.arrays.keys()) == list(initial.keys())
    after = evaluator.evaluate(flatten(result.arrays.to_torch_state_dict()))
    assert after < before - 0.2, (before, after)


def test_a_users_own_hf_model_needs_causal_lm_for_its_tied_head():
    from fl_geo.clients import DatacenterClient, Site

    def raw(site):
        return hf.build_hf_model(_cfg("smollm-tiny").model, site.seed).wrapped

    site = Site(0, 1, seed=0, inner=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="causal_lm"):
        DatacenterClient(raw, lambda s: []).model(site)
    model, spec = DatacenterClient(causal_lm(raw), lambda s: []).model(site)
    assert spec == ParamSpec.from_state_dict(_built("smollm-tiny").state_dict())
    assert model.layer_list == "model.layers"


# ---- a local pretrained checkpoint ------------------------------------------------------------


def _checkpoint(tmp_path, vocab: int = 300):
    """A tiny random Llama with a tied head, saved as a Hugging Face directory (safetensors)."""
    from transformers import AutoModelForCausalLM

    config = hf.preset_config("smollm-tiny", vocab)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    assert any(path.glob("*.safetensors"))
    return path


def test_a_local_checkpoint_scores_what_transformers_gives(tmp_path):
    path = _checkpoint(tmp_path)
    cfg = load_config(None, [*TINY, "model.kind=hf", f"model.path={path}"])
    evaluator = GlobalEvaluator(cfg, 3)
    model = make_model(cfg.model, 123)  # the seed does not matter: the weights are the checkpoint's
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.cfg.vocab_size == 300
    ours = evaluator.evaluate(flatten(model.state_dict(), evaluator.spec))
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    with torch.no_grad():  # each window: inputs then the last target; labels = the window (shifted inside)
        losses = [plain(input_ids=torch.cat([x, y[:, -1:]], 1), labels=torch.cat([x, y[:, -1:]], 1)).loss
                  for x, y in evaluator.batches]
    reference = float(torch.stack(losses).double().mean())  # equal-sized batches: a plain mean
    assert abs(ours - reference) < 1e-5, (ours, reference)
    assert abs(ours - 5.7) < 0.5  # near ln(300) ≈ 5.70: a random model, not a constant


# ---- one-line errors --------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,needle", [
    (["model.kind=hf"], "model.kind=hf needs model.preset"),
    (["model.kind=hf", "model.preset=gpt5"], "model.preset 'gpt5' is unknown; valid: pythia-70m"),
    (["model.kind=hf", "model.path=/nonexistent/ckpt"], "model.path /nonexistent/ckpt: not a directory"),
    (["model.kind=hf", "model.preset=pythia-tiny", "model.path=/x"], "exclusive"),
    (["model.preset=pythia-tiny"], "for kind=hf"),
    (["model.kind=transformer"], "kind must be builtin or hf"),
    (["model.kind=hf", "model.preset=pythia-tiny", "client.seq_len=4096"], "exceeds the 2048 positions"),
])
def test_bad_model_settings_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(None, [*TINY, *overrides])
    assert "\n" not in str(err.value)


def test_checkpoint_problems_are_one_line_errors(tmp_path):
    path = _checkpoint(tmp_path, vocab=200)
    with pytest.raises(ConfigError, match=r"vocabulary \(200\) is smaller than the tokenizer's") as err:
        load_config(None, [*TINY, "model.kind=hf", f"model.path={path}"])
    assert "\n" not in str(err.value)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is unreadable"):
        load_config(None, [*TINY, "model.kind=hf", f"model.path={path}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(None, [*TINY, "model.kind=hf", f"model.path={tmp_path / 'empty'}"])


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    cfg = _cfg("pythia-tiny")
    monkeypatch.setattr(hf, "transformers_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'fl-geo\[hf\]'"):
        load_config(None, [*TINY, "model.kind=hf", "model.preset=pythia-tiny"])
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(ConfigError, match=r"fl-geo\[hf\]"):
        make_model(cfg.model, 0)
