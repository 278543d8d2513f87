"""EDiT and A-EDiT on the synchronous loop: per-module weights, clipping and rollback against
hand-computed values through the whole server path (InlineGrid, real messages), the warm-up,
the ablation switches, time budgets and the step-weight mix."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.groups import module_groups
from fl_geo.core.penalty import Penalty
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.core.step_weights import StepWeightMix
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.runtime.wire import encode
from fl_geo.server_app import run_server
from tests.conftest import keep_declaration


def _initial(cfg) -> tuple[torch.Tensor, ParamSpec]:
    from fl_geo.runtime.builders import make_model

    sd = make_model(cfg.model, cfg.run.seed).state_dict()
    return flatten(sd), ParamSpec.from_state_dict(sd)


def _run(cfg, tmp_path, hook=None, name="run"):
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"], grid


def _crafted(spec: ParamSpec, make_delta):
    """A reply hook that replaces each train reply's update by ``make_delta(partition_id)``."""

    def hook(node, msg, reply):
        if reply.has_error() or msg.metadata.message_type != "train":
            return reply
        metrics = reply.content.metric_records["metrics"]
        delta = make_delta(int(metrics["partition_id"]))
        return Message(keep_declaration(reply, {"arrays": encode(delta, spec, "fp32"), "metrics": metrics}), reply_to=msg)

    return hook


EDIT_ONE_STEP = ("strategy.name=edit", "run.rounds=1", "strategy.outer_lr=1.0", "strategy.outer_momentum=0.0")


def test_edit_defaults_are_edits_penalty(tiny):
    cfg = tiny("strategy.name=edit")
    p = cfg.penalty
    assert (p.enabled, p.granularity, p.rule, p.weighting, p.clip, p.keying) == (True, "module", "zscore", "norm_softmax", 10.0, "node")
    assert (cfg.strategy.outer_lr, cfg.strategy.outer_momentum) == (0.8, 0.85)
    assert tiny("strategy.name=edit", "penalty.clip=0").penalty.clip == 0  # the user's value wins
    assert not tiny().penalty.enabled  # DiLoCo keeps no penalty


def test_per_module_softmax_weights_and_clip_match_hand_values(tiny, tmp_path):
    """Δ_i = c_i·1 everywhere: per module l with n_l elements, G_i = c_i·sqrt(n_l),
    w_i = softmax(−G_i / T), Δ̄_l = (Σ w_i c_i)·1, clipped to φ per module; lr 1, μ 0: θ − Δ̂."""
    temperature, phi = 20.0, 2.0
    cfg = tiny(*EDIT_ONE_STEP, f"penalty.temperature={temperature}", f"penalty.clip={phi}", "penalty.clip_mode=absolute")
    theta0, spec = _initial(cfg)
    c = {0: 0.01, 1: 0.02, 2: 0.05}
    _, final, _ = _run(cfg, tmp_path, _crafted(spec, lambda pid: torch.full((spec.numel,), c[pid])))
    expected = theta0.clone()
    for _, ranges in module_groups(spec, "module"):
        n = sum(e - b for b, e in ranges)
        g = torch.tensor([c[i] * math.sqrt(n) for i in range(3)], dtype=torch.float64)
        w = torch.softmax(-g / temperature, dim=0)
        mean = float((w * torch.tensor([c[i] for i in range(3)], dtype=torch.float64)).sum())
        scale = min(1.0, phi / (mean * math.sqrt(n) + 1e-6))
        for b, e in ranges:
            expected[b:e] -= mean * scale
    torch.testing.assert_close(final, expected, rtol=1e-5, atol=1e-7)
    # at least one module was clipped and one was not: the test pins both branches
    sizes = [sum(e - b for b, e in r) for _, r in module_groups(spec, "module")]
    assert any(0.01 * math.sqrt(n) < phi for n in sizes) and any(0.05 * math.sqrt(n) > phi for n in sizes)


