"""Smoke run of the outer-step benchmark at a tiny size, in-process (well under 5 s)."""

from __future__ import annotations

import pytest

from fl_geo.bench.command import main
from fl_geo.bench.outer import llama_spec, run_outer_bench
from fl_geo.bench.outer_report import format_outer_bench


def test_llama_spec_shapes() -> None:
    spec = llama_spec(100_000_000)
    assert abs(spec.numel - 100_000_000) < 1_000
    assert spec.names[0] == "embed.weight" and spec.names[-1] == "norm.weight"
    assert "blocks.11.attn.wqkv.weight" in spec.names
    assert spec.shapes[spec.index("blocks.0.attn.wqkv.weight")] == (3 * 768, 768)
    small = llama_spec(10_000_000)
    assert abs(small.numel - 10_000_000) < 1_000 and "blocks.11.mlp.w2.weight" in small.names


def test_outer_bench_smoke() -> None:
    result = run_outer_bench(num_params=300_000, num_updates=3, precision="bf16", repeats=1,
                             memory_counts=(1, 3), isolate=False,
                             copy_elems=1 << 22)
    assert result["config"]["num_updates"] == 3
    assert result["ours"]["best_s"] > 0 and result["flower"]["best_s"] > 0
    # bf16 wire: half the fp32-equivalent bytes, plus .npy headers
    assert result["ours"]["wire_gbps"] == pytest.approx(result["ours"]["fp32_gbps"] / 2, rel=0.05)
    # our mean of the fp32 replies equals Flower's FedAvg mean (to fp32 rounding)
    assert result["flower"]["max_abs_diff_vs_ours"] < 1e-8
    # both groupings of the replies give the same sum, bit for bit
    assert result["ours"]["bit_identical"] is True
    ours, one = result["ours"], result["ours_one_at_a_time"]
    assert 0 < ours["aggregation_s"] < ours["best_s"] and 0 < one["aggregation_s"] < one["best_s"]
    assert set(result["checks"]) == {"throughput", "speedup", "memory"}
    speedup = result["checks"]["speedup"]
    assert speedup["ratio"] < speedup["aggregation_ratio"]  # strict: our step has Nesterov too
    text = format_outer_bench(result)
    for needle in ("bytes copied/s", "bytes read+written/s", "fp32-eq GB/s", "speed-up",
                   "strict", "aggregation vs aggregation", "one add_batch_checked",
                   "one at a time (batches of 1)", "bit-identical", "peak extra memory",
                   "ours, 3 updates", "first 2 steps (cold)"):
        assert needle in text
    assert text.count("PASS") + text.count("FAIL") == 3


def test_main_rejects_bad_precision(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["outer", "--precision", "int8"])
    assert "usage: fl-geo bench outer" in capsys.readouterr().err


def test_attack_bench_runs_every_defence_and_each_rejects_the_hostile_site(tmp_path, capsys):
    """``fl-geo bench attack`` on the tiny config: the hostile site wrecks the undefended run and
    every defence rejects each of its replies (the cap for its claim, the bound for its norm)."""
    from fl_geo.bench.attack import format_attack_bench, run_attack_bench
    from tests.conftest import tiny_overrides

    results = run_attack_bench(None, tiny_overrides("run.rounds=2", "strategy.weighting=tokens"), out=tmp_path)
    by_name = {r.name: r for r in results}
    assert list(by_name) == ["honest", "undefended", "token cap", "norm bound", "defended"]
    assert by_name["honest"].rejected == by_name["undefended"].rejected == 0
    import torch

    final = {n: torch.load(tmp_path / n / "final_model.pt")["params"] for n in ("honest", "undefended", "defended")}
    # the claim owns the mean undefended: the model lands far from the honest one; defended it stays close
    far = torch.linalg.vector_norm(final["undefended"] - final["honest"])
    near = torch.linalg.vector_norm(final["defended"] - final["honest"])
    assert far > 10 * near
    for name in ("token cap", "norm bound", "defended"):
        assert by_name[name].rejected == 2 and by_name[name].outer_steps == 2  # one hostile reply per round
    table = format_attack_bench(results, -10.0, 2**40)
    assert "target: defended <= 1.05 x honest" in table and (tmp_path / "attack.json").exists()


