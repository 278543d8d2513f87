"""The laptop quickstart through the Python API: DiLoCo vs FedAvg on 4 simulated datacenters.

    .venv/bin/python examples/quickstart.py [key=value ...]

Same as `make quickstart` (which uses the `fl-geo run` CLI); shown here for scripting sweeps.
Overrides apply to both runs, e.g. `run.rounds=4 wire.up=bf16 run.backend=inline`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fl_geo.cli import format_summary_table
from fl_geo.config import load_config
from fl_geo.simulation import run_simulation

ROOT = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    summaries = []
    for name in ("quickstart_diloco", "quickstart_fedavg"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", overrides)
        summaries.append(run_simulation(cfg, ROOT / "runs" / "quickstart-py" / cfg.run.name))
    print(format_summary_table(summaries))


if __name__ == "__main__":
    main(sys.argv[1:])
