"""Server overhead: what the dispatcher and a strategy add to each update beyond Flower itself.

Target (issue): with a no-op client, the dispatcher plus strategy add under 20 ms per update
beyond Flower's own message cost, both printed from one run. One grid (with ``--backend ray``,
one Ray start-up, shut down at the end by Flower's ``run_simulation``) carries three phases, all
with the no-op ClientApp (`fl_geo.bench.noop_client`) and the message a strategy sends (the model in
``wire.down`` plus the run's config record), after a few untimed warm-up messages:

1. **Flower's message cost**: train messages pushed and pulled on the grid directly, one in
   flight per node, re-pushed as soon as its reply is pulled (1 ms poll), no fl-geo code in the
   loop. Measured before and after phase 3, so drift from other load on the machine shows.
2. **Dispatcher only**: the same messages through `Dispatcher.submit`/`next_event` (its own poll
   interval), no strategy work: separates the dispatcher from the strategy.
3. **Full path**: `run_server` with the chosen strategy for ``--updates`` outer steps (buffer 1:
   one update per step for the asynchronous strategies). Timed between the ``metrics.jsonl``
   records of step 1 and step N−1, so the start (profile query, initial evaluation, first
   dispatch) and the final server-side evaluation (``run.eval_every=0`` still evaluates once at
   the end) fall outside the window: nothing is skipped, it is just not timed.

Overhead = phase 3 − phase 1, per update. Why a second figure: Flower's simulation hands messages
to the ClientApps on a 0.1 s tick (``add_messages_to_queue`` in ``flwr/server/superlink/fleet/
vce/vce_api.py``), so on the Ray backend a round trip is quantised to that tick and server work
shorter than the tick's slack does not show end to end at all. The section timers (wrapped
methods, server thread only, a few µs per call) therefore also report the server's own work on
the critical path directly: the window minus the time spent waiting inside
``Dispatcher.next_event`` (client, Flower delivery, poll sleep) and inside Flower's
``push_messages``/``pull_messages``. With one node (the default) every update is strictly serial
(reply → server work → next push); with more nodes server work can overlap client time and the
end-to-end difference understates it.

Usage::

    fl-geo bench dispatch [--updates N] [--params P] [--backend ray|inline] [--strategy S]
                          [--clients K] [--out DIR] [--strict] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fl_geo.bench.section_timer import SectionTimer
from fl_geo.config import ASYNC_STRATEGIES, STRATEGY_OPTIMIZERS, FlGeoConfig, load_config
from fl_geo.inner.model import ModelConfig
from fl_geo.registry import METHODS

__all__ = ["main", "model_overrides", "run_dispatch_bench"]  # its text report: dispatch_report.py

log = logging.getLogger("fl_geo")

TARGET_MS = 20.0  # dispatcher + strategy time per update beyond Flower's message cost
RAW_POLL_S = 0.001  # phase 1 polls the grid this often: Flower's cost, not a poll interval's
WARMUP_PER_NODE = 3  # untimed messages per node first (actor start, imports, spec cache)
PHASE_TIMEOUT_S = 120.0  # a phase that sees no progress this long is reported as a failure

# Exclusive-time labels that are not server work: waiting for a reply, Flower's push and pull.
WAIT = "dispatcher poll sleep (waiting: client + Flower delivery)"
PUSH = "Flower grid.push_messages"
PULL = "Flower grid.pull_messages"
NOT_SERVER_WORK = (WAIT, PUSH, PULL)


# ---------------------------------------------------------------------------------------------
# Configuration


def _param_count(cfg: ModelConfig) -> int:
    """Parameters of `fl_geo.inner.model.Decoder` for ``cfg`` without building it (tied embedding)."""
    d, f = cfg.d_model, cfg.ffn_hidden
    per_block = 4 * d * d + 3 * f * d + 2 * d  # qkv + proj, gate_up + down, two RMSNorms
    return cfg.vocab_size * d + cfg.n_layers * per_block + d


def model_overrides(num_params: int) -> list[str]:
    """``model.d_model`` whose model is nearest ``num_params`` (other model defaults kept).

    Only the width changes, so a larger model is the same shape of work for the server (the
    same tensors, each bigger); ``d_model`` stays a multiple of 2·n_heads (even RoPE heads).
    """
    if num_params < 1:
        raise ValueError(f"--params must be positive, got {num_params}")
    base = ModelConfig()
    step = 2 * base.n_heads
    best, best_err, d = step, float("inf"), step
    while True:
        count = _param_count(ModelConfig(d_model=d))
        err = abs(count - num_params)
        if err < best_err:
            best, best_err = d, err
        if count > num_params:
            break
        d += step
    return [f"model.d_model={best}"]


def bench_config(strategy: str, updates: int, clients: int, backend: str,
                 params: int | None = None, overrides: Sequence[str] = ()) -> FlGeoConfig:
    """The run config of the full path: ``updates`` outer steps, no evaluation inside the window.

    Buffer 1 makes every update one outer step; ``run.eval_every=0`` evaluates only at the end
    (outside the window) and ``run.client_eval_every=0`` sends no evaluate message (the no-op
    client has no evaluate handler). Later ``overrides`` win.
    """
    base = [
        "run.name=bench-dispatch",
        f"run.rounds={updates}",
        f"run.num_clients={clients}",
        f"run.backend={backend}",
        "run.clock=wall",
        "run.eval_every=0",
        "run.client_eval_every=0",
        "run.eval_batches=1",
        "run.tensorboard=false",
        "run.progress=false",
        f"strategy.name={strategy}",
        # buffer 1 where the method has a buffer (a synchronous method refuses the key)
        *(["strategy.buffer_size=1"] if "buffer_size" in METHODS[strategy].settings.strategy_keys() else []),
    ]
    sized = model_overrides(params) if params else []
    return load_config(None, [*base, *sized, *overrides])


def _send_mode(cfg: FlGeoConfig) -> str:
    """What the strategy asks workers to send (mirrors `AsyncOuterLoop`): same reply work."""
    s = cfg.strategy
    if s.name in ASYNC_STRATEGIES and s.pseudo_grad_base == "current":
        return "params"
    return "pseudo_grad"


def _train_content(cfg: FlGeoConfig) -> tuple[RecordDict, int]:
    """The content of a strategy's train message (model in ``wire.down`` + config), and numel."""
    from fl_geo.core.state import ParamSpec, flatten
    from fl_geo.runtime.builders import make_model
    from fl_geo.runtime.protocol import REQUEST_RECORD, TrainRequest
    from fl_geo.runtime.wire import encode
    from fl_geo.strategies.base import client_config_record

    model = make_model(cfg.model, cfg.run.seed)
    spec = ParamSpec.from_state_dict(model.state_dict())
    arrays = encode(flatten(model.state_dict()), spec, cfg.wire.down)
    request = TrainRequest(**client_config_record(cfg), round=0, base_version=0, send=_send_mode(cfg))
    return RecordDict({"arrays": arrays, REQUEST_RECORD: request.to_record(), "config": ConfigRecord()}), spec.numel


