"""`fl-geo bench gpu` on this CPU machine: the peak table and override, the MFU and round-planning
arithmetic, the command's refusals, and the whole code path with a tiny model (`--device cpu
--tiny`), so the ten-minute GPU run fails only for GPU reasons."""

from __future__ import annotations

import pytest
import torch

from fl_geo.bench.command import main as bench_main
from fl_geo.bench.gpu import (
    OVERHEAD,
    PEAK_BF16_TFLOPS,
    mfu,
    peak_tflops,
    plan_rounds,
    run_gpu_bench,
)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_peak_by_device_name(name, peak):
    assert peak_tflops(name) == peak


def test_peak_override_and_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", 500.0) == 500.0
    with pytest.raises(ValueError, match="--peak-tflops"):
        peak_tflops("x", 0.0)
    assert {"H100", "H200", "A100"} <= set(PEAK_BF16_TFLOPS)


def test_mfu_is_six_n_tokens_over_peak():
    assert mfu(70_000_000, 1_000_000, 989.0) == pytest.approx(6 * 70e6 * 1e6 / 989e12)
    assert mfu(10, 10, None) is None


def test_plan_rounds_fills_the_budget():
    # 4 clients x 50 steps x 0.02 s x OVERHEAD per round
    assert plan_rounds(300.0, 4, 50, 0.02) == int(300 / (4 * 50 * 0.02 * OVERHEAD)) > 2
    assert plan_rounds(1.0, 4, 50, 1.0) == 2  # never fewer than two rounds
    with pytest.raises(ValueError):
        plan_rounds(10.0, 4, 50, 0.0)


def test_command_refuses_cuda_without_a_gpu_and_bad_minutes(capsys):
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            bench_main(["gpu"])
        assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench_main(["gpu", "--device", "cpu", "--minutes", "0"])
    assert exc.value.code == 2 and "--minutes" in capsys.readouterr().err


def test_tiny_cpu_run_of_the_whole_path(tmp_path):
    torch.set_num_threads(1)
    got = run_gpu_bench(minutes=0.5, device="cpu", tiny=True, peak=1.0, out_dir=tmp_path)
    assert got["rounds"] == 2 and got["clients"] == 4
    assert got["max_tokens"] == 4 * 3 * 2 * 4 * 32  # clients x H x rounds x batch x seq
    for name in ("diloco", "dips"):
        m = got["methods"][name]
        assert m["tokens"] == got["max_tokens"]  # the same token budget for both methods
        assert m["train_tokens_per_s"] > 0 and m["e2e_tokens_per_s"] > 0
        assert m["mfu_train"] == pytest.approx(6 * m["num_params"] * m["train_tokens_per_s"] / 1e12)
        assert m["final_val_loss"] is not None and m["virtual_s"] > 0
    assert got["outer_step_s"] > 0
    assert (tmp_path / "dips" / "metrics.jsonl").exists()