def test_outlier_module_is_rejected_and_a_module_all_reject_rolls_back(tiny, tmp_path, caplog):
    """After the statistics warm up, node 0 sends ×100 in every module: each of its modules is
    rejected (logged, counted) and the others step. When every node's ``embed`` is ×100 the
    embedding is not stepped at all (rollback) while the blocks still are."""
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny("strategy.name=edit", "run.rounds=5", "penalty.warmup=2", "penalty.clip=0")
    theta0, spec = _initial(cfg)
    groups = dict(module_groups(spec, "module"))
    gen = torch.Generator().manual_seed(0)
    base = {pid: torch.randn(spec.numel, generator=gen) * 1e-3 for pid in range(3)}
    make = _fresh_make(base, groups["embed"])  # round 4: node 0 ×100; round 5: every embedding ×100

    summary, final, _ = _run(cfg, tmp_path, _crafted(spec, make))
    rows = read_metrics(tmp_path / "run")
    by_step = {r["step"]: r for r in rows}
    assert by_step[4]["outer/rejected_modules"] == len(groups)  # node 0: every module rejected
    assert by_step[4]["outer/rejected"] == 1 and by_step[4]["outer/accepted"] == 2
    assert by_step[5]["outer/rolled_back_modules"] == 1
    assert "not stepped" in caplog.text and "embed" in caplog.text
    # the embedding after round 5 equals the embedding after round 4
    ckpt_after_4 = _replay(cfg, tmp_path, make_factory=lambda: _fresh_make(base), rounds=4)
    for b, e in groups["embed"]:
        torch.testing.assert_close(final[b:e], ckpt_after_4[b:e], rtol=0, atol=0)
    others = [r for name, rs in groups.items() if name != "embed" for r in rs]
    assert any(not torch.equal(final[b:e], ckpt_after_4[b:e]) for b, e in others)
    assert summary["rejected"] >= 1


# norm scale of every update per round: spread for the statistics, then normal rounds 4 and 5
FACTORS = {1: 1.0, 2: 1.3, 3: 0.75, 4: 1.0, 5: 1.0}


def _fresh_make(base, embed_ranges=()):
    """Δ of node ``pid`` in its r-th round: base × FACTORS[r]; node 0 sends ×100 in round 4 and,
    when ``embed_ranges`` are given, every node's embedding is ×100 in round 5."""
    seen: dict[int, int] = {}

    def make(pid):
        seen[pid] = seen.get(pid, 0) + 1
        rnd = seen[pid]
        d = base[pid] * FACTORS[rnd]
        if rnd == 4 and pid == 0:
            d = d * 100.0
        if rnd == 5:
            for b, e in embed_ranges:
                d[b:e] *= 100.0
        return d

    return make


def _replay(cfg, tmp_path, make_factory, rounds):
    import dataclasses

    short = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, rounds=rounds))
    _, spec = _initial(cfg)
    _, final, _ = _run(short, tmp_path, _crafted(spec, make_factory()), name=f"replay{rounds}")
    return final


def test_ablation_switches(tiny):
    full = tiny("strategy.name=edit")
    assert full.penalty.outlier and full.penalty.weighting == "norm_softmax" and full.penalty.clip == 10.0
    no_ae = tiny("strategy.name=edit", "penalty.outlier=false")
    p = Penalty(ParamSpec.from_state_dict({"w": torch.zeros(4)}), warmup=0, weighting="uniform", reject=False)
    # with the test off nothing finite is rejected, whatever the score
    for _ in range(3):
        p.observe("a", torch.tensor([1.0]))
        p.commit()
    p.observe("a", torch.tensor([1.5]))
    p.commit()
    accept, z = p.score("a", torch.tensor([1e9]))
    assert bool(accept.all()) and float(z[0]) > 1e6 and not no_ae.penalty.outlier
    accept, _ = p.score("a", torch.tensor([math.nan]))
    assert not bool(accept.any())
    assert tiny("strategy.name=edit", "penalty.weighting=uniform").penalty.weighting == "uniform"
    assert not tiny("strategy.name=edit", "penalty.enabled=false").penalty.enabled  # w/o all