# ---------------------------------------------------------------------------------------------
# Phases 1 and 2: message round trips without strategy work


@dataclass
class Phase:
    """Timing of ``n`` updates: total wall time and each update's round trip or interval."""

    n: int
    total_s: float
    samples_s: list[float] = field(default_factory=list)

    @property
    def per_update_ms(self) -> float:
        return 1000.0 * self.total_s / self.n

    def quantile_ms(self, q: float) -> float:
        if not self.samples_s:
            return float("nan")
        xs = sorted(self.samples_s)
        return 1000.0 * xs[min(len(xs) - 1, int(q * len(xs)))]


def _message(content: RecordDict, node: int) -> Message:
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)


def flower_round_trips(grid: Grid, nodes: Sequence[int], content: RecordDict, n: int) -> Phase:
    """Phase 1: ``n`` train round trips on the bare grid, one in flight per node."""
    in_flight: dict[str, tuple[int, float]] = {}

    def push(node: int) -> None:
        t = time.perf_counter()
        (mid,) = grid.push_messages([_message(content, node)])
        if not mid:
            raise RuntimeError(f"the grid does not know node {node}")
        in_flight[mid] = (node, t)

    rtts: list[float] = []
    t0 = time.perf_counter()
    for node in nodes[:n]:
        push(node)
    sent, progress = len(in_flight), t0
    while len(rtts) < n:
        replies = list(grid.pull_messages(list(in_flight)))
        now = time.perf_counter()
        if not replies:
            if now - progress > PHASE_TIMEOUT_S:
                raise TimeoutError(f"no reply for {PHASE_TIMEOUT_S:.0f} s on the bare grid")
            time.sleep(RAW_POLL_S)
            continue
        progress = now
        for reply in replies:
            node, t = in_flight.pop(reply.metadata.reply_to_message_id)
            if reply.has_error():
                raise RuntimeError(f"node {node} replied with an error: {reply.error.reason}")
            rtts.append(now - t)
            if sent < n:
                push(node)
                sent += 1
    return Phase(n, time.perf_counter() - t0, rtts)


