"""Low-quality training batches in bursts (data.noise_*): the sampler's corrupt/clean decisions,
the garbage itself, and the datacenter client reporting how many steps were noisy."""

from __future__ import annotations

import math

import pytest
import torch

from fl_geo.clients.datacenter import app as client_app
from fl_geo.clients.datacenter import make_sampler
from fl_geo.data import BatchNoise, BatchSampler
from fl_geo.inner.training import InnerConfig
from fl_geo.runtime.inline import InlineGrid
from fl_geo.server_app import run_server

VOCAB = 256
SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 100, (5000,), generator=g, dtype=torch.uint8)  # ids < 100: noise is visible


def _sampler(tokens, noise=None, seed=7, stream=1):
    return BatchSampler(tokens, SEQ, BATCH, seed=seed, stream=stream, noise=noise)


def _noise(fraction, kind="random", block=1):
    return BatchNoise(fraction=fraction, kind=kind, block=block, vocab_size=VOCAB)


def _equal(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_clean_samplers_are_bit_identical(tokens):
    plain, zero = _sampler(tokens), _sampler(tokens, _noise(0.0, block=3))
    for step in range(200):
        assert not zero.is_noisy(step) and not plain.is_noisy(step)
        assert _equal(plain.batch(step), zero.batch(step))


def test_noisy_sampler_keeps_the_clean_batches_of_clean_steps(tokens):
    plain, noisy = _sampler(tokens), _sampler(tokens, _noise(0.5))
    clean_steps = [s for s in range(100) if not noisy.is_noisy(s)]
    assert 20 < len(clean_steps) < 80
    for step in clean_steps:
        assert _equal(plain.batch(step), noisy.batch(step))


@pytest.mark.parametrize("kind", ["random", "shuffle"])
def test_deterministic_in_seed_stream_step(tokens, kind):
    a, b = _sampler(tokens, _noise(0.5, kind)), _sampler(tokens, _noise(0.5, kind))
    for step in range(50):
        assert a.is_noisy(step) == b.is_noisy(step)
        assert _equal(a.batch(step), b.batch(step))
    assert _equal(a.batch(13), a.batch(13))  # stateless: order of calls does not matter
    other = _sampler(tokens, _noise(0.5, kind), stream=2)
    decisions = [a.is_noisy(s) for s in range(200)]
    assert decisions != [other.is_noisy(s) for s in range(200)]
    assert decisions != [_sampler(tokens, _noise(0.5, kind), seed=8).is_noisy(s) for s in range(200)]


def test_corrupt_share_matches_fraction(tokens):
    n, p = 2000, 0.3
    sampler = _sampler(tokens, _noise(p, block=4))
    share = sum(sampler.is_noisy(4 * b) for b in range(n)) / n
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma binomial bound
    every = _sampler(tokens, _noise(1.0))
    assert all(every.is_noisy(s) for s in range(500))


def test_blocks_share_one_decision(tokens):
    sampler = _sampler(tokens, _noise(0.5, block=5))
    decisions = [sampler.is_noisy(s) for s in range(500)]
    for b in range(100):
        assert len(set(decisions[5 * b : 5 * b + 5])) == 1, b
    blocks = decisions[::5]
    assert any(blocks) and not all(blocks)
    # the decision of block b does not depend on the block size's phase: it is the rng of b alone
    single = _sampler(tokens, _noise(0.5, block=1))
    assert blocks == [single.is_noisy(b) for b in range(100)]


def test_shuffle_permutes_each_clean_window(tokens):
    clean, noisy = _sampler(tokens), _sampler(tokens, _noise(1.0, "shuffle"))
    changed = False
    for step in range(20):
        cx, cy = clean.batch(step)
        nx, ny = noisy.batch(step)
        assert nx.shape == cx.shape == (BATCH, SEQ) and nx.dtype == torch.long
        assert torch.equal(nx[:, 1:], ny[:, :-1])  # still (input, shifted target) windows
        cw = torch.cat([cx, cy[:, -1:]], dim=1)
        nw = torch.cat([nx, ny[:, -1:]], dim=1)
        assert torch.equal(cw.sort(dim=1).values, nw.sort(dim=1).values)  # same tokens per row
        changed |= not torch.equal(cw, nw)
    assert changed


def test_random_is_uniform_garbage_over_the_vocab(tokens):
    clean, noisy = _sampler(tokens), _sampler(tokens, _noise(1.0, "random"))
    xs = []
    for step in range(20):
        nx, ny = noisy.batch(step)
        cx, _ = clean.batch(step)
        assert nx.shape == (BATCH, SEQ) and nx.dtype == torch.long
        assert torch.equal(nx[:, 1:], ny[:, :-1])
        assert int(nx.min()) >= 0 and int(ny.max()) < VOCAB
        assert not torch.equal(nx, cx)
        xs.append(nx)
    assert int(torch.cat(xs).max()) >= 100  # beyond the clean stream's ids: really over the vocab


def test_bad_noise_settings_are_rejected():
    for kwargs in ({"fraction": 1.5}, {"kind": "zeros"}, {"block": 0}, {"vocab_size": 0}):
        args = {"fraction": 0.5, "kind": "random", "block": 1, "vocab_size": VOCAB, **kwargs}
        with pytest.raises(ValueError):
            BatchNoise(**args)


def test_make_sampler_wires_only_listed_partitions(tokens):
    icfg = InnerConfig(seq_len=SEQ, batch_size=BATCH)
    data = {"seed": 0, "noise_partitions": [1], "noise_fraction": 1.0, "noise_kind": "shuffle", "noise_block": 2}
    noisy = make_sampler(data, tokens, icfg, 1, VOCAB, 3)
    assert noisy.noise == BatchNoise(1.0, "shuffle", 2, VOCAB) and noisy.is_noisy(0)
    assert make_sampler(data, tokens, icfg, 0, VOCAB, 3).noise is None
    assert make_sampler({**data, "noise_fraction": 0.0}, tokens, icfg, 1, VOCAB, 3).noise is None
    old = make_sampler({"seed": 0}, tokens, icfg, 1, VOCAB, 3)  # a data section from before the keys
    assert old.noise is None and _equal(old.batch(5), BatchSampler(tokens, SEQ, BATCH, seed=3, stream=1).batch(5))


def test_client_reports_noisy_steps(tiny, tmp_path):
    cfg = tiny("run.rounds=2", "strategy.inner_steps=3", "data.noise_partitions=[1]", "data.noise_fraction=1.0")
    seen: dict[int, list[int]] = {}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train" and not reply.has_error():
            m = reply.content.metric_records["metrics"]
            seen.setdefault(int(m["partition_id"]), []).append(int(m["noisy_steps"]))
        return reply

    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / "run")
    assert summary["outer_steps"] == 2
    assert seen == {0: [0, 0], 1: [3, 3], 2: [0, 0]}


def test_shared_noise_hits_every_noisy_stream_in_the_same_blocks():
    from fl_geo.data.loader import BatchNoise, BatchSampler

    tokens = torch.arange(5000) % 256
    noise = BatchNoise(fraction=0.3, kind="random", block=5, vocab_size=256, shared=True)
    own = BatchNoise(fraction=0.3, kind="random", block=5, vocab_size=256)
    a, b = (BatchSampler(tokens, 16, 2, seed=3, stream=s, noise=noise) for s in (0, 1))
    decisions_a = [a.is_noisy(t) for t in range(0, 1000, 5)]
    assert decisions_a == [b.is_noisy(t) for t in range(0, 1000, 5)] and any(decisions_a)
    c, d = (BatchSampler(tokens, 16, 2, seed=3, stream=s, noise=own) for s in (0, 1))
    assert [c.is_noisy(t) for t in range(0, 1000, 5)] != [d.is_noisy(t) for t in range(0, 1000, 5)]
