"""Streaming DiLoCo and CoCoDC end to end (strategies/streaming.py + the ``train.stream`` client
handler), on the in-process InlineGrid: real Messages, real Contexts, real ClientApp."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message
from omegaconf import OmegaConf

from fl_geo.clients.datacenter import (
    PROGRESS_KEY,
    STREAM_META_KEY,
    STREAM_SNAPSHOT_KEY,
    merge_fragment,
)
from fl_geo.clients.datacenter import app as client_app
from fl_geo.config import ConfigError
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.core.streaming import AdaptiveSchedule, Fragments, fragment_spec, streaming_merge
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.runtime.wire import encode, payload_nbytes
from fl_geo.server_app import run_server
from tests.conftest import keep_declaration, partition_reply_hook, tiny_config

STREAM = ["run.sim_cpus=1", "model.n_layers=2"]
# CoCoDC on the fixed schedule (its default is the adaptive one, CoCoDC Algorithm 2)
COCODC_FIXED = ("strategy.name=cocodc", "streaming.adaptive=false")


def _cfg(tiny, *overrides):
    return tiny(*STREAM, *overrides)


class Recorder:
    """A reply hook that records every train.stream message (per node, in order) and can
    tamper with replies."""

    def __init__(self, tamper=None):
        self.messages: dict[int, list[dict]] = {}
        self.tamper = tamper

    def __call__(self, node, msg, reply):
        if msg.metadata.message_type != "train.stream":
            return reply
        c = msg.content.config_records["fl-geo"]
        self.messages.setdefault(node, []).append({
            "step": int(c["stream_step"]), "steps": int(c["stream_steps"]),
            "apply": json.loads(str(c["stream_apply"])), "sync": json.loads(str(c["stream_sync"])),
            "init": "arrays" in msg.content.array_records,
        })
        if self.tamper is not None and not reply.has_error():
            return self.tamper(node, msg, reply)
        return reply


def _run(cfg, tmp_path, name="run", hook=None, grid=None):
    grid = grid or InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    final = torch.load(tmp_path / name / "final_model.pt")["params"]
    return summary, final, grid, read_metrics(tmp_path / name)


def _initial(cfg):
    return flatten(make_model(cfg.model, cfg.run.seed).state_dict())


def _scenario(tmp_path, num_params, name="one_region", step_time=1.0):
    """Three nodes in one region on a 1 Gbit/s link (ring all-reduce over M = 3 nodes:
    2·(2/3)·bytes·8/1e9 s), ``step_time`` s per inner step."""
    d = {
        "name": name,
        "server_region": "A",
        "regions": ["A"],
        "links": {"bandwidth_gbps": [[1.0]]},
        "model": {"num_params": int(num_params), "step_time_s": step_time},
        "nodes": [{"region": "A"}, {"region": "A"}, {"region": "A"}],
    }
    path = tmp_path / f"{name}.yaml"
    OmegaConf.save(OmegaConf.create(d), path)
    return str(path)


def _allreduce_s(num_params: int) -> float:
    return 2 * 2 / 3 * 4 * num_params * 8 / 1e9  # fp32, M = 3, 1 Gbit/s


# ---- DiLoCo is the special case P = 1, τ = 0, α = 1 ---------------------------------------------


def test_streaming_p1_tau0_alpha1_is_diloco_bit_for_bit(tiny, tmp_path):
    # the same outer step for both (their defaults differ: DiLoCo's momentum is 0.5, Streaming's 0.9)
    common = ["run.rounds=2", "strategy.inner_steps=4", "strategy.weighting=tokens", "strategy.outer_momentum=0.9",
              "run.clock=virtual", f"run.scenario={_scenario(tmp_path, 1_000_000)}"]
    sd, diloco, _, drows = _run(_cfg(tiny, *common), tmp_path, "diloco")
    ss, streaming, grid, srows = _run(_cfg(tiny, *common, "strategy.name=streaming_diloco",
                                           "streaming.fragments=1", "streaming.overlap=0",
                                           "streaming.alpha=1.0"), tmp_path, "streaming")
    assert torch.equal(diloco, streaming)
    assert ss["outer_steps"] == sd["outer_steps"] == 2
    assert ss["tokens"] == sd["tokens"] and ss["bytes_up"] == sd["bytes_up"]
    # same virtual time, round by round: H steps + one full all-reduce per round
    assert [r["time/virtual_s"] for r in srows] == pytest.approx([r["time/virtual_s"] for r in drows])
    assert ss["virtual_s"] == pytest.approx(sd["virtual_s"]) == pytest.approx(2 * (4 + _allreduce_s(1_000_000)))
    assert [r["val/loss"] for r in srows] == [r["val/loss"] for r in drows]
    assert {t for _, t in grid.executed} == {"query", "train.stream"}
    assert all(r["stream/overlap_steps"] == 0 for r in srows[2:])  # applied at the next message


def test_cocodc_with_tau0_is_streaming_with_overwrite(tiny, tmp_path):
    """τ = 0 leaves no local progress to compensate: CoCoDC then overwrites with θ^g_p, as
    Streaming DiLoCo with α = 1 does, for any P."""
    common = ["strategy.inner_steps=4", "streaming.fragments=2", "streaming.overlap=0"]
    _, a, _, _ = _run(_cfg(tiny, *common, "strategy.name=streaming_diloco", "streaming.alpha=1.0"), tmp_path, "s")
    _, b, _, _ = _run(_cfg(tiny, *common, *COCODC_FIXED, "streaming.compensation=0.5"), tmp_path, "c")
    assert torch.equal(a, b)


# ---- the merge helper (CoCoDC with λ = 0 = overwrite + local progress) --------------------------


def test_merge_helper_rules():
    g = torch.Generator().manual_seed(3)
    start, now, new = (torch.randn(1000, generator=g) for _ in range(3))
    # λ = 0: the new global fragment plus the local progress since the sync started, exactly
    c0 = merge_fragment("cocodc", now, new, start, overlap=5, H=100, alpha=0.5, lam=0.0)
    assert torch.equal(c0, streaming_merge(now, new, 1.0) + (now - start))
    # λ > 0 corrects it (damped where the global moved the same way as the worker)
    c1 = merge_fragment("cocodc", now, new, start, overlap=5, H=100, alpha=0.5, lam=0.5)
    assert not torch.equal(c0, c1) and torch.isfinite(c1).all()
    # no snapshot (joined after the sync started) or no step in between: θ^g_p
    assert torch.equal(merge_fragment("cocodc", now, new, None, 5, 100, 0.5, 0.5), new)
    assert torch.equal(merge_fragment("cocodc", now, new, start, 0, 100, 0.5, 0.5), new)
    # streaming: the α-mix, α = 1 the global fragment exactly
    assert torch.equal(merge_fragment("streaming", now, new, start, 5, 100, 0.3, 0.5), streaming_merge(now, new, 0.3))
    assert torch.equal(merge_fragment("streaming", now, new, start, 5, 100, 1.0, 0.5), new)
    for t in (start, now, new):  # inputs untouched
        assert torch.isfinite(t).all()
    with pytest.raises(ValueError, match="stream_rule"):
        merge_fragment("bogus", now, new, start, 5, 100, 0.5, 0.5)


# ---- staleness: applied exactly τ steps after the sync started ---------------------------------


@pytest.mark.parametrize("name", ["streaming_diloco", "cocodc"])
def test_fragments_apply_tau_steps_after_their_sync(tiny, tmp_path, name):
    H, P, tau = 8, 2, 2
    cfg = _cfg(tiny, f"strategy.name={name}", "streaming.adaptive=false", f"strategy.inner_steps={H}",
               f"streaming.fragments={P}", f"streaming.overlap={tau}", "run.rounds=2")
    rec = Recorder()
    summary, final, grid, rows = _run(cfg, tmp_path, hook=rec)
    assert torch.isfinite(final).all() and summary["outer_steps"] == 2 * P
    for msgs in rec.messages.values():
        assert msgs[0]["init"] and not any(m["init"] for m in msgs[1:])
        # fixed schedule: syncs at (p+1)·H/P − τ = 2, 6, 10, 14; applies τ later; ticks between events
        assert [m["step"] for m in msgs] == [0, 2, 4, 6, 8, 10, 12, 14]
        assert sum(m["steps"] for m in msgs) == 2 * H
        started = {}
        for m in msgs:
            for p in m["apply"]:
                assert m["step"] - started.pop(p) == tau
            for p in m["sync"]:
                started[p] = m["step"] + m["steps"]
        # the last sync (started at 2H − τ) would apply at 2H, after the run: its outer step is
        # in the final global model, the workers never merge it
        assert started == {1: 2 * H - tau}
    assert [r["stream/overlap_steps"] for r in rows[1:]] == [tau, tau]
    assert [r["stream/syncs"] for r in rows[1:]] == [P, P]
    # the client's state: 2H steps run; the fragment synced last is still in flight
    for ctx in grid.contexts.values():
        assert int(ctx.state.config_records[PROGRESS_KEY]["step"]) == 2 * H
        meta = ctx.state.config_records[STREAM_META_KEY]
        assert json.loads(str(meta["snapshot_steps"])) == {"1": 2 * H - tau}
        assert list(ctx.state.array_records[STREAM_SNAPSHOT_KEY].keys()) == ["1"]


# ---- adaptive schedule (CoCoDC Algorithm 2) ------------------------------------------------------


def test_adaptive_schedule_picks_and_syncs_every_fragment(tiny, tmp_path):
    H, P, tau = 8, 2, 1
    cfg0 = _cfg(tiny)
    numel = _initial(cfg0).numel()
    # one fragment sync (the mean fragment: half the model) takes one inner step: T_s = T_c
    num_params = round(2 * 1e9 / (2 * 2 / 3 * 4 * 8))
    cfg = _cfg(tiny, "strategy.name=cocodc", f"strategy.inner_steps={H}", f"streaming.fragments={P}",
               f"streaming.overlap={tau}", "streaming.adaptive=true", "run.rounds=2", "run.clock=virtual",
               f"run.scenario={_scenario(tmp_path, num_params)}")
    expected_h = AdaptiveSchedule(P, H, 0.4).interval(1.0, _allreduce_s(num_params) / P)
    assert expected_h == 2  # N = max(2, floor(0.4 · 8 · 1 / 1)) = 3
    rec = Recorder()
    summary, final, _, rows = _run(cfg, tmp_path, hook=rec)
    assert torch.isfinite(final).all() and numel == final.numel()
    msgs = next(iter(rec.messages.values()))
    syncs = [(m["step"] + m["steps"], p) for m in msgs for p in m["sync"]]
    assert [t for t, _ in syncs] == list(range(expected_h, 2 * H + 1, expected_h))
    assert [p for _, p in syncs[:P]] == list(range(P))  # R_p = ∞ before a first sync: in order
    assert {p for _, p in syncs} == set(range(P))
    assert summary["outer_steps"] == len(syncs)
    assert all(r["stream/interval"] == expected_h for r in rows[1:])
    assert all(r["stream/overlap_steps"] == tau for r in rows[1:])
    # the per-fragment counts add up to the syncs the messages started (completed ones per round)
    assert all(sum(r[f"stream/syncs_f{p}"] for p in range(P)) == r["stream/syncs"] for r in rows[1:])
    assert [sum(r[f"stream/syncs_f{p}"] for r in rows[1:]) for p in range(P)] == \
        [sum(1 for _, q in syncs if q == p) for p in range(P)]


def test_adaptive_on_a_wall_clock_runs(tiny, tmp_path):
    cfg = _cfg(tiny, "strategy.name=cocodc", "strategy.inner_steps=6", "streaming.fragments=2",
               "streaming.overlap=1", "streaming.adaptive=true")
    summary, final, _, rows = _run(cfg, tmp_path)
    assert torch.isfinite(final).all() and summary["outer_steps"] >= 2
    assert rows[-1]["stream/interval"] >= 1


# ---- virtual time: only the communication not hidden behind compute is charged -------------------


@pytest.mark.parametrize("allreduce_s,expected", [(3.0, 10.0), (1.5, 8.0)])
def test_virtual_clock_charges_the_unhidden_communication(tiny, tmp_path, allreduce_s, expected):
    # P = 1, H = 4, τ = 2, 1 s per step: syncs start at steps 2 and 6 and apply at 4 and 8.
    # A 3 s all-reduce delays the apply at step 4 by 1 s (starts at 2 s, over at 5 s), the second
    # (starts at 7 s) ends the run at 10 s; a 1.5 s one is always hidden: 8 s of compute.
    num_params = round(allreduce_s * 1e9 / (2 * 2 / 3 * 4 * 8))
    cfg = _cfg(tiny, "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=1",
               "streaming.overlap=2", "run.clock=virtual", f"run.scenario={_scenario(tmp_path, num_params)}")
    summary, _, _, rows = _run(cfg, tmp_path)
    assert summary["virtual_s"] == pytest.approx(expected, rel=1e-6)
    assert rows[-1]["time/virtual_s"] == pytest.approx(expected, rel=1e-6)


# ---- bad replies ---------------------------------------------------------------------------------


def _tamper(kind, victims):
    def hook(node, msg, reply):
        if victims is not None and node not in victims:
            return reply
        content = dict(reply.content.array_records.items())
        frags = [k for k in content if k.startswith("frag_")]
        if not frags:
            return reply
        key = frags[0]
        if kind == "missing":
            content.pop(key)
        else:
            items = dict(content[key].items())
            name = next(iter(items))
            arr = items[name].numpy().copy()
            if kind == "nan":
                arr.reshape(-1)[0] = np.nan
            else:  # shape
                arr = arr.reshape(-1)[:-1]
            items[name] = Array(arr)
            content[key] = ArrayRecord(items)
        return Message(keep_declaration(reply, {**content, "metrics": reply.content.metric_records["metrics"]}), reply_to=msg)

    return hook


@pytest.mark.parametrize("kind", ["nan", "missing", "shape"])
def test_a_bad_fragment_reply_is_rejected_and_the_run_goes_on(tiny, tmp_path, kind, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, *COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "run.rounds=1")  # one period: P = 2 syncs
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[1]
    summary, final, _, rows = _run(cfg, tmp_path, hook=Recorder(_tamper(kind, {victim})), grid=grid)
    assert torch.isfinite(final).all()
    assert summary["outer_steps"] == 2  # the two other workers carry every sync
    assert summary["rejected"] == 2  # one per sync
    assert "rejected update from node" in caplog.text
    assert all(math.isfinite(r["val/loss"]) for r in rows)


def test_when_every_reply_is_bad_the_global_model_is_untouched(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1")
    summary, final, _, rows = _run(cfg, tmp_path, hook=Recorder(_tamper("nan", None)))
    assert torch.equal(final, _initial(cfg))  # bit-identical: no outer step
    assert summary["outer_steps"] == 0 and rows[-1]["stream/skipped_syncs"] == 2
    assert "outer step is skipped" in caplog.text


def test_a_vanished_worker_does_not_stall_the_run(tiny, tmp_path):
    cfg = _cfg(tiny, *COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "run.rounds=2")  # 18 replies; the victim vanishes after the 7th
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[2]
    state = {"n": 0}
    after: list[int] = []  # the nodes that replied once the victim was gone

    def hook(node, msg, reply):
        state["n"] += 1
        if state["n"] > 7:
            after.append(node)
        if state["n"] == 7:
            grid.remove_node(victim)
        return reply

    summary, final, _, rows = _run(cfg, tmp_path, hook=hook, grid=grid)
    assert summary["outer_steps"] == 4 and torch.isfinite(final).all()  # every sync ran: no stall
    # the run went on without the victim: the survivors kept replying, the victim never again
    assert after and victim not in after and set(after) <= set(grid.contexts) - {victim}


# ---- bandwidth: P = 4 moves a quarter of the model (plus the tied embedding) per sync ------------


def test_peak_bytes_per_sync_shrinks_with_p(tiny, tmp_path):
    common = ["strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.overlap=0",
              "model.n_layers=4", "run.rounds=1"]
    s1, _, _, r1 = _run(_cfg(tiny, *common, "streaming.fragments=1"), tmp_path, "p1")
    s4, _, _, r4 = _run(_cfg(tiny, *common, "streaming.fragments=4"), tmp_path, "p4")
    cfg = _cfg(tiny, *common)
    flat = _initial(cfg)
    spec = ParamSpec.from_state_dict(make_model(cfg.model, 0).state_dict())
    frags = Fragments(spec, 4)
    sizes = [payload_nbytes(encode(frags.gather(flat, p), fragment_spec(frags, p))) for p in range(4)]
    peak1, peak4 = r1[-1]["comm/peak_bytes_per_sync"], r4[-1]["comm/peak_bytes_per_sync"]
    assert peak1 == payload_nbytes(encode(flat, spec))
    assert peak4 == max(sizes)
    # the largest fragment holds one block of four and the (tied) embedding: 0.35 of this tiny model
    assert 0.25 < peak4 / peak1 < 0.4
    # every fragment synced once per period either way: the same data in total (+ npy headers)
    assert s4["bytes_up"] == pytest.approx(s1["bytes_up"], rel=0.02)


# ---- determinism ---------------------------------------------------------------------------------


def test_same_seed_same_bits(tiny, tmp_path):
    common = [*COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2", "streaming.overlap=1",
              "run.rounds=1"]  # one period (2 syncs, 3 messages a worker) is enough to differ by seed
    _, a, _, _ = _run(_cfg(tiny, *common), tmp_path, "a")
    _, b, _, _ = _run(_cfg(tiny, *common), tmp_path, "b")
    _, c, _, _ = _run(_cfg(tiny, *common, "run.seed=1"), tmp_path, "c")
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["streaming.fragments=3"], "streaming.fragments (P=3) must be <= model.n_layers"),
        (["model.n_layers=4", "streaming.fragments=3", "strategy.inner_steps=4"], "must divide strategy.inner_steps"),
        (["streaming.overlap=2", "strategy.inner_steps=4"], "streaming.overlap (tau=2) must be <"),
        (["streaming.alpha=1.5"], "streaming.alpha"),
        (["streaming.compensation=-1"], "streaming.compensation"),
        (["streaming.gamma=0"], "streaming.gamma"),
        (["streaming.fragments=0"], "streaming.fragments (P) must be >= 1"),
        (["penalty.enabled=true"], "penalty.enabled is not supported"),
        (["strategy.outer_optimizer=avg"], "uses outer_optimizer nesterov"),
        (["streaming.quantize=int2"], "streaming.quantize must be none, int8 or int4"),
        (["streaming.quantize_block=0"], "streaming.quantize_block must be >= 1"),
        (["streaming.quantize=int8", "wire.up=bf16"], "replaces wire.up for the fragment updates"),
    ],
)
def test_bad_streaming_config_is_a_clear_error(tiny, overrides, needle):
    with pytest.raises(ConfigError) as exc:
        tiny(*STREAM, *COCODC_FIXED, "strategy.inner_steps=8", "streaming.fragments=2",
             "streaming.overlap=1", *overrides)
    assert needle in str(exc.value)


def test_streaming_defaults_and_presets(tiny):
    cfg = tiny(*STREAM, "strategy.name=streaming_diloco", "strategy.inner_steps=8", "streaming.fragments=2",
               "streaming.overlap=1")
    s = cfg.strategy
    assert (s.outer_optimizer, s.outer_lr, s.outer_momentum) == ("nesterov", 0.7, 0.9)
    st = tiny().streaming  # other strategies do not look at the section
    assert (st.fragments, st.rule, st.overlap, st.alpha, st.compensation, st.adaptive, st.gamma) == (
        2, "blend", 5, 0.5, 0.5, False, 0.4)
    st = tiny(*STREAM, "strategy.name=cocodc", "strategy.inner_steps=8", "streaming.overlap=1").streaming  # CoCoDC (registry)
    assert (st.fragments, st.rule, st.adaptive) == (2, "compensate", True)


def test_too_many_fragments_for_the_model_fails_at_loop_start(tiny, tmp_path):
    cfg = _cfg(tiny, "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=0")
    cfg.streaming.fragments = 4  # past validation: the model has 2 blocks
    with pytest.raises(ValueError, match=r"streaming.fragments \(P=4\) does not fit the model"):
        _run(cfg, tmp_path)


# ---- the workers' own models (streaming.eval_workers) ---------------------------------------------


def test_worker_eval_scores_each_workers_own_model_and_changes_nothing_else(tiny, tmp_path):
    """val/worker_loss is the mean of the workers' θ^m on val/loss's batches; asking for it moves
    neither the model bits nor the virtual time axis."""
    from fl_geo.clients.datacenter import STREAM_LOCAL_KEY
    from fl_geo.runtime.evaluation import GlobalEvaluator

    cfg0 = _cfg(tiny, *COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2",
                "streaming.overlap=1", "run.rounds=2")
    flat = _initial(cfg0)
    common = [*COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2", "streaming.overlap=1",
              "run.rounds=2", "run.clock=virtual", f"run.scenario={_scenario(tmp_path, flat.numel())}",
              "run.num_clients=3"]
    _, plain, _, m_plain = _run(_cfg(tiny, *common), tmp_path, "plain")
    cfg = _cfg(tiny, *common, "streaming.eval_workers=true")
    _, scored, grid, m_scored = _run(cfg, tmp_path, "scored")
    assert torch.equal(plain, scored)
    assert [r["time/virtual_s"] for r in m_plain] == [r["time/virtual_s"] for r in m_scored]
    assert [r["val/loss"] for r in m_plain] == [r["val/loss"] for r in m_scored]
    assert "val/worker_loss" not in m_plain[-1] and "val/worker_loss" not in m_scored[0]  # round 0: no worker model yet

    evaluator = GlobalEvaluator(cfg, cfg.run.num_clients)
    own = [evaluator.evaluate(torch.from_numpy(ctx.state.array_records[STREAM_LOCAL_KEY]["flat"].numpy()))
           for ctx in grid.contexts.values()]
    last = m_scored[-1]
    assert last["val/worker_loss"] == pytest.approx(sum(own) / len(own), rel=1e-6)
    assert last["val/worker_loss_min"] == pytest.approx(min(own), rel=1e-6)
    assert last["val/worker_loss_max"] == pytest.approx(max(own), rel=1e-6)
    assert min(own) < max(own)  # the workers trained on different data: their models differ
    # the global model is none of them
    assert all(abs(v - last["val/loss"]) > 1e-6 for v in own)


def test_worker_eval_without_a_streaming_model_is_an_error_reply(tiny, tmp_path, flower_task_identity):
    """A node asked to score a model it does not hold answers with an error, which the server
    logs and skips (no figure rather than a wrong one)."""
    from flwr.app import Context, MessageType
    from flwr.app import RecordDict as RD

    from fl_geo.clients.datacenter import evaluate_stream
    from fl_geo.runtime.protocol import EvaluateRequest
    from fl_geo.strategies.base import client_config_record

    cfg = _cfg(tiny, *COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1")
    request = EvaluateRequest(**client_config_record(cfg), round=1, base_version=0, eval_batches=2)
    msg = Message(RD({"fl-geo": request.to_record()}), dst_node_id=1, message_type=f"{MessageType.EVALUATE}.stream")
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1}, state=RD(), run_config={})
    with pytest.raises(RuntimeError, match="holds no streaming model"):
        evaluate_stream(msg, ctx)


# ---- quantised fragment updates (streaming.quantize) ----------------------------------------------


QUANTISED_PERIOD = ("strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=1",
                    "streaming.overlap=0", "run.rounds=1")


@pytest.fixture(scope="module")
def fp32_period_bytes_up(tmp_path_factory):
    """Uplink bytes of the fp32 QUANTISED_PERIOD run: the reference of both codecs, run once."""
    torch.manual_seed(0)
    return _run(_cfg(tiny_config, *QUANTISED_PERIOD), tmp_path_factory.mktemp("fp32"), "fp32")[0]["bytes_up"]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_outer_step_runs_on_the_dequantised_mean(tiny, tmp_path, kind, fp32_period_bytes_up):
    """P = 1, τ = 0, one period: the global model is one Nesterov step on the token-weighted mean
    of the workers' dequantised Δ, and the payloads are a quarter / an eighth of fp32's."""
    from fl_geo.core.outer import build_outer_optimizer
    from fl_geo.core.quantize import dequantize

    common = QUANTISED_PERIOD
    seen = []

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train.stream" and "frag_0" in reply.content.array_records:
            seen.append((reply.content.array_records["frag_0"], int(reply.content.metric_records["metrics"]["tokens"])))
        return reply

    cfg = _cfg(tiny, *common, f"streaming.quantize={kind}", "streaming.quantize_block=64")
    s_q, final, _, _ = _run(cfg, tmp_path, kind, hook=hook)
    init = _initial(cfg)
    # the old quantiser's decode (fl_geo.core.quantize): the alias keeps its meaning
    assert all(sorted(r.keys()) == ["codes", "scales"] for r, _ in seen)
    deltas = [dequantize(r["codes"].numpy(), r["scales"].numpy(), init.numel(), kind, 64) for r, _ in seen]
    tokens = torch.tensor([float(t) for _, t in seen])
    mean = sum(w * d for w, d in zip(tokens / tokens.sum(), deltas, strict=True))
    expected = init.clone()
    build_outer_optimizer("nesterov", init.numel(), lr=0.7, momentum=0.9).step(expected, mean)
    assert len(seen) == cfg.run.num_clients
    assert torch.allclose(final, expected, rtol=0, atol=1e-6)
    assert s_q["bytes_up"] / fp32_period_bytes_up < (0.3 if kind == "int8" else 0.17)


def test_quantised_syncs_are_cheaper_on_the_virtual_clock_so_the_adaptive_schedule_syncs_more(tiny, tmp_path):
    H, P = 8, 2
    # fp32: one fragment sync (half the model) takes one inner step, T_s = T_c: N = 3, h = 2
    num_params = round(2 * 1e9 / (2 * 2 / 3 * 4 * 8))
    common = ["strategy.name=cocodc", f"strategy.inner_steps={H}", f"streaming.fragments={P}", "streaming.overlap=1",
              "streaming.adaptive=true", "run.rounds=1", "run.clock=virtual",
              f"run.scenario={_scenario(tmp_path, num_params)}"]
    _, _, _, fp = _run(_cfg(tiny, *common), tmp_path, "fp32")
    _, _, _, q4 = _run(_cfg(tiny, *common, "streaming.quantize=int4"), tmp_path, "int4")
    assert fp[-1]["stream/interval"] == 2
    assert q4[-1]["stream/interval"] == 1  # T_s ≈ (0.5 + 4/128) / 4 of fp32's: N = 24 > H, h = 1
    assert q4[-1]["stream/syncs"] > fp[-1]["stream/syncs"]


def test_a_quantised_update_with_a_bad_scale_is_rejected(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, *COCODC_FIXED, "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "streaming.quantize=int8", "run.rounds=1")  # one period: 2 syncs
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[1]

    def tamper(node, msg, reply):
        if node != victim:
            return reply
        content = dict(reply.content.array_records.items())
        for key in [k for k in content if k.startswith("frag_")]:
            scales = content[key]["scales"].numpy().copy()
            scales[0] = np.nan
            content[key] = ArrayRecord({"codes": content[key]["codes"], "scales": Array(scales)})
        return Message(keep_declaration(reply, {**content, "metrics": reply.content.metric_records["metrics"]}), reply_to=msg)

    summary, final, _, _ = _run(cfg, tmp_path, hook=Recorder(tamper), grid=grid)
    assert torch.isfinite(final).all()
    assert summary["outer_steps"] == 2 and summary["rejected"] == 2
    assert "scales must be finite" in caplog.text


@pytest.mark.parametrize("lie", [{"tokens": float("nan")}, {"tokens": 2**40}, {"train_time_s": float("inf")},
                                 {"overlap_count": -3}, {"steps": [4, 4]}],
                         ids=["tokens-nan", "tokens-beyond-job", "train-time-inf", "overlap-negative", "steps-a-list"])
def test_lying_fragment_metrics_are_rejected_and_the_model_untouched(tiny, tmp_path, lie, caplog):
    """Every fragment reply lies in one scalar: each is a counted rejection (before: ``int(nan)``
    ended the run), no outer step, the global model bit-identical to the initial one."""
    from flwr.app import MetricRecord

    def tamper(node, msg, reply):
        metrics = MetricRecord({**dict(reply.content.metric_records["metrics"]), **lie})
        arrays = dict(reply.content.array_records.items())
        return Message(keep_declaration(reply, {**arrays, "metrics": metrics}), reply_to=msg)

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "run.rounds=1")
    summary, final, _, _ = _run(cfg, tmp_path, hook=Recorder(tamper))
    assert summary["outer_steps"] == 0 and summary["rejected"] == 9  # every reply: 3 workers x 3 messages
    assert torch.equal(final, _initial(cfg))
    assert "rejected update from node" in caplog.text


# ---- replies that answer another tick, and reported times (issue 26) ----------------------------


def _with_metrics(reply, msg, **values):
    from flwr.app import MetricRecord

    metrics = MetricRecord({**dict(reply.content.metric_records["metrics"]), **values})
    arrays = {k: v for k, v in reply.content.array_records.items()}
    return Message(keep_declaration(reply, {**arrays, "metrics": metrics}), reply_to=msg)


@pytest.mark.parametrize("name", ["streaming_diloco", "cocodc"])
def test_replayed_fragment_replies_are_refused_and_the_model_is_the_one_without_them(tiny, tmp_path, name, caplog):
    """From its 2nd tick on, one site answers every message with its previous reply, replayed
    (the issue: Streaming accepted 5 of 7). A reply echoes the tick it answers (``stream_step``)
    and the version it was sent (``base_version``): every replay is refused, and the model is
    bit-identical to the run in which the same replies were refused for a NaN token count."""
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, f"strategy.name={name}", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1", "streaming.adaptive=false")
    replay = partition_reply_hook(0, lambda n, reply, msg, earlier: _with_metrics(earlier[-1], msg) if n >= 2 else reply,
                                   "train.stream")
    summary, final, _, _ = _run(cfg, tmp_path, "replayed", hook=replay)
    assert replay.changed >= 5 and summary["rejected"] == replay.changed
    assert "replayed or duplicated" in caplog.text or "trained from model version" in caplog.text
    nan = partition_reply_hook(0, lambda n, reply, msg, earlier: _with_metrics(reply, msg, tokens=float("nan")) if n >= 2 else reply,
                                "train.stream")
    nan_summary, without, _, _ = _run(cfg, tmp_path, "nan", hook=nan)
    assert nan_summary["rejected"] == replay.changed and nan_summary["outer_steps"] == summary["outer_steps"]
    assert torch.equal(final, without)


def test_a_fragment_reply_of_another_version_is_refused(tiny, tmp_path, caplog):
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = _cfg(tiny, "strategy.name=streaming_diloco", "strategy.inner_steps=4", "streaming.fragments=2",
               "streaming.overlap=1")
    forged = partition_reply_hook(0, lambda n, reply, msg, earlier: _with_metrics(reply, msg, base_version=12345) if n == 3 else reply,
                                   "train.stream")
    summary, _, _, _ = _run(cfg, tmp_path, hook=forged)
    assert summary["rejected"] == 1 and "trained from model version 12345" in caplog.text


def _fixed_step_time(step_time_s=1e-5, liar=None):
    """Every site reports ``step_time_s`` (so the honest wall-clock schedule does not depend on
    this machine's speed: T_c is far below any T_s, N = P, h = H/P); the site of partition 0
    also reports ``liar``'s values."""
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train.stream" or reply.has_error():
            return reply
        lie = liar if liar and reply.content.metric_records["metrics"]["partition_id"] == 0 else {}
        return _with_metrics(reply, msg, **{"step_time_s": step_time_s, **lie})
    return hook


ADAPTIVE_WALL = ("strategy.name=cocodc", "strategy.inner_steps=8", "streaming.fragments=2",
                 "streaming.overlap=1", "streaming.adaptive=true", "run.rounds=3")


@pytest.fixture(scope="module")
def adaptive_honest(tmp_path_factory):
    """The honest run of the ADAPTIVE_WALL configuration (every site reports the same fixed
    step time): (summary, metrics rows), run once for the three lies below, not once per lie."""
    torch.manual_seed(0)
    honest, _, _, rows = _run(_cfg(tiny_config, *ADAPTIVE_WALL), tmp_path_factory.mktemp("adaptive"), "honest",
                              hook=_fixed_step_time())
    return honest, rows


@pytest.mark.parametrize("lie", [{"step_time_s": 3600.0}, {"train_time_s": 1e300},
                                 {"step_time_s": 3600.0, "train_time_s": 1e300}],
                         ids=["step-time-3600", "train-time-1e300", "both"])
def test_one_site_lying_about_its_times_does_not_move_the_adaptive_schedule(tiny, tmp_path, lie, adaptive_honest):
    """CoCoDC's adaptive schedule on a wall clock is built from the reported times. One site of
    three reporting a 3600 s step or a 1e300 s training (the issue: outer steps 6 -> 14, uplink
    bytes x2.3) gets the honest run's schedule: same interval every round, same outer steps
    and uplink bytes, nothing refused (each site's time is capped by its own history, and the
    median across sites, not the maximum, is used)."""
    cfg = _cfg(tiny, *ADAPTIVE_WALL)
    honest, hrows = adaptive_honest
    lied, _, _, lrows = _run(cfg, tmp_path, "lied", hook=_fixed_step_time(liar=lie))
    assert [r["stream/interval"] for r in hrows[1:]] == [4, 4, 4]  # h = H/P: N = P syncs a period
    assert [r["stream/interval"] for r in lrows[1:]] == [r["stream/interval"] for r in hrows[1:]]
    assert [r["stream/syncs"] for r in lrows[1:]] == [r["stream/syncs"] for r in hrows[1:]]
    assert (lied["outer_steps"], lied["bytes_up"], lied["rejected"]) == (honest["outer_steps"], honest["bytes_up"], 0)


def test_reported_times_are_capped_by_the_sites_own_history_and_combined_by_the_median():
    from fl_geo.core.claims import ReportedTimes, robust_time

    times = ReportedTimes(factor=4.0)
    assert times.bound("a", 2.0) == 2.0  # a first report is taken as it is
    assert times.bound("a", 3600.0) == 8.0  # 4 x its own median of earlier reports
    assert times.bound("b", 3600.0) == 3600.0  # another site's history is its own
    assert times.bound("a", 1.0) == 1.0  # a cap, never a floor
    assert robust_time([1.0, 2.0, 3600.0]) == 2.0 and robust_time([]) == 0.0
