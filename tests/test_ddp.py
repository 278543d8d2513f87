"""The data-parallel reference method ``ddp`` (issue 27, item 2).

What it must be: every step the sites' gradients are averaged and one inner AdamW step (with the
schedule and the clip) is applied, which is one process training on the concatenated batch; on a
scenario's virtual clock a step costs one inner step on the slowest site plus a ring all-reduce
of the gradient; a bad reply is rejected without touching the model; plain Flower ClientApps
(which cannot compute a gradient job) are refused.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from fl_geo.clients.datacenter import app as client_app
from fl_geo.clients.settings import ClientSection
from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.inner.large_batch import LargeBatchAdamW
from fl_geo.inner.training import InnerConfig, default_optimizer, lr_at
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from fl_geo.strategies import DDP
from tests import plain_flower_app as plain
from tests import user_mlp_app as user
from tests.conftest import keep_declaration, site_reply_hook, tiny_scenario_dict

SITES, STEPS = 3, 3
# grad_clip 0.5 binds on these batches (asserted), so the test also pins where the clip acts: on
# the mean gradient, as one process clips its one gradient
INNER = ClientSection(lr=1e-2, warmup_steps=2, batch_size=user.BATCH, seq_len=2, device="cpu", grad_clip=0.5)


def _single_process(steps: int, clip: bool = True) -> torch.Tensor:
    """The reference: one process, fl-geo's inner AdamW, the concatenation of every site's batch."""
    model = user.initial_model()
    cfg = InnerConfig(lr=INNER.lr, min_lr_ratio=INNER.min_lr_ratio, warmup_steps=INNER.warmup_steps, total_steps=steps,
                      betas=(INNER.beta1, INNER.beta2), eps=INNER.eps, weight_decay=INNER.weight_decay,
                      grad_clip=INNER.grad_clip)
    opt = default_optimizer(model, cfg)
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(t, cfg)
        batches = [user.samples(site, t, user.BATCH) for site in range(SITES)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        user.mse(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return flatten(model.state_dict())


def test_a_ddp_step_is_one_process_adamw_step_on_the_concatenated_batch():
    strategy = DDP(inner=INNER)
    initial = ArrayRecord(user.initial_model().state_dict())
    result = strategy.start(InlineGrid(user.app, SITES, seed=0), initial, num_rounds=STEPS)
    got = flatten(result.arrays.to_torch_state_dict())
    want = _single_process(STEPS)
    assert strategy.stats.outer_steps == STEPS and strategy.stats.rejected == 0
    assert strategy.stats.tokens == STEPS * SITES * user.BATCH
    steps = [r for r in strategy.loop.history if r.get("step", 0) > 0]
    assert [r["train/lr"] for r in steps] == pytest.approx([5e-3, 1e-2, 1e-2])  # warm-up of 2, then the cosine's start
    assert min(r["outer/clip_scale"] for r in steps) < 1  # the clip bound at least once
    moved = float((want - flatten(initial.to_torch_state_dict())).abs().max())
    diff = float((got - want).abs().max())
    assert diff <= 1e-6 < moved / 100, (diff, moved)  # fp32 summation order only
    # the tolerance tells the right step from a near miss: the same steps without the clip
    assert float((got - _single_process(STEPS, clip=False)).abs().max()) > 100 * max(diff, 1e-7)


def _tiny_ddp(tiny, tmp_path, name, *overrides, hook=None):
    cfg = tiny("strategy.name=ddp", "strategy.inner_steps=1", *overrides)
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    final = torch.load(tmp_path / name / "final_model.pt")["params"]
    return summary, final, read_metrics(tmp_path / name)


def test_the_virtual_clock_charges_the_slowest_step_and_a_ring_allreduce_of_the_gradient(tiny, tmp_path):
    """tests/conftest.py's tiny scenario: 1 s per step at speed 1; node 0 in region A (speed 1),
    nodes 1 and 2 in B (speeds 2 and 0.5); 1000 modelled parameters, an fp32 gradient of 4000
    bytes. By hand:

    - compute: the slowest site, node 2: 1 s / 0.5 = 2 s (no server message is charged: the
      intra-region latencies are 0, while DiLoCo's round would add node 2's 0.25 + 0.5 s);
    - the ring over A and B (B's two nodes joined by B's own link, 40 Gbit/s, 0 s): slowest link
      min(8, 4, 40) = 4 Gbit/s, largest latency max(0.5, 0.25, 0) = 0.5 s; M = 3 nodes:
      2(M-1) latency = 4 x 0.5 = 2 s, 2(M-1)/M x 4000 B x 8 / 4e9 = 4/3 x 8e-6 s.
    """
    scen = tmp_path / "tiny.json"
    scen.write_text(json.dumps(tiny_scenario_dict()))
    summary, _, rows = _tiny_ddp(tiny, tmp_path, "clock", "run.clock=virtual", f"run.scenario={scen}", "run.rounds=3")
    step_s = 2.0 + (2 * 2 * 0.5 + 2 * 2 / 3 * 4000 * 8 / 4e9)
    assert step_s == pytest.approx(4.0000106667, abs=1e-9)
    assert [r["time/virtual_s"] for r in rows] == pytest.approx([0.0, step_s, 2 * step_s, 3 * step_s], rel=1e-12)
    assert summary["outer_steps"] == 3 and all(r["outer/accepted"] == 3 for r in rows[1:])


def _sites_with(partitions: set[int], make):
    """A reply hook: the train replies of the sites in ``partitions`` carry ``make(arrays)``."""

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        metrics = reply.content.metric_records["metrics"]
        if metrics["partition_id"] not in partitions:
            return reply
        arrays = make(reply.content.array_records["arrays"])
        return Message(keep_declaration(reply, {"arrays": arrays, "metrics": MetricRecord(dict(metrics))}), reply_to=msg)

    return hook


def test_a_nan_or_misshapen_gradient_is_a_logged_rejection_and_the_model_is_unchanged(tiny, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="fl_geo")
    cfg = tiny()
    initial = flatten(make_model(cfg.model, cfg.run.seed).state_dict())
    # every site's gradient NaN: nothing is folded, no step is taken, θ is the initial model
    summary, final, rows = _tiny_ddp(tiny, tmp_path, "nan", hook=site_reply_hook(0, scale=float("nan")))
    assert [r["outer/rejected"] for r in rows[1:]] == [1, 1] and summary["outer_steps"] == 2
    summary, final, rows = _tiny_ddp(tiny, tmp_path, "all_nan", hook=_sites_with({0, 1, 2}, lambda a: ArrayRecord(
        {k: Array(v.numpy() * np.float32("nan")) for k, v in a.items()})))
    assert torch.equal(final, initial)
    assert summary["outer_steps"] == 0 and summary["rejected"] == 3 * 2
    assert "NaN" in caplog.text
    # one site's gradient with a wrong shape: rejected (named in the log), the other two step
    caplog.clear()

    def truncated(a):
        first = next(iter(a))
        return ArrayRecord({k: Array(v.numpy()[..., :1] if k == first else v.numpy()) for k, v in a.items()})

    summary, final, rows = _tiny_ddp(tiny, tmp_path, "shape", hook=_sites_with({1}, truncated))
    assert [r["outer/accepted"] for r in rows[1:]] == [2, 2] and [r["outer/rejected"] for r in rows[1:]] == [1, 1]
    assert summary["outer_steps"] == 2 and torch.isfinite(final).all() and not torch.equal(final, initial)
    assert "shape" in caplog.text


def test_settings_registry_and_refusals(tiny):
    s = DDP().config.strategy
    assert (s.name, s.outer_optimizer, s.inner_steps, s.weighting) == ("ddp", "adamw", 1, "tokens")
    with pytest.raises(ConfigError, match="inner_steps must be 1"):
        DDP(inner_steps=4)
    with pytest.raises(ConfigError, match="inner_steps must be 1"):
        tiny("strategy.name=ddp")  # TINY's H = 3
    with pytest.raises(ConfigError, match="quorum"):
        DDP(quorum=0.5)
    with pytest.raises(ConfigError, match="penalty"):
        tiny("strategy.name=ddp", "strategy.inner_steps=1", "penalty.enabled=true")
    with pytest.raises(ConfigError, match="client.devices"):
        tiny("strategy.name=ddp", "strategy.inner_steps=1", "client.devices=2")
    with pytest.raises(ConfigError, match="clients='flower'"):
        DDP(clients="flower")
    with pytest.raises(ConfigError, match="needs fl-geo's ClientApp.*gradient"):  # found plain by the probe
        DDP().start(InlineGrid(plain.app, 2), ArrayRecord(plain.initial_model().state_dict()), num_rounds=1)


def test_the_server_adamw_state_round_trips_through_a_checkpoint():
    """Two steps, save, load into a fresh optimizer, one more step each: the same bits."""
    spec = ParamSpec.from_state_dict({"w": torch.zeros(3, 4), "b": torch.zeros(4)})
    cfg = InnerConfig(lr=1e-2, warmup_steps=1, total_steps=5, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(spec.numel, generator=gen)
    grads = [torch.randn(spec.numel, generator=gen) for _ in range(3)]
    a = LargeBatchAdamW(spec, cfg)
    for g in grads[:2]:
        a.step(params, g)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()}
    assert set(saved) == {"numel", "steps", "exp_avg", "exp_avg_sq"} and saved["steps"] == 2
    b = LargeBatchAdamW(spec, cfg)
    b.load_state_dict(saved)
    p1, p2 = params.clone(), params.clone()
    g = grads[2].clone()
    a.step(p1, grads[2])
    b.step(p2, grads[2])
    assert torch.equal(p1, p2) and not torch.equal(p1, params)
    assert torch.equal(grads[2], g)  # the mean gradient handed in is never modified (the clip scales a copy)
    assert a.last_lr == lr_at(2, cfg) and a.last_clip_scale < 1


def test_a_resumed_ddp_run_is_bit_identical_to_an_uninterrupted_one(tiny, tmp_path):
    """The server's AdamW moments and step count are in the checkpoint (the sites hold no state)."""
    from tests.test_checkpoint import crash_and_resume

    common = ["strategy.name=ddp", "strategy.inner_steps=1", "run.rounds=5", "run.clock=virtual",
              "run.checkpoint_every=1"]
    full = run_server(InlineGrid(client_app, 3, seed=0), tiny(*common), tmp_path / "full")
    resumed = crash_and_resume(tiny, common, tmp_path / "resumed")
    final = {name: torch.load(tmp_path / name / "final_model.pt")["params"] for name in ("full", "resumed")}
    assert torch.equal(final["full"], final["resumed"])
    assert resumed["outer_steps"] == full["outer_steps"] == 5 and resumed["tokens"] == full["tokens"]
    rows_full, rows_res = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert [r["train/lr"] for r in rows_res[1:]] == [r["train/lr"] for r in rows_full[1:]]
    assert [r["time/virtual_s"] for r in rows_res] == [r["time/virtual_s"] for r in rows_full]