def test_outlier_switch_off_folds_the_outlier(tiny, tmp_path):
    cfg = tiny("strategy.name=edit", "run.rounds=4", "penalty.warmup=2", "penalty.outlier=false")
    _, spec = _initial(cfg)
    gen = torch.Generator().manual_seed(1)
    base = {pid: torch.randn(spec.numel, generator=gen) * 1e-3 for pid in range(3)}
    summary, final, _ = _run(cfg, tmp_path, _crafted(spec, _fresh_make(base)))
    assert summary["rejected"] == 0
    assert all(r.get("outer/rejected_modules", 0) == 0 for r in read_metrics(tmp_path / "run"))


def test_warmup_rounds_average_single_steps_then_periodic_syncs(tiny, tmp_path):
    cfg = tiny("strategy.name=edit", "run.rounds=2", "strategy.inner_steps=3", "strategy.sync_warmup_steps=2")
    summary, final, grid = _run(cfg, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["outer/warmup"] for r in rows] == [1, 1, 0, 0]
    assert [r["train/inner_steps"] for r in rows] == [1, 1, 3, 3]
    assert summary["tokens"] == 3 * (1 + 1 + 3 + 3) * 4 * 32
    assert "outer/rejected_modules" not in rows[0] and "outer/rejected_modules" in rows[2]
    for ctx in grid.contexts.values():  # the client schedule position counts warm-up steps too
        assert int(ctx.state.config_records["inner_progress"]["step"]) == 8


def test_warmup_round_is_plain_model_averaging(tiny, tmp_path):
    """One warm-up round: θ_1 = mean of the local models, whatever the outer optimizer says."""
    cfg = tiny("strategy.name=edit", "run.rounds=1", "strategy.sync_warmup_steps=1", "strategy.outer_lr=0.3")
    theta0, spec = _initial(cfg)
    c = {0: 0.01, 1: -0.02, 2: 0.04}
    rows_seen = []

    def make(pid):
        rows_seen.append(pid)
        return torch.full((spec.numel,), c[pid]) if len(rows_seen) <= 3 else torch.zeros(spec.numel)

    _, final, _ = _run(cfg, tmp_path, _crafted(spec, make))
    # warm-up: θ0 − mean(c) (uniform weights, lr 1); then a zero pseudo-gradient changes nothing
    torch.testing.assert_close(final, theta0 - sum(c.values()) / 3, rtol=1e-6, atol=1e-7)