def test_attack_bench_refuses_an_attacker_the_run_does_not_have():
    from fl_geo.bench.attack import run_attack_bench
    from fl_geo.errors import ConfigError

    with pytest.raises(ConfigError, match="--attacker 9 is not a partition of the run's 3 sites"):
        run_attack_bench(None, ["run.num_clients=3"], attacker=9)


# ---- fl-geo bench attack --matrix ---------------------------------------------------------------------

def _model_messages(cfg, flower_style: bool, seed: int = 1):
    """A train request carrying the run's model θ_sent (fp32) and a reply to it: the trained model
    θ_local the Flower way, or fl-geo's declared Δ = θ_sent − θ_local; plus θ_sent and θ_local flat."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from fl_geo.core.state import ParamSpec, flatten, unflatten
    from fl_geo.runtime.builders import make_model
    from fl_geo.runtime.protocol import REQUEST_RECORD, ReplyDeclaration
    from fl_geo.runtime.wire import encode

    state = make_model(cfg.model, cfg.run.seed).state_dict()
    spec = ParamSpec.from_state_dict(state)
    sent = flatten(state, spec)
    local = sent + 0.01 * torch.randn(spec.numel, generator=torch.Generator().manual_seed(seed))
    msg = Message(RecordDict({"arrays": ArrayRecord(unflatten(sent, spec))}), dst_node_id=7, message_type="train")
    if flower_style:
        content = {"arrays": ArrayRecord(unflatten(local, spec)), "metrics": MetricRecord({"num-examples": 40})}
    else:
        decl = ConfigRecord(ReplyDeclaration(payload="pseudo_grad", precision="fp32").to_record())
        content = {"arrays": encode(sent - local, spec, "fp32"),
                   "metrics": MetricRecord({"tokens": 1536, "partition_id": 0}), REQUEST_RECORD: decl}
    return msg, Message(RecordDict(content), reply_to=msg), sent, local, spec


@pytest.mark.parametrize("claim, examples, devices", [("honest", 40, None), ("4096-device", 4096 * 40, 4096),
                                                      ("2^40", 2**40, None)])
def test_a_hostile_plain_reply_is_the_turned_scaled_model_with_its_claim(tiny, flower_task_identity, claim, examples,
                                                                          devices):
    """θ_sent − s·(θ_local − θ_sent), exactly, from the request's model; the claim in num-examples."""
    import torch

    from fl_geo.bench.attack_matrix import turned_reply_hook
    from fl_geo.core.state import flatten

    cfg = tiny()
    msg, reply, sent, local, spec = _model_messages(cfg, flower_style=True)
    out = turned_reply_hook(cfg, [7], 3.0, claim)(7, msg, reply)
    got = flatten(out.content.array_records["arrays"].to_torch_state_dict(), spec)
    assert torch.equal(got, sent - 3.0 * (local - sent))
    assert not torch.equal(got, local)
    metrics = out.content.metric_records["metrics"]
    assert metrics["num-examples"] == examples and metrics.get("devices") == devices
    assert "fl-geo" not in out.content.config_records  # still a Flower-convention reply
    assert turned_reply_hook(cfg, [8], 3.0, claim)(7, msg, reply) is reply  # another node's reply passes


