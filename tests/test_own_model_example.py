"""examples/own-model: a Flower user's own app (its own GRU language model, fl-geo's DiPS strategy
and client wrapper) runs under Flower's own CLI, `flwr run`, in simulation, and learns."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

# Starts Ray (and checks that none of its processes outlive a run): one at a time across `make test`'s workers.
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(seconds=41)
def test_own_model_example_runs_under_flwr_run(tmp_path):
    # one Ray actor (FLWR_SIM_CPUS=1): each costs ~12 CPU-s to start, and the claim is the app, not parallel actors
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr-home"), FLWR_APP_DIR="examples/own-model", FLWR_SIM_CPUS="1")
    proc = subprocess.run(
        [str(ROOT / "examples" / "flwr_run.sh"), "--run-config", "num-server-rounds=3 inner-steps=10"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    found = re.search(r"own-model: held-out loss ([\d.]+) -> ([\d.]+) after (\d+) Di-PS steps, (\d+) rejected", out)
    assert found, out[-3000:]
    first, last, steps, rejected = float(found[1]), float(found[2]), int(found[3]), int(found[4])
    assert steps == 3 and rejected == 0 and last < first - 0.3, found[0]
    for _ in range(50):  # the script's trap stops the detached local SuperLink
        left = subprocess.run(["pgrep", "-f", f"flower-superlink.*{tmp_path}"], capture_output=True, text=True).stdout
        if not left.strip():
            break
        time.sleep(0.2)
    assert not left.strip(), "the local SuperLink was left running"
