"""Shared fixtures: a tiny but real configuration that runs the whole ServerApp <-> ClientApp path
in about a second (in-process InlineGrid, pydoc corpus, 1-layer model)."""

from __future__ import annotations

import pytest
import torch

from fl_geo.config import FlGeoConfig, load_config

TINY = [
    "run.rounds=2",
    "run.num_clients=3",
    "run.backend=inline",
    "run.tensorboard=false",
    "run.progress=false",
    "run.eval_batches=2",
    "run.sim_cpus=2",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "client.seq_len=32",
    "client.batch_size=4",
    "client.warmup_steps=2",
    "client.eval_batches=2",
    "strategy.inner_steps=3",
    "data.corpus=pydoc",
    "data.partition=iid",
]


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(2)


def tiny_config(*overrides: str) -> FlGeoConfig:
    return load_config(None, [*TINY, *overrides])


@pytest.fixture
def tiny():
    return tiny_config
