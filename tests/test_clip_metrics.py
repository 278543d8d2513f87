"""How hard the penalty's clip φ binds is logged per outer step (``outer/clip_*``).

Why: whether Di-PS's φ = 1 or EDiT's φ = 10 binds depends on the model's scale (the scale ladder in
docs/benchmarks.md), and the clip factor is not recoverable from the other metrics.
"""

from __future__ import annotations

import math

import pytest

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server

VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4", "wire.up=bf16"]
DIPS = ["strategy.name=dips", "penalty.enabled=true", "penalty.rule=relative_max", "penalty.keying=pooled",
        "penalty.warmup=2", "penalty.clip_mode=absolute"]  # φ as given (the default is relative)
EPS = 1e-6  # Penalty's ε of the clip


def _rows(cfg, tmp_path, name):
    run_server(InlineGrid(client_app, cfg.run.num_clients, seed=0), cfg, tmp_path / name)
    return [r for r in read_metrics(tmp_path / name)[1:] if "outer/accepted" in r]


@pytest.mark.parametrize("phi", [0.05, 1e6])
def test_dips_logs_the_clip_factor_it_applied(tiny, tmp_path, phi):
    """Where a Di-PS step folded one update, Δ̄ is that update, so the logged pre-clip norm is
    the update's own norm; on every step the factor is min(1, φ/(‖Δ̄‖+ε)) of the logged norm."""
    rows = _rows(tiny(*VIRTUAL, *DIPS, f"penalty.clip={phi}", "run.rounds=4"), tmp_path, "dips")
    assert len(rows) == 4
    singles = [r for r in rows if r["outer/accepted"] == 1]
    assert singles, "the scenario should give single-update steps"
    for r in singles:
        assert r["outer/clip_norm"] == pytest.approx(r["outer/update_norm"], rel=1e-5)
    for r in rows:
        expected = min(1.0, phi / (r["outer/clip_norm"] + EPS))
        assert r["outer/clip_scale"] == pytest.approx(expected, rel=1e-5)
        assert r["outer/clip_bound"] == (1.0 if expected < 1.0 else 0.0)
    if phi < 1:  # the tiny model's updates are far longer than 0.05: every step is cut
        assert all(r["outer/clip_scale"] < 1 for r in rows)


def test_module_clip_logs_the_mean_factor_and_the_share_that_bound(tiny, tmp_path):
    """EDiT-style per-module clip in the synchronous loop: the scale is the mean of the modules'
    factors, each in (0, 1], and the bound share counts the factors below 1; no clip, no metric."""
    edit = ["strategy.name=edit", "penalty.enabled=true", "penalty.granularity=module", "penalty.warmup=0",
            "penalty.clip_mode=absolute"]
    rows = _rows(tiny(*edit, "penalty.clip=0.05", "run.rounds=2"), tmp_path, "edit")
    n_modules = 3  # embed, blocks.0, norm of the 1-layer tiny decoder
    for r in rows:
        assert 0 < r["outer/clip_scale"] <= 1
        assert r["outer/clip_bound"] * n_modules == pytest.approx(round(r["outer/clip_bound"] * n_modules))
        assert r["outer/clip_norm"] == pytest.approx(r["outer/pseudo_grad_norm"], rel=1e-6)
    assert any(r["outer/clip_scale"] < 1 for r in rows)
    plain = _rows(tiny(*edit, "penalty.clip=0", "run.rounds=1"), tmp_path, "noclip")
    assert plain and all("outer/clip_scale" not in r for r in plain)
    assert all(math.isfinite(r["outer/pseudo_grad_norm"]) for r in plain)
