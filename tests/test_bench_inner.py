"""`fl-geo bench inner`: the share arithmetic on hand-made metrics, the slot count, the breakdown,
the loop comparison on a tiny model (the plain loop must train exactly as the inner loop does), a
tiny inline simulation through the whole share path, and the command's options."""

from __future__ import annotations

import statistics

import pytest

from fl_geo.bench.command import main as bench_main
from fl_geo.bench.inner import TINY, breakdown, loop_bench, share_from_metrics, sim_share, slots_of
from tests.conftest import tiny_config


def _records() -> list[dict]:
    # step 0: initial evaluation after start-up; rounds 1..3: 4 clients x H=10 steps
    return [
        {"step": 0, "time/wall_s": 5.0, "val/loss": 5.5},
        {"step": 1, "time/wall_s": 20.0, "outer/accepted": 4.0, "train/inner_steps": 10.0,
         "train/step_time_s": 0.5, "val/loss": 3.0},
        {"step": 2, "time/wall_s": 32.0, "outer/accepted": 4.0, "train/inner_steps": 10.0,
         "train/step_time_s": 0.5, "val/loss": 2.8},
        {"step": 3, "time/wall_s": 43.0, "outer/accepted": 3.0, "train/inner_steps": 10.0,
         "train/step_time_s": 0.6},
    ]


def test_share_skips_start_up_and_divides_by_slots():
    got = share_from_metrics(_records(), slots=2)
    assert got["rounds"] == [2, 3]
    assert got["wall_s"] == pytest.approx((32 - 20) + (43 - 32))
    train = 4 * 10 * 0.5 + 3 * 10 * 0.6
    assert got["train_client_s"] == pytest.approx(train)
    assert got["share"] == pytest.approx(train / (2 * 23.0))
    assert got["evals"] == 1 and got["clients"] == [4.0, 3.0]
    with_start = share_from_metrics(_records(), slots=2, skip_rounds=0)
    assert with_start["rounds"] == [1, 2, 3] and with_start["wall_s"] == pytest.approx(38.0)


def test_share_needs_rounds_after_start_up_and_slots():
    with pytest.raises(ValueError, match="no round after the first 3"):
        share_from_metrics(_records(), slots=1, skip_rounds=3)
    with pytest.raises(ValueError, match="slots"):
        share_from_metrics(_records(), slots=0)


def test_breakdown_adds_up_to_the_wall_time():
    share = share_from_metrics(_records(), slots=2)
    costs = {"eval": 0.4, "encode_down": 0.01, "aggregate": 0.05, "client_decode": 0.02,
             "client_encode": 0.03, "client_setup": 0.1}
    parts = breakdown(share, costs)
    assert sum(parts.values()) == pytest.approx(share["wall_s"])
    assert parts["inner training"] == pytest.approx(share["train_client_s"] / 2)
    assert parts["server evaluation"] == pytest.approx(1 * 0.4)
    assert parts["server aggregation + broadcast encode"] == pytest.approx(2 * 0.06)
    assert parts["client encode/decode"] == pytest.approx(7 * 0.05 / 2)
    assert parts["client set-up (optimizer, state in/out)"] == pytest.approx(7 * 0.1 / 2)


def test_slots_follow_backend_cpus_and_client_cpus():
    assert slots_of(tiny_config("run.backend=inline")) == 1
    assert slots_of(tiny_config("run.backend=ray", "run.sim_cpus=2", "run.num_clients=4")) == 2
    assert slots_of(tiny_config("run.backend=ray", "run.sim_cpus=4", "run.client_cpus=2", "run.num_clients=4")) == 2
    assert slots_of(tiny_config("run.backend=ray", "run.sim_cpus=8", "run.num_clients=3")) == 3
    with pytest.raises(ValueError, match="run.ray_address"):
        slots_of(tiny_config("run.backend=ray", "run.ray_address=10.0.0.1:6379"))


def test_loop_bench_trains_both_loops_identically():
    cfg = tiny_config(*TINY)
    got = loop_bench(cfg, steps=3, repeats=3, warmup=1, device="cpu", threads=1)
    # the plain loop is the same computation: same weights, batches, optimizer, schedule, clip
    assert got["max_loss_diff"] == 0.0
    pairs = [a / b for a, b in zip(got["tokens_per_s"]["fl-geo"], got["tokens_per_s"]["plain"], strict=True)]
    assert got["ratio_wall"] == pytest.approx(statistics.median(pairs))
    cpu = [a / b for a, b in zip(got["tokens_per_cpu_s"]["fl-geo"], got["tokens_per_cpu_s"]["plain"], strict=True)]
    assert got["basis"] == "cpu" and got["ratio"] == pytest.approx(statistics.median(cpu))
    assert got["median"]["plain"] == pytest.approx(statistics.median(got["tokens_per_s"]["plain"]))
    assert got["pass"] == (got["ratio"] >= 0.95)
    with pytest.raises(ValueError, match="steps >= 1"):
        loop_bench(cfg, steps=0)


def test_loop_bench_with_muon_matches_a_plain_torch_muon_loop():
    """client.optimizer=muon: the plain loop is torch's Muon and AdamW side by side, written by
    hand; the inner loop's `MuonAdamW` must train exactly as it does."""
    got = loop_bench(tiny_config(*TINY, "client.optimizer=muon"), steps=2, repeats=1, warmup=1, device="cpu", threads=1)
    assert got["max_loss_diff"] == 0.0


def test_sim_share_on_a_tiny_inline_run():
    cfg = tiny_config(*TINY, "run.backend=inline", "run.rounds=3", "run.num_clients=2")
    got = sim_share(cfg)
    assert got["rounds"] == [2, 3] and got["slots"] == 1
    assert 0 < got["share"] <= 1.0
    assert sum(got["breakdown"].values()) == pytest.approx(got["wall_s"])
    with pytest.raises(ValueError, match="run.rounds >= 2"):
        sim_share(tiny_config(*TINY, "run.rounds=1"))


def test_command_runs_the_loop_and_rejects_bad_config(capsys):
    assert bench_main(["inner", "--tiny", "--no-sim", "--steps", "2", "--repeats", "2", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "fl-geo InnerTrainer.train" in out and "plain torch loop" in out and "ratio" in out
    with pytest.raises(SystemExit) as exc:
        bench_main(["inner", "--tiny", "--no-sim", "run.num_clients=0"])
    assert exc.value.code == 2
    assert "run.num_clients" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # overrides without a config file: the quickstart's
        bench_main(["inner", "--tiny", "run.backend=ray", "run.ray_address=10.0.0.1:6379"])
    assert exc.value.code == 2 and "drop run.ray_address" in capsys.readouterr().err
