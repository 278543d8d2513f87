"""The synchronous outer loop end to end: real ServerApp logic, real ClientApp handlers, real
Flower Messages and Contexts, on the in-process InlineGrid (no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord

from fl_geo.clients.datacenter import OPT_STATE_KEY, PROGRESS_KEY
from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.server_app import run_server
from tests.conftest import fail_train_on, keep_declaration, site_reply_hook


def _run(cfg, tmp_path, name="run", hook=None, grid=None):
    grid = grid or InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    final = torch.load(tmp_path / name / "final_model.pt")["params"]
    return summary, final, grid


def _initial_params(cfg):
    from fl_geo.core.state import flatten
    from fl_geo.runtime.builders import make_model

    return flatten(make_model(cfg.model, cfg.run.seed).state_dict())


def test_diloco_trains_and_logs(tiny, tmp_path):
    cfg = tiny("run.rounds=3", "strategy.inner_steps=5")
    summary, final, grid = _run(cfg, tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 3
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.1  # it learns
    for key in ("train/loss", "outer/step", "outer/rejected", "comm/bytes_up", "comm/bytes_down", "time/wall_s", "val/ppl"):
        assert key in rows[-1], key
    assert summary["outer_steps"] == 3 and summary["rejected"] == 0
    assert summary["tokens"] == 3 * 3 * 5 * 4 * 32  # rounds * clients * H * batch * seq
    from fl_geo.core.state import ParamSpec
    from fl_geo.runtime.wire import encode, payload_nbytes

    one = payload_nbytes(encode(final, ParamSpec.from_json(torch.load(tmp_path / "run" / "final_model.pt")["spec"]), "fp32"))
    assert final.numel() * 4 <= one < final.numel() * 4 + 2048  # fp32 data + small npy headers
    assert summary["bytes_up"] == 3 * 3 * one
    assert not torch.equal(final, _initial_params(cfg))
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["corpus"] == "pydoc" and len(meta["corpus_sha256"]) == 64
    # the machine a result came from: what can change its bits for the same seed
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and meta["machine"]
    assert meta["torch_threads"] == torch.get_num_threads() and isinstance(meta["cpu"], str)


def test_inner_state_persists_across_rounds(tiny, tmp_path):
    cfg = tiny("run.rounds=2", "strategy.inner_steps=4")
    _, _, grid = _run(cfg, tmp_path)
    for ctx in grid.contexts.values():
        assert OPT_STATE_KEY in ctx.state.array_records
        prog = ctx.state.config_records[PROGRESS_KEY]
        assert int(prog["step"]) == 8 and int(prog["rounds"]) == 2
        steps = [a.numpy() for k, a in ctx.state.array_records[OPT_STATE_KEY].items() if k.endswith("step")]
        assert steps and all(float(s) == 8 for s in steps)


def test_same_seed_same_model_bit_for_bit(tiny, tmp_path):
    cfg = tiny()
    _, a, _ = _run(cfg, tmp_path, "a")
    _, b, _ = _run(cfg, tmp_path, "b")
    assert torch.equal(a, b)
    _, c, _ = _run(tiny("run.seed=1"), tmp_path, "c")
    assert not torch.equal(a, c)


def test_diloco_with_unit_lr_no_momentum_equals_fedavg(tiny, tmp_path):
    _, diloco, _ = _run(tiny("strategy.outer_lr=1.0", "strategy.outer_momentum=0.0"), tmp_path, "d")
    _, fedavg, _ = _run(tiny("strategy.name=fedavg"), tmp_path, "f")
    assert torch.equal(diloco, fedavg)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_fl_baselines_run_through_the_same_loop(tiny, tmp_path, name):
    summary, final, _ = _run(tiny(f"strategy.name={name}"), tmp_path, name)
    assert summary["outer_optimizer"] == name if name != "fedavgm" else summary["outer_optimizer"] == "sgdm"
    assert torch.isfinite(final).all() and summary["outer_steps"] == 2


def test_bf16_uplink_halves_bytes_and_still_trains(tiny, tmp_path):
    s32, _, _ = _run(tiny(), tmp_path, "fp32")
    s16, final, _ = _run(tiny("wire.up=bf16"), tmp_path, "bf16")
    assert 0.49 < s16["bytes_up"] / s32["bytes_up"] < 0.52  # half the data; npy headers are fixed
    assert s16["rejected"] == 0 and torch.isfinite(final).all()


# ---- bad input: a logged rejection, the global model untouched --------------------------------

def _tamper(kind: str):
    def corrupt(record: ArrayRecord) -> ArrayRecord:
        items = dict(record.items())
        key = next(iter(items))
        arr = items[key].numpy().copy()
        if kind == "nan":
            arr.reshape(-1)[0] = np.nan
        elif kind == "inf":
            arr.reshape(-1)[-1] = -np.inf
        elif kind == "shape":
            arr = arr.reshape(-1)[:-1]
        elif kind == "dtype":
            arr = arr.astype(np.float64)
        elif kind == "missing":
            items.pop(key)
            return ArrayRecord(items)
        elif kind == "extra":
            items["evil"] = Array(np.zeros(3, dtype=np.float32))
            return ArrayRecord(items)
        elif kind == "scaled":  # finite and well-shaped, but x1e6: the norm bound catches it
            return ArrayRecord({k: Array(a.numpy() * np.float32(1e6)) for k, a in items.items()})
        elif kind == "oversized":
            arr = np.zeros(arr.size * 1000, dtype=np.float32)
        elif kind == "lying":  # the Array's shape field is right, its bytes hold 1000x more
            big = Array(np.zeros(arr.size * 1000, dtype=np.float32))
            items[key] = Array(dtype=big.dtype, shape=tuple(arr.shape), stype=big.stype, data=big.data)
            return ArrayRecord(items)
        items[key] = Array(arr)
        return ArrayRecord(items)

    return corrupt


def _hook_all(kind):
    corrupt = _tamper(kind)

    def hook(node, msg, reply):
        if reply.has_error() or msg.metadata.message_type != "train":
            return reply
        content = keep_declaration(reply, {"arrays": corrupt(reply.content.array_records["arrays"]), "metrics": reply.content.metric_records["metrics"]})
        return Message(content, reply_to=msg)

    return hook


@pytest.mark.parametrize("kind", ["nan", "inf", "shape", "dtype", "missing", "extra", "scaled", "oversized", "lying"])
def test_bad_payloads_are_rejected_and_model_untouched(tiny, tmp_path, kind, caplog):
    cfg = tiny("run.rounds=1")
    caplog.set_level("WARNING", logger="fl_geo")
    summary, final, _ = _run(cfg, tmp_path, kind, hook=_hook_all(kind))
    assert summary["rejected"] == 3 and summary["outer_steps"] == 0
    assert torch.equal(final, _initial_params(cfg))  # bit-identical: nothing was folded
    assert "rejected update from node" in caplog.text


def test_one_bad_node_is_dropped_the_others_step(tiny, tmp_path):
    bad = {}

    def hook(node, msg, reply):
        bad.setdefault("node", node)
        if node == bad["node"] and msg.metadata.message_type == "train":
            return _hook_all("nan")(node, msg, reply)
        return reply

    summary, final, _ = _run(tiny(), tmp_path, hook=hook)
    assert summary["rejected"] == 2 and summary["outer_steps"] == 2  # one per round
    assert torch.isfinite(final).all()


def test_missing_metrics_and_error_replies(tiny, tmp_path):
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train":
            return reply
        if node % 3 == 0:
            return Message(Error(code=300, reason="boom"), reply_to=msg)
        if node % 3 == 1:
            metrics = MetricRecord({"tokens": 10})  # lacks train_loss etc.
            return Message(keep_declaration(reply, {"arrays": reply.content.array_records["arrays"], "metrics": metrics}), reply_to=msg)
        return reply

    summary, final, _ = _run(tiny(), tmp_path, hook=hook)
    assert torch.isfinite(final).all()
    assert summary["rejected"] >= 1


def test_client_exception_becomes_error_reply_not_a_crash(tiny, tmp_path):
    """A ClientApp that raises in its train handler: an error reply, counted in ``outer/failed``
    each round, and the rounds step on the others' updates exactly as without that node's jobs."""
    cfg = tiny("run.rounds=2")
    grid = InlineGrid(client_app, 3, seed=0)
    fail_train_on(grid, sorted(grid.contexts)[2], "out of memory on the site's accelerator")
    summary, final, _ = _run(cfg, tmp_path, grid=grid)
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["outer/failed"] for r in rows] == [1, 1] and [r["outer/accepted"] for r in rows] == [2, 2]
    assert summary["outer_steps"] == 2 and summary["rejected"] == 0
    _, dropped, _ = _run(cfg, tmp_path, "dropped", hook=site_reply_hook(2, tokens=float("nan")))  # same node, refused
    assert torch.equal(final, dropped)


def test_vanished_node_does_not_stall_the_round(tiny, tmp_path):
    cfg = tiny("run.rounds=3")
    grid = InlineGrid(client_app, 3, seed=0)
    victim = sorted(grid.contexts)[1]
    state = {"n": 0}

    def hook(node, msg, reply):
        if msg.metadata.message_type == "train":
            state["n"] += 1
            if state["n"] == 4:  # first job of round 2 done: the victim dies before running its job
                grid.remove_node(victim)
        return reply

    summary, final, _ = _run(cfg, tmp_path, hook=hook, grid=grid)
    assert summary["outer_steps"] == 3
    rows = read_metrics(tmp_path / "run")
    assert [r["outer/accepted"] for r in rows[1:]] == [3, 2, 2]


def test_client_side_evaluation(tiny, tmp_path):
    _run(tiny("run.client_eval_every=1"), tmp_path)
    rows = read_metrics(tmp_path / "run")
    assert all("val/client_loss" in r for r in rows[1:])


@pytest.mark.parametrize("lie, reason", [({"val_tokens": float("nan")}, "metric 'val_tokens' is nan"),
                                         ({"val_loss": [1.0]}, "metric 'val_loss' must be a number"),
                                         ({"val_tokens": 0}, "val_tokens=0, must be a whole number >= 1")])
def test_a_lying_evaluate_reply_is_skipped_and_the_others_still_count(tiny, tmp_path, lie, reason, caplog):
    """One site's evaluate reply lies: it is left out of ``val/client_loss`` (the token-weighted
    mean of the two others, exactly), never a crash (before: ``int(nan)`` ended the run)."""
    def hook(node, msg, reply):
        if msg.metadata.message_type != "evaluate" or reply.has_error():
            return reply
        metrics = dict(reply.content.metric_records["metrics"])
        seen.setdefault(node, []).append((metrics["val_loss"], metrics["val_tokens"]))
        if node != victim:
            return reply
        return Message(keep_declaration(reply, {"metrics": MetricRecord({**metrics, **lie})}), reply_to=msg)

    caplog.set_level("WARNING", logger="fl_geo")
    grid = InlineGrid(client_app, 3, seed=0)
    victim, seen = sorted(grid.contexts)[0], {}
    _run(tiny("run.client_eval_every=1", "run.rounds=1"), tmp_path, grid=grid, hook=hook)
    last = read_metrics(tmp_path / "run")[-1]
    honest = [seen[n][-1] for n in sorted(seen) if n != victim]
    assert last["val/client_loss"] == pytest.approx(sum(v * t for v, t in honest) / sum(t for _, t in honest), rel=1e-12)
    assert reason in caplog.text


def test_max_tokens_ends_a_synchronous_run_after_the_round_that_reaches_it(tiny, tmp_path):
    per_round = 3 * 3 * 4 * 32  # clients * H * batch * seq
    cfg = tiny("run.rounds=10", f"run.max_tokens={2 * per_round - 1}")
    summary, _, _ = _run(cfg, tmp_path)
    assert summary["outer_steps"] == 2 and summary["tokens"] == 2 * per_round
    assert "val/loss" in read_metrics(tmp_path / "run")[-1]  # the last round is evaluated


@pytest.mark.parametrize("claimed", [5, -1])
def test_reply_for_another_model_version_is_rejected(tiny, tmp_path, claimed, caplog):
    """A reply claiming a base version from the future (or a stale one) is refused."""
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        metrics = MetricRecord(dict(reply.content.metric_records["metrics"], base_version=claimed))
        return Message(keep_declaration(reply, {"arrays": reply.content.array_records["arrays"], "metrics": metrics}), reply_to=msg)

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny("run.rounds=1")
    summary, final, _ = _run(cfg, tmp_path, hook=hook)
    assert summary["rejected"] == 3 and torch.equal(final, _initial_params(cfg))
    assert "from the future" in caplog.text


# One lying metric per case (tiny's H = 3): each is a logged, counted rejection, never a crash.
LYING_METRICS = {
    "tokens NaN": ({"tokens": float("nan")}, "metric 'tokens' is nan"),
    "tokens fractional": ({"tokens": 2.5}, "tokens=2.5, must be a whole number >= 1"),
    "tokens a list": ({"tokens": [1.0, 2.0]}, "metric 'tokens' must be a number"),
    "steps beyond the job": ({"steps": 1_000_000}, "steps=1000000, must be a whole number [1, 3]"),
    "noisy beyond steps": ({"noisy_steps": 7}, "noisy_steps=7, must be a whole number [0, 3]"),
    "loss inf": ({"train_loss": float("inf")}, "metric 'train_loss' is inf"),
    "step time negative": ({"step_time_s": -1.0}, "step_time_s=-1.0, must be in [0, 3600]"),
    "step time NaN": ({"step_time_s": float("nan")}, "metric 'step_time_s' is nan"),
    "step time over an hour": ({"step_time_s": 3600.5}, "step_time_s=3600.5, must be in [0, 3600]"),
    "base version NaN": ({"base_version": float("nan")}, "metric 'base_version' is nan"),
    "base version missing": ({"base_version": None}, "reply metrics lack 'base_version'"),
    # tiny: H 3 x batch 4 x seq_len 32 x 1 device = 384 tokens at most
    "tokens beyond the job": ({"tokens": 2**40}, "tokens=1099511627776 is more than 3 steps can produce (128 per step"),
}


@pytest.mark.parametrize("case", sorted(LYING_METRICS))
def test_lying_reply_metrics_are_rejected_and_model_untouched(tiny, tmp_path, case, caplog):
    lie, reason = LYING_METRICS[case]

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        merged = {**dict(reply.content.metric_records["metrics"]), **lie}
        metrics = MetricRecord({k: v for k, v in merged.items() if v is not None})  # None: the key is left out
        return Message(keep_declaration(reply, {"arrays": reply.content.array_records["arrays"], "metrics": metrics}), reply_to=msg)

    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny("run.rounds=1")
    summary, final, _ = _run(cfg, tmp_path, hook=hook)
    assert summary["rejected"] == 3 and summary["outer_steps"] == 0 and summary["tokens"] == 0
    assert torch.equal(final, _initial_params(cfg))  # bit-identical: nothing was folded
    assert caplog.text.count(reason) == 3, caplog.text[-2000:]


def test_scaled_update_rejected_alone_others_fold_bit_identically(tiny, tmp_path):
    """One x1e6 update among good ones: the others fold exactly as if it had never come."""
    bad = {}

    def scale_one(node, msg, reply):
        if msg.metadata.message_type == "train":
            bad.setdefault("node", node)
            if node == bad["node"]:
                return _hook_all("scaled")(node, msg, reply)
        return reply

    def drop_one(node, msg, reply):  # the same node's reply never counts
        if msg.metadata.message_type == "train":
            bad.setdefault("node", node)
            if node == bad["node"]:
                return _hook_all("nan")(node, msg, reply)
        return reply

    cfg = tiny("run.rounds=2")
    s1, f1, _ = _run(cfg, tmp_path, "scaled", hook=scale_one)
    bad.clear()
    s2, f2, _ = _run(cfg, tmp_path, "nan", hook=drop_one)
    assert s1["rejected"] == s2["rejected"] == 2
    assert torch.equal(f1, f2)


def test_a_huge_token_claim_is_refused_so_it_neither_owns_the_mean_nor_ends_the_budget(tiny, tmp_path, caplog):
    """Token-weighted DiLoCo with run.max_tokens: one site claims 2^40 tokens each round. With the
    job's token cap it is rejected every round, the run does all its rounds (the budget counts
    accepted tokens only) and the model is the one the two honest sites give alone. With the cap
    off the claim is believed: that site owns the mean and the budget ends the run after a round."""
    caplog.set_level("WARNING", logger="fl_geo")
    honest_total = 3 * 2 * 3 * 4 * 32  # rounds x honest sites x H x batch x seq_len
    cfg = tiny("run.rounds=3", "strategy.weighting=tokens", f"run.max_tokens={honest_total + 1}")
    capped, final, _ = _run(cfg, tmp_path, "capped", hook=site_reply_hook(0, tokens=2**40))
    assert capped["outer_steps"] == 3 and capped["rejected"] == 3 and capped["tokens"] == honest_total
    assert caplog.text.count("is more than 3 steps can produce") == 3
    _, without, _ = _run(cfg, tmp_path, "without", hook=site_reply_hook(0, tokens=float("nan")))  # the same site's reply never counts
    assert torch.equal(final, without)
    trusted, _, _ = _run(tiny("run.rounds=3", "strategy.weighting=tokens", f"run.max_tokens={honest_total + 1}",
                              "strategy.token_cap=none"), tmp_path, "trusted", hook=site_reply_hook(0, tokens=2**40))
    assert trusted["rejected"] == 0 and trusted["outer_steps"] == 1  # the claim ended the token budget


def _devices_claim_hook(devices: int, *, tokens: int):
    """Reply hook: the site of partition 0 says in its profile (its ``query`` answer) that it has
    ``devices`` devices, and its train replies claim ``tokens`` tokens."""
    from flwr.app import ConfigRecord

    from fl_geo.runtime.protocol import PROFILE_KEY

    claims = site_reply_hook(0, tokens=tokens)

    def hook(node, msg, reply):
        if msg.metadata.message_type == "query" and not reply.has_error():
            profile = dict(reply.content.config_records[PROFILE_KEY])
            if profile["partition_id"] == 0:
                profile["devices"] = devices
            return Message(keep_declaration(reply, {PROFILE_KEY: ConfigRecord(profile)}), reply_to=msg)
        return claims(node, msg, reply)

    return hook


def test_a_site_with_more_devices_may_claim_more_tokens(tiny, tmp_path):
    """The cap follows the devices a site declares in its profile (node config ``devices``), up to
    what the server's operator allows a site (``strategy.site_devices``)."""
    devices = _devices_claim_hook(2, tokens=2 * 3 * 4 * 32)  # twice what one device gives in H = 3 steps
    summary, _, _ = _run(tiny("run.rounds=1", "strategy.site_devices=2"), tmp_path, hook=devices)
    assert summary["rejected"] == 0
    # without the operator's allowance the profile's claim cannot raise the cap
    summary, _, _ = _run(tiny("run.rounds=1"), tmp_path, "unallowed", hook=devices)
    assert summary["rejected"] == 1
    summary, _, _ = _run(tiny("run.rounds=1"), tmp_path, "one", hook=site_reply_hook(0, tokens=2 * 3 * 4 * 32))
    assert summary["rejected"] == 1


def test_a_profile_claiming_4096_devices_cannot_own_the_token_weighted_mean(tiny, tmp_path):
    """Issue 26: the devices come from the operator (``strategy.site_devices``), not from the
    site's profile. A site whose profile says 4096 devices and whose replies claim 4096 × the
    tokens of one device is refused every round; the model is the one without that site."""
    liar = _devices_claim_hook(4096, tokens=4096 * 3 * 4 * 32)  # 4096 devices' worth of H = 3 steps of 4 x 32 tokens

    cfg = tiny("run.rounds=2", "strategy.weighting=tokens")
    summary, final, _ = _run(cfg, tmp_path, "liar", hook=liar)
    assert summary["rejected"] == 2 and summary["outer_steps"] == 2
    _, without, _ = _run(cfg, tmp_path, "without", hook=site_reply_hook(0, scale=float("nan")))
    assert torch.equal(final, without)
