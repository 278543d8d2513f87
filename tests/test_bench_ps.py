"""`fl-geo bench ps` on a small model: the figures it reports are there and consistent."""

from __future__ import annotations

from fl_geo.bench.ps import format_ps_bench, run_ps_bench, synthetic_spec
from fl_geo.core.shards import ShardPlan


def test_synthetic_spec_is_llm_shaped_and_shardable():
    spec = synthetic_spec(300_000_000)
    assert abs(spec.numel - 300_000_000) / 300_000_000 < 0.01
    plan = ShardPlan.build(spec, 4)
    sizes = [s.numel for s in plan.shards]
    assert max(sizes) / min(sizes) < 1.3


def test_small_bench_runs_and_reports_every_figure(tmp_path):
    result = run_ps_bench(num_params=400_000, followers=(1, 2), clients=2, steps=1, flower_mib=0, workdir=tmp_path)
    rows = {r["followers"]: r for r in result["rows"]}
    assert set(rows) == {1, 2}
    for f, r in rows.items():
        assert len(r["follower_peak_rss_mib"]) == f and all(x > 0 for x in r["follower_peak_rss_mib"])
        assert r["bytes_per_step"] == 2 * 2 * result["num_params"] * 2  # 2 clients, pull + push, bf16
        assert r["pull_mb_s"] > 0 and r["push_mb_s"] > 0 and len(r["step_s"]) == 1
    text = format_ps_bench(result)
    assert "| 2 |" in text and "idle follower" in text
    assert not list(tmp_path.glob("fl-geo-bench-ps-*"))  # cleaned up