def dispatcher_round_trips(grid: Grid, nodes: Sequence[int], content: RecordDict, n: int) -> Phase:
    """Phase 2: the same round trips through a `Dispatcher` (wall clock), no strategy work."""
    from fl_geo.runtime.dispatch import Dispatcher

    dispatcher = Dispatcher(grid)
    t0 = time.perf_counter()
    jobs = dispatcher.submit([_message(content, node) for node in nodes[:n]])
    sent, done = len(jobs), 0
    rtts: list[float] = []
    while done < n:
        ev = dispatcher.next_event(deadline=dispatcher.clock.now() + PHASE_TIMEOUT_S)
        if ev is None or not ev.ok:
            raise RuntimeError(f"dispatcher phase: {'timed out' if ev is None else ev.error}")
        rtts.append(ev.time - ev.job.submitted_at)
        done += 1
        if sent < n:
            dispatcher.submit([_message(content, ev.job.node)])
            sent += 1
    return Phase(n, time.perf_counter() - t0, rtts)


# ---------------------------------------------------------------------------------------------
# Phase 3: the full path, with section timers


class _SleepTimed:
    """Stands in for the ``time`` module inside ``fl_geo.runtime.dispatch``: a timed ``sleep``."""

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self.sleep = sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _instrument(timer: SectionTimer, grid: Grid) -> None:
    """Wrap the entry points of the server path: dispatcher, both outer loops, codec, fold, log."""
    import fl_geo.core.outer as outer_mod
    import fl_geo.runtime.dispatch as dispatch_mod
    import fl_geo.strategies.asynchronous as async_mod
    import fl_geo.strategies.replies as replies_mod
    import fl_geo.strategies.sync as sync_mod
    from fl_geo.core.accumulate import WeightedAccumulator
    from fl_geo.runtime.dispatch import Dispatcher
    from fl_geo.runtime.metrics import MetricsLogger

    targets: list[tuple[Any, str, str]] = [
        (grid, "push_messages", PUSH),
        (grid, "pull_messages", PULL),
        (grid, "get_node_ids", "Flower grid.get_node_ids (membership checks)"),
        (Dispatcher, "next_event", "dispatcher: next_event / run_jobs bookkeeping"),
        (Dispatcher, "run_jobs", "dispatcher: next_event / run_jobs bookkeeping"),
        (Dispatcher, "submit", "dispatcher: submit bookkeeping"),
        (Dispatcher, "busy_nodes", "dispatcher: busy/live node sets"),
        (Dispatcher, "live_nodes", "dispatcher: busy/live node sets"),
        (async_mod.AsyncOuterLoop, "handle", "strategy: validate reply + tallies"),
        (sync_mod.SyncOuterLoop, "fold_replies", "strategy: validate reply + tallies"),
        (replies_mod, "decode", "strategy: decode reply"),
        (WeightedAccumulator, "add_batch_checked", "strategy: fold (check + norm + add)"),
        (WeightedAccumulator, "mean", "strategy: outer step (mean + optimizer)"),
        (WeightedAccumulator, "reset", "strategy: outer step (mean + optimizer)"),
        (async_mod.AsyncOuterLoop, "step", "strategy: step bookkeeping"),
        (sync_mod.SyncOuterLoop, "train_round", "strategy: step bookkeeping"),
        (async_mod, "encode", "strategy: encode model for re-dispatch"),
        (sync_mod, "encode", "strategy: encode model for re-dispatch"),
        (async_mod.AsyncOuterLoop, "dispatch", "strategy: build messages"),
        (async_mod.AsyncOuterLoop, "idle_nodes", "strategy: idle_nodes / should_step"),
        (async_mod.AsyncOuterLoop, "should_step", "strategy: idle_nodes / should_step"),
        (sync_mod.SyncOuterLoop, "refresh_nodes", "strategy: idle_nodes / should_step"),
        (MetricsLogger, "log", "metrics.jsonl record"),
    ]
    for obj in vars(outer_mod).values():
        if isinstance(obj, type) and issubclass(obj, outer_mod.OuterOptimizer) and "step" in vars(obj):
            targets.append((obj, "step", "strategy: outer step (mean + optimizer)"))
    for owner, name, label in targets:
        timer.patch(owner, name, label)
    # The dispatcher's poll sleeps are where it waits for replies: time them through its own
    # ``time`` name only, so no other thread's sleeps are touched.
    timer.replace(dispatch_mod, "time", _SleepTimed(timer.wrap(WAIT, time.sleep)))