def test_a_hostile_fl_geo_reply_is_minus_s_delta_and_its_profile_claims_4096_devices(tiny, flower_task_identity):
    import torch
    from flwr.app import ConfigRecord, Message, RecordDict

    from fl_geo.bench.attack_matrix import turned_reply_hook
    from fl_geo.runtime.protocol import PROFILE_KEY, declaration_of
    from fl_geo.runtime.wire import decode

    cfg = tiny()
    msg, reply, sent, local, spec = _model_messages(cfg, flower_style=False)
    hook = turned_reply_hook(cfg, [7], 10.0, "4096-device")
    out = hook(7, msg, reply)
    turned = torch.cat([piece.reshape(-1) for _, piece in decode(out.content.array_records["arrays"], spec, "fp32")])
    assert torch.equal(turned, -10.0 * (sent - local))
    assert declaration_of(out).payload == "pseudo_grad" and out.content.metric_records["metrics"]["tokens"] == 4096 * 1536
    query = Message(RecordDict(), dst_node_id=7, message_type="query")
    answer = Message(RecordDict({PROFILE_KEY: ConfigRecord({"partition_id": 0, "devices": 1})}), reply_to=query)
    assert hook(7, query, answer).content.config_records[PROFILE_KEY]["devices"] == 4096
    honest = turned_reply_hook(cfg, [7], 10.0, "honest")
    assert honest(7, query, answer) is answer
    assert honest(7, msg, reply).content.metric_records["metrics"]["tokens"] == 1536


@pytest.mark.parametrize("kind, refused_by", [("fl-geo", "token cap"), ("plain", "claim bound")])
def test_a_one_cell_matrix_runs_the_honest_defended_and_undefended_runs(kind, refused_by, tmp_path):
    """DiLoCo on the tiny config (3 rounds of H = 6), 1 of 4 sites turned × 10 claiming 2^40: undefended the claim owns
    the mean and the loss leaves the 10 % band; defended every hostile reply is refused (the fl-geo
    site by the token cap, the plain one by the claim bound) and the cell passes."""
    import json

    from fl_geo.bench.attack_matrix import SHORT, format_matrix, run_attack_matrix
    from tests.conftest import tiny_overrides

    # the paper's outer step, as configs/bench/attack_matrix_diloco.yaml
    runs = run_attack_matrix(tiny_overrides("strategy.weighting=tokens", "run.rounds=3", "strategy.inner_steps=6",
                                            "strategy.outer_momentum=0.9",
                                            drop=("run.num_clients",)),
                             methods=["diloco"], sizes=[(1, 4)], scales=[10.0], claims=["2^40"], kinds=[kind],
                             out=tmp_path, config_of=lambda method: None)
    by = {r.setting: r for r in runs}
    assert list(by) == ["honest", "honest robust=cosine", "robust=cosine", "undefended"]
    assert all(r.n == 4 and r.outer_steps == 3 for r in runs)
    defended, undefended = by["robust=cosine"], by["undefended"]
    assert defended.rejected == 3 and defended.reasons == {refused_by: 3} and defended.passed
    assert undefended.rejected == 0 and undefended.ratio > 1.5 and not undefended.passed
    table = format_matrix(runs)
    assert "1 of 1 pass" in table and "(FAIL)" in table
    saved = json.loads((tmp_path / "attack_matrix.json").read_text())
    assert [s["setting"] for s in saved] == list(by) and saved[2]["pass"] is True
    md = (tmp_path / "attack_matrix.md").read_text()
    assert f"| diloco (robust=cosine) | 1 of 4 | {kind} |" in md and f"({SHORT[refused_by]} 3)" in md


@pytest.mark.parametrize("method", ["diloco", "dips", "fedbuff"])
def test_the_matrix_configs_load_for_4_and_8_sites_with_their_rule(method):
    from fl_geo.bench.attack_matrix import ROBUST, matrix_config
    from fl_geo.config import load_config

    for n in (4, 8):
        cfg = load_config(matrix_config(method), [f"run.num_clients={n}", f"strategy.robust={ROBUST[method]}"])
        assert cfg.strategy.name == method and cfg.strategy.weighting == "tokens" and cfg.strategy.token_cap == "job"
        assert cfg.wire.up == cfg.wire.down == "fp32"  # a plain node is sent fp32; the fl-geo one the same bits
        assert (cfg.run.clock == "virtual") == (method != "diloco")


def test_the_matrix_refuses_unknown_cells():
    from fl_geo.bench.attack_matrix import run_attack_matrix
    from fl_geo.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown claim"):
        run_attack_matrix(claims=["2^41"])
    with pytest.raises(ConfigError, match="4 hostile of 4 sites"):
        run_attack_matrix(sizes=[(4, 4)])