def test_a_edit_time_budget_gives_speed_proportional_steps(tiny, tmp_path):
    import json

    from tests.conftest import tiny_scenario_dict

    scen = tmp_path / "tiny.yaml"
    scen.write_text(json.dumps(tiny_scenario_dict()))
    cfg = tiny("strategy.name=a_edit", "strategy.time_budget_s=4.5", "strategy.inner_steps=20",
               "run.clock=virtual", f"run.scenario={scen}", "run.rounds=2")
    summary, _, _ = _run(cfg, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    # speeds 1, 2, 0.5 at 1 s/step: ceil(4.5 / 1) = 5, ceil(4.5 / 0.5) = 9, ceil(4.5 / 2) = 3
    assert rows[0]["train/inner_steps"] == pytest.approx((5 + 9 + 3) / 3)
    assert summary["tokens"] == 2 * (5 + 9 + 3) * 4 * 32
    # the round lasts as long as the slowest node's budgeted loop (3 steps x 2 s = 6 s), not H steps
    assert rows[0]["time/virtual_s"] < 20 * 2


def test_time_budget_on_the_wall_clock_stops_the_inner_loop(tiny):
    from fl_geo.data import BatchSampler
    from fl_geo.inner.training import InnerTrainer
    from fl_geo.runtime.builders import inner_config, make_model, partitions

    cfg = tiny()
    parts, _ = partitions(cfg.data, 1)
    trainer = InnerTrainer(make_model(cfg.model, 0), inner_config(cfg.client, 100))
    sampler = BatchSampler(parts[0].train, cfg.client.seq_len, cfg.client.batch_size, seed=0)
    capped = trainer.train(sampler, 7, 0, time_budget_s=1e9)  # budget never reached: H caps it
    assert capped.steps == 7
    quick = trainer.train(sampler, 10_000, 7, time_budget_s=1e-9)  # crossed during the first step
    assert quick.steps == 1 and quick.tokens == cfg.client.batch_size * cfg.client.seq_len
    with pytest.raises(ValueError):
        trainer.train(sampler, 3, 0, time_budget_s=-1.0)


def test_step_weight_mix_matches_the_formula():
    """Per module: w_i = (1 − r)·softmax weight_i + r·s_i / Σ s (atorch's step_weight_ratio)."""
    from fl_geo.core.accumulate import WeightedAccumulator

    sd = {"embed.weight": torch.zeros(6), "blocks.0.w": torch.zeros(4), "norm.weight": torch.zeros(2)}
    spec = ParamSpec.from_state_dict(sd)
    pen = Penalty(spec, granularity="module", weighting="norm_softmax", temperature=2.0, warmup=100)
    r = 0.3
    mix = StepWeightMix(pen, r)
    acc = WeightedAccumulator(spec.numel)
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(spec.numel, generator=gen) for _ in range(3)]
    steps = [5, 9, 3]
    for i, (d, s) in enumerate(zip(deltas, steps, strict=True)):
        v = pen.observe(i, pen.norms(d))
        pen.fold_(acc, d, v)
        mix.fold_(d, v, s)
    w = pen.finalize_weights()  # [updates, groups], normalised per group
    buf = acc.buffer
    pen.normalise_(buf)
    mix.mix_(buf)
    expected = torch.zeros(spec.numel, dtype=torch.float64)
    for g, (_, ranges) in enumerate(pen.groups):
        for i, d in enumerate(deltas):
            wi = (1 - r) * float(w[i, g]) + r * steps[i] / sum(steps)
            for b, e in ranges:
                expected[b:e] += wi * d[b:e].double()
    torch.testing.assert_close(buf.double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        StepWeightMix(pen, 1.5)


def test_a_edit_step_weights_through_the_server(tiny, tmp_path):
    """Δ_i = c_i·1 with steps 5, 9, 3 (speeds 1, 2, 0.5, budget 4.5 s), step_weight_ratio 1:
    the mean is the step-weighted mean whatever the softmax weights; clip off, lr 1, μ 0."""
    import json

    from tests.conftest import tiny_scenario_dict

    scen = tmp_path / "tiny.yaml"
    scen.write_text(json.dumps(tiny_scenario_dict()))
    cfg = tiny("strategy.name=a_edit", "strategy.time_budget_s=4.5", "strategy.inner_steps=20",
               "strategy.step_weight_ratio=1.0", "penalty.clip=0", "run.clock=virtual",
               f"run.scenario={scen}", "run.rounds=1", "strategy.outer_lr=1.0", "strategy.outer_momentum=0.0")
    theta0, spec = _initial(cfg)
    c = {0: 0.01, 1: 0.02, 2: 0.05}
    _, final, _ = _run(cfg, tmp_path, _crafted(spec, lambda pid: torch.full((spec.numel,), c[pid])))
    steps = {0: 5, 1: 9, 2: 3}
    mean = sum(c[i] * steps[i] for i in range(3)) / sum(steps.values())
    torch.testing.assert_close(final, theta0 - mean, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("strategy.name=a_edit",), "time_budget_s"),
        (("strategy.time_budget_s=-1",), "time_budget_s"),
        (("strategy.name=dips", "strategy.time_budget_s=5"), "synchronous"),
        (("strategy.step_weight_ratio=0.5",), "penalty.enabled"),
        (("strategy.name=edit", "strategy.step_weight_ratio=2"), r"\[0, 1\]"),
        (("strategy.name=fedbuff", "strategy.sync_warmup_steps=3"), "synchronous"),
    ],
)
def test_config_errors(tiny, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny(*overrides)


def test_noisy_steps_reach_the_run_metrics(tiny, tmp_path):
    cfg = tiny("strategy.name=edit", "data.noise_partitions=[1]", "data.noise_fraction=1.0", "strategy.inner_steps=3")
    _run(cfg, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["data/noisy_steps"] for r in rows] == [3, 3]  # partition 1's whole inner loops
    assert all(r["data/noisy_steps_accepted"] in (0, 3) for r in rows)