def _window_marks(timer: SectionTimer, first: int, last: int) -> dict[int, tuple[float, dict[str, float], dict[str, int]]]:
    """Snapshot the timers as the records of steps ``first`` and ``last`` are written."""
    from fl_geo.runtime.metrics import MetricsLogger

    marks: dict[int, tuple[float, dict[str, float], dict[str, int]]] = {}
    timed_log = MetricsLogger.log

    def log_with_marks(self: MetricsLogger, step: int, metrics: dict[str, float | int]) -> dict[str, Any]:
        if threading.get_ident() == timer.thread and step in (first, last) and step not in marks:
            marks[step] = timer.snapshot()
        return timed_log(self, step, metrics)

    timer.replace(MetricsLogger, "log", log_with_marks)
    return marks


def full_path(grid: Grid, cfg: FlGeoConfig, run_dir: Path) -> dict[str, Any]:
    """Phase 3: ``run_server`` on ``grid``; per-update time of steps 1 → N−1 and its breakdown."""
    from fl_geo.runtime.metrics import read_metrics
    from fl_geo.server_app import run_server

    n = cfg.run.rounds
    timer = SectionTimer()
    try:
        _instrument(timer, grid)
        marks = _window_marks(timer, 1, n - 1)
        summary = run_server(grid, cfg, run_dir)
    finally:
        timer.restore()
    if summary["rejected"]:
        raise RuntimeError(f"{summary['rejected']} no-op update(s) were rejected: the fold path was not measured")
    rows = {int(r["step"]): r for r in read_metrics(run_dir)}
    window = [rows[s] for s in range(1, n)]
    counted = window[1:]  # each record's interval ends with that record
    updates = sum(int(r.get("outer/accepted") or 0) + int(r.get("outer/rejected") or 0)
                  + int(r.get("outer/failed") or 0) for r in counted)
    if updates < 1:
        raise RuntimeError("no update inside the timing window (use --updates >= 3)")
    wall = window[-1]["time/wall_s"] - window[0]["time/wall_s"]
    intervals = [b["time/wall_s"] - a["time/wall_s"] for a, b in zip(window, window[1:], strict=False)]
    (t_a, ex_a, calls_a), (t_b, ex_b, calls_b) = marks[1], marks[n - 1]
    exclusive = {k: v - ex_a.get(k, 0.0) for k, v in ex_b.items() if v - ex_a.get(k, 0.0) > 0}
    calls = {k: v - calls_a.get(k, 0) for k, v in calls_b.items()}
    timed_window = t_b - t_a
    exclusive["other (loop code outside the wrapped sections)"] = max(0.0, timed_window - sum(exclusive.values()))
    server_work = timed_window - sum(exclusive.get(k, 0.0) for k in NOT_SERVER_WORK)
    return {
        "phase": Phase(updates, wall, intervals if updates == len(intervals) else []),
        "exclusive_s": exclusive,
        "calls": calls,
        "server_work_s": server_work,
        "timed_window_s": timed_window,
        "summary": summary,
    }


# ---------------------------------------------------------------------------------------------
# One run


def _server_body(grid: Grid, cfg: FlGeoConfig, updates: int, run_dir: Path, out: dict[str, Any]) -> None:
    """Everything the benchmark does on a grid, in the ServerApp's thread."""
    from fl_geo.runtime.dispatch import Dispatcher, default_poll_interval

    content, numel = _train_content(cfg)
    nodes = Dispatcher(grid).wait_for_nodes(cfg.run.num_clients, cfg.run.wait_nodes_timeout_s)
    nodes = nodes[: cfg.run.num_clients]
    flower_round_trips(grid, nodes, content, WARMUP_PER_NODE * len(nodes))
    out["num_params"] = numel
    out["poll_interval_s"] = default_poll_interval(grid)
    out["flower_before"] = flower_round_trips(grid, nodes, content, updates)
    out["dispatcher"] = dispatcher_round_trips(grid, nodes, content, updates)
    out["full"] = full_path(grid, cfg, run_dir)
    out["flower_after"] = flower_round_trips(grid, nodes, content, updates)


