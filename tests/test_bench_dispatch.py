"""`fl-geo bench dispatch`: a fast smoke of the whole benchmark on the inline grid, and its parts.

No timing is asserted (the machine is shared); the test checks that one run prints Flower's message
cost, the full path and the overhead verdict, that the no-op replies are really folded, and that
the benchmark leaves the classes it times exactly as it found them.
"""

from __future__ import annotations

import re

import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fl_geo.bench.command import main as bench_main
from fl_geo.bench.dispatch import _param_count, model_overrides, run_dispatch_bench
from fl_geo.inner.model import ModelConfig
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.dispatch import Dispatcher
from fl_geo.runtime.metrics import MetricsLogger


def test_dispatch_bench_inline_prints_both_figures_and_the_verdict(capsys):
    before = (Dispatcher.next_event, Dispatcher.submit, MetricsLogger.log)
    assert bench_main(["dispatch", "--backend", "inline", "--updates", "5", "data.corpus=pydoc"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Flower's own message cost .*\d+\.\d+ ms/update", out)
    assert re.search(r"\n  full path +\d+\.\d+ ms/update", out)
    assert re.search(r"\[(PASS|FAIL)\] dispatcher \+ strategy overhead = full - Flower +[+-]\d+\.\d+ ms/update", out)
    assert "server work on the critical path" in out
    assert "strategy: fold (check + norm + add)" in out  # the breakdown names where time goes
    assert (Dispatcher.next_event, Dispatcher.submit, MetricsLogger.log) == before
    import fl_geo.runtime.dispatch as dispatch_mod

    assert dispatch_mod.time.__name__ == "time"  # the module again, not the timing stand-in


def test_noop_updates_are_folded_by_the_sync_loop_too():
    result = run_dispatch_bench(strategy="diloco", updates=3, clients=2, backend="inline",
                                overrides=["data.corpus=pydoc"])
    summary = result["full"]["summary"]
    assert summary["outer_steps"] == 3 and summary["rejected"] == 0
    assert result["full"]["phase"].n == 2  # one round (step 2) of two nodes inside the window
    assert set(result["checks"]) == {"overhead", "server_work"}


def test_noop_client_has_no_evaluate_handler():
    from fl_geo.bench.noop_client import app
    from fl_geo.runtime.inline import InlineGrid

    grid = InlineGrid(app, 1)
    node = next(iter(grid.get_node_ids()))
    msg = Message(RecordDict({"config": ConfigRecord({"round": 1})}), dst_node_id=node,
                  message_type=MessageType.EVALUATE)
    (reply,) = grid.pull_messages(grid.push_messages([msg]))
    assert reply.has_error()  # an error reply, never a made-up validation loss


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(d_model=64, n_layers=3), ModelConfig(d_ff=100)])
def test_param_count_matches_the_model(cfg):
    assert _param_count(cfg) == make_model(cfg.to_dict(), 0).num_params()


def test_params_option_picks_the_nearest_width():
    assert model_overrides(434_816) == ["model.d_model=128"]  # the default model
    (item,) = model_overrides(10_000_000)
    d = int(item.split("=")[1])
    assert abs(_param_count(ModelConfig(d_model=d)) - 10_000_000) < 0.05 * 10_000_000
