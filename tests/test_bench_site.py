"""`fl-geo bench site`'s report and argument checks (the benchmark itself starts processes: run by hand,
docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from fl_geo.bench.site import format_site_bench, main, run_site_bench


def _row(wall: float, steps: float) -> dict[str, float]:
    return {"wall_s": wall, "steps_s": steps, "overhead_s": wall - steps, "tokens_per_s": 2560 / wall,
            "tokens_per_s_steps": 2560 / steps}


def test_report_names_every_path_and_ends_with_the_ratio() -> None:
    result = {
        "setup": {"rounds": 4, "steps": 5, "ranks": 2, "batch_per_rank": 4, "seq_len": 64, "params": 430_000,
                  "device": "cpu", "backend": "gloo", "threads_per_rank": 1},
        "median": {"spawn": _row(4.0, 0.5), "group": _row(0.55, 0.5), "group_fsdp": _row(0.7, 0.6)},
        "group_startup_s": 3.9,
        "peak_rss_mib": {"spawn_largest_rank": 360.0, "ddp": [370.0, 371.0], "fsdp": [365.0, 366.0]},
        "peak_device_mib": {"ddp": [], "fsdp": []},
        "max_param_diff": 0.0, "max_param_diff_fsdp": 3e-8, "overhead_ratio": 70.0, "pass": True,
    }
    text = format_site_bench(result)
    assert "spawn per message" in text and "persistent group, FSDP" in text and "group FSDP 365, 366 MiB" in text
    assert text.splitlines()[-1] == "70.0x less per-round overhead (target >= 5x: PASS)"


def test_bad_arguments_are_refused_before_any_process_starts(capsys) -> None:
    with pytest.raises(ValueError, match="rounds >= 2"):
        run_site_bench(rounds=1)
    with pytest.raises(ValueError, match="parallels must include ddp"):
        run_site_bench(parallels=("fsdp",))
    with pytest.raises(SystemExit):
        main(["--ranks", "0"])
    assert "ranks >= 1" in capsys.readouterr().err