def _run_on_ray(cfg: FlGeoConfig, body: Callable[[Grid], None]) -> None:
    """Run ``body`` as the ServerApp of an in-process Flower simulation with no-op clients.

    Same runtime and sizing as `fl_geo.simulation.run_simulation` (Flower's ``run_simulation``
    shuts Ray down when the ServerApp returns), with this benchmark's ServerApp and ClientApp.
    """
    from flwr.serverapp import ServerApp

    from fl_geo.bench.noop_client import app as noop_app
    from fl_geo.simulation import run_flower_simulation

    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        body(grid)

    run_flower_simulation(cfg, server, noop_app)


@contextmanager
def _run_dir(out: str | None) -> Iterator[Path]:
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="fl-geo-bench-dispatch-") as tmp:
            yield Path(tmp)


def run_dispatch_bench(strategy: str = "async_diloco", updates: int = 50, clients: int = 1,
                       backend: str = "ray", params: int | None = None,
                       overrides: Sequence[str] = (), out_dir: str | None = None) -> dict[str, Any]:
    """Measure the three phases on one grid; returns the figures and the checks."""
    import torch

    if updates < 3:
        raise ValueError("--updates must be >= 3 (steps 1 and N are outside the timing window)")
    cfg = bench_config(strategy, updates, clients, backend, params, overrides)
    out: dict[str, Any] = {}
    with _run_dir(out_dir) as run_dir:
        body = functools.partial(_server_body, cfg=cfg, updates=updates, run_dir=run_dir, out=out)
        if backend == "inline":
            from fl_geo.bench.noop_client import app as noop_app
            from fl_geo.runtime.inline import InlineGrid

            body(InlineGrid(noop_app, clients, seed=cfg.run.seed))
        else:
            _run_on_ray(cfg, body)
    if "flower_after" not in out:
        raise RuntimeError("the benchmark's ServerApp did not finish; see the log above")
    full = out["full"]
    phase: Phase = full["phase"]
    flower = (out["flower_before"].per_update_ms + out["flower_after"].per_update_ms) / 2
    overhead = phase.per_update_ms - flower
    work = 1000.0 * full["server_work_s"] / phase.n
    out.update(
        config={"strategy": cfg.strategy.name, "backend": backend, "clients": clients, "updates": updates,
                "wire_up": cfg.wire.up, "wire_down": cfg.wire.down, "poll_interval_s": out["poll_interval_s"],
                "server_threads": torch.get_num_threads()},
        flower_ms=flower,
        overhead_ms=overhead,
        server_work_ms=work,
        checks={
            "overhead": {"value": overhead, "pass": overhead < TARGET_MS},
            "server_work": {"value": work, "pass": work < TARGET_MS},
        },
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench dispatch [...]``; returns 1 only with --strict and a FAIL."""
    parser = argparse.ArgumentParser(
        prog="fl-geo bench dispatch",
        description="Server overhead per update (dispatcher + strategy) beyond Flower's message cost, "
                    "with a no-op client.")
    parser.add_argument("--updates", type=int, default=50, help="outer steps of the full path (and round trips per phase)")
    parser.add_argument("--params", type=int, default=None, help="model size (sets model.d_model); default: the default 0.43 M model")
    parser.add_argument("--backend", choices=("ray", "inline"), default="ray",
                        help="ray: Flower's simulation runtime (its real message cost); inline: a fast in-process smoke")
    parser.add_argument("--strategy", choices=list(STRATEGY_OPTIMIZERS), default="async_diloco")
    parser.add_argument("--clients", type=int, default=1,
                        help="no-op nodes (1: every update strictly serial, the clean measurement)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of the server (default: leave torch's choice, as run_server does)")
    parser.add_argument("--out", default=None, help="keep the full path's run directory here (default: a temporary one)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. wire.up=bf16")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    result = run_dispatch_bench(strategy=args.strategy, updates=args.updates, clients=args.clients,
                                backend=args.backend, params=args.params, overrides=args.overrides,
                                out_dir=args.out)
    from fl_geo.bench.dispatch_report import format_dispatch_bench

    print(format_dispatch_bench(result))
    failed = not all(check["pass"] for check in result["checks"].values())
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
