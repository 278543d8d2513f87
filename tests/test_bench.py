"""Smoke run of the outer-step benchmark at a tiny size, in-process (well under 5 s)."""

from __future__ import annotations

import pytest

from fl_geo.bench.command import main
from fl_geo.bench.outer import format_outer_bench, llama_spec, run_outer_bench


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
