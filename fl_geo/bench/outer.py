"""Benchmark of one outer step on the path the server uses, against Flower's FedAvg aggregation.

Our step (what `strategies/sync.py` does per round): K reply ArrayRecords (token-weighted,
distinct token counts) → `decode` (zero-copy views) → `WeightedAccumulator.add_batch_checked`
(NaN/Inf check + L2 norm + weighted fold, one pass) → ``mean`` (in place) → `Nesterov.step`.
Timed twice on the same replies: all K replies handed over as one group (the headline, a round
whose replies are all ready), and one at a time (K groups of one, replies trickling in).
Flower's step: ``flwr.serverapp.strategy.FedAvg.aggregate_train`` on reply ``Message``s carrying
the same values as fp32 ArrayRecords (Flower cannot average the int16-viewed bf16 payloads) —
aggregation only: no validation, no norm, no outer step. The speed-up is therefore reported two
ways: our whole step (with the Nesterov step) against Flower's aggregation — the strict reading,
on which the target is judged — and aggregation against aggregation.

Every measurement runs in a fresh spawned process by default; memory runs are separate from
timing runs. Peak extra memory is VmHWM − VmRSS around the measured block after resetting the
high-water mark (``/proc/self/clear_refs`` = 5); tracemalloc cannot see torch's allocations.
Usage::

    fl-geo bench outer [--params N] [--updates K] [--precision bf16|fp32|fp16] [--quick]
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fl_geo.bench.machine import (
    PeakMemory,
    cpu_busy,
    measure_copy_bandwidth,
    return_freed_memory_to_os,
    timed,
)
from fl_geo.core.accumulate import WeightedAccumulator, weight_for
from fl_geo.core.outer import Nesterov
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.wire import PRECISIONS, decode, encode, payload_nbytes

__all__ = ["llama_spec", "run_outer_bench"]  # its text report: fl_geo/bench/outer_report.py

GIB = 1 << 30
MIB = 1 << 20
QUICK_PARAMS = 10_000_000
# Size of the copy that measures memory bandwidth: 1.2 GB source (300 M fp32), far beyond cache.
COPY_ELEMS = 300_000_000
COPY_SAMPLES = 2  # fresh allocations measured before and again after our timings
THROUGHPUT_TARGET = 0.5  # × bytes-copied/s of a large torch copy
SPEEDUP_TARGET = 3.0  # × Flower FedAvg.aggregate_train
# "Independent of the number of updates": the peak extra memory may grow by at most this
# fraction of one update's wire size per additional update (an O(K) design grows by >= 1.0).
MEMORY_SLOPE_TARGET = 0.05


# ---------------------------------------------------------------------------------------------
# Model shape and synthetic replies


def _ffn_hidden(d: int) -> int:
    """SwiGLU hidden size: 8/3·d rounded up to a multiple of 64 (Llama convention)."""
    return -(-(8 * d // 3) // 64) * 64


def llama_spec(num_params: int, max_layers: int = 12) -> ParamSpec:
    """Llama-style parameter set of about ``num_params`` fp32 parameters.

    ``max_layers`` blocks of the widest d (768 down to 16) that fit in ~85 % of the budget, each
    with fused QKV, output projection, SwiGLU MLP and RMSNorm weights; the (tied) embedding's
    vocabulary takes the rest. 100 M → 12 blocks of d = 768, vocab ≈ 19.6 k; 10 M → d = 192.
    """
    if num_params < 1000:
        raise ValueError(f"num_params must be >= 1000, got {num_params}")
    widths = (768, 640, 512, 384, 320, 256, 192, 128, 96, 64, 48, 32, 16)
    for d in widths:  # the widest d that fits max_layers blocks; else fewer blocks of d = 16
        h = _ffn_hidden(d)
        block = 4 * d * d + 3 * h * d + 2 * d
        layers = min(max_layers, int(0.85 * num_params) // block)
        if layers == max_layers or (d == widths[-1] and layers >= 1):
            break
    vocab = max(1, (num_params - layers * block - d) // d)
    names: list[str] = ["embed.weight"]
    shapes: list[tuple[int, ...]] = [(vocab, d)]
    for i in range(layers):
        for name, shape in (
            ("attn_norm.weight", (d,)),
            ("attn.wqkv.weight", (3 * d, d)),
            ("attn.wo.weight", (d, d)),
            ("mlp_norm.weight", (d,)),
            ("mlp.w1.weight", (h, d)),
            ("mlp.w3.weight", (h, d)),
            ("mlp.w2.weight", (d, h)),
        ):
            names.append(f"blocks.{i}.{name}")
            shapes.append(shape)
    names.append("norm.weight")
    shapes.append((d,))
    return ParamSpec(tuple(names), tuple(shapes), ("float32",) * len(names))


def _tokens(i: int) -> int:
    """Distinct token counts per reply so token weighting is not uniform in disguise."""
    return 65_536 + 8_192 * i


def _make_updates(
    spec: ParamSpec, num_updates: int, precision: str, seed: int = 0
) -> list[tuple[Any, int]]:
    """``num_updates`` (ArrayRecord, tokens) replies with distinct pseudo-gradient-like values.

    One random fp32 base (std 1e-3, like an outer gradient) is scaled and shifted per reply into
    one reused buffer before encoding, so building the replies needs two model-sized fp32
    buffers whatever the count.
    """
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(spec.numel, generator=gen).mul_(1e-3)
    tmp = torch.empty_like(base)
    replies = []
    for i in range(num_updates):
        torch.mul(base, 1.0 + 0.125 * i, out=tmp).add_(1e-5 * (i - num_updates / 2))
        replies.append((encode(tmp, spec, precision), _tokens(i)))
    return replies


# ---------------------------------------------------------------------------------------------
# Our path and Flower's (each runs in its own process when isolated)


PATHS = ("batched", "one_at_a_time")
PHASES = ("decode", "check+fold", "mean", "outer_step")
AGGREGATION_PHASES = ("decode", "check+fold", "mean")  # what Flower's aggregate_train covers


def _path_label(path: str, num_updates: int) -> str:
    if path == "batched":
        return f"ours: {num_updates} replies, one add_batch_checked"
    return f"ours: {num_updates} replies one at a time (batches of 1)"


def _groups(replies: list[tuple[Any, int]], path: str) -> list[list[tuple[Any, int]]]:
    """How the replies reach the fold: all at once, or one per group."""
    return [replies] if path == "batched" else [[reply] for reply in replies]


def _fold(acc: WeightedAccumulator, spec: ParamSpec, precision: str,
          group: list[tuple[Any, int]], phases: dict[str, float]) -> None:
    """The server's per-group work: zero-copy decode, then one checked batched fold."""
    t0 = time.perf_counter()
    decoded = [decode(record, spec, precision) for record, _ in group]
    t1 = time.perf_counter()
    result = acc.add_batch_checked(decoded, [weight_for("tokens", t) for _, t in group])
    phases["decode"] += t1 - t0
    phases["check+fold"] += time.perf_counter() - t1
    if result.rejected:  # synthetic replies are finite: a rejection is a bug, not a data point
        raise RuntimeError(f"bench replies rejected: {result.rejected}")


def _ours(num_params: int, num_updates: int, precision: str, repeats: int,
          threads: int | None, copy_elems: int, memory_run: bool) -> dict[str, Any]:
    """Our server path on the same replies, grouped both ways, repeats interleaved.

    Each step: decode every reply (zero-copy), `add_batch_checked` per group, mean (in place),
    Nesterov. Also checks (timing runs only, outside the timed blocks) that both groupings give
    the same sum bit for bit, as the accumulator promises.
    """
    if memory_run:
        return_freed_memory_to_os()
    if threads:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    # Memory bandwidth on this kind of VM depends on the physical pages an allocation lands on
    # (bimodal here: ~21 or ~37 GB/s copied), so several fresh allocations are sampled, before
    # and after our timings; the best is the reference, the strictest comparison for us.
    copies = [measure_copy_bandwidth(copy_elems) for _ in range(COPY_SAMPLES)] if copy_elems \
        else []
    spec = llama_spec(num_params)
    replies = _make_updates(spec, num_updates, precision)
    params = torch.empty(spec.numel).normal_(0.0, 0.02)
    server: dict[str, Any] = {}

    def step(path: str) -> dict[str, float]:
        acc: WeightedAccumulator = server["acc"]
        phases = dict.fromkeys(PHASES, 0.0)
        acc.reset()
        for group in _groups(replies, path):
            _fold(acc, spec, precision, group, phases)
        t0 = time.perf_counter()
        mean = acc.mean()
        t1 = time.perf_counter()
        server["opt"].step(params, mean)
        phases["mean"] = t1 - t0
        phases["outer_step"] = time.perf_counter() - t1
        return phases

    # First two steps, cold: the server state is created and first written inside the measured
    # window, so this peak is everything our path adds to the replies. Two steps, because the
    # accumulator alternates between its two buffers: the second step is the first to write
    # (hence fault in) the one allocated at construction.
    with PeakMemory() as cold:
        server["acc"] = WeightedAccumulator(spec.numel)
        server["opt"] = Nesterov(spec.numel, lr=0.7, momentum=0.9)
        step("batched")
        step("batched")
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {p: [] for p in PATHS}
    with PeakMemory() as warm:
        for _ in range(repeats):
            for path in PATHS:  # interleaved, so background load hits both alike
                t0 = time.perf_counter()
                phases = step(path)
                runs[path].append((time.perf_counter() - t0, phases))
    if copy_elems:
        copies += [measure_copy_bandwidth(copy_elems) for _ in range(COPY_SAMPLES)]
        out["bandwidth"] = {**max(copies, key=lambda c: c["copy_gbps"]),
                            "copy_gbps_each": [c["copy_gbps"] for c in copies]}
    for path, results in runs.items():
        out[path] = {"times": [t for t, _ in results],
                     "aggregation_times": [sum(ph[k] for k in AGGREGATION_PHASES)
                                           for _, ph in results],
                     "phases": min(results, key=lambda r: r[0])[1]}
    if not memory_run:
        sums = []
        for path in PATHS:
            acc = WeightedAccumulator(spec.numel)
            for group in _groups(replies, path):
                _fold(acc, spec, precision, group, dict.fromkeys(PHASES, 0.0))
            sums.append(acc.buffer.view(torch.int32))
        out["bit_identical"] = torch.equal(*sums)
        del sums, acc
    out.update(
        numel=spec.numel, num_tensors=len(spec.names),
        wire_bytes=sum(payload_nbytes(r) for r, _ in replies),
        cold_extra_bytes=cold.extra_bytes, warm_extra_bytes=warm.extra_bytes,
        state_bytes=4 * spec.numel * 3,  # accumulator's two buffers + Nesterov momentum (fp32)
    )
    return out


def _reply_messages(records: Sequence[tuple[Any, int]]) -> list[Any]:
    """Reply Messages as Flower's strategies receive them from ``grid.send_and_receive``.

    Flower's checks (``FedAvg._check_and_log_replies`` → ``validate_message_reply_consistency``)
    need: no error, exactly one ArrayRecord and one MetricRecord per reply, identical keys, and
    the weighting key (``num-examples``) as a scalar. ``Message(content, reply_to=...)`` needs
    the process's TaskIdentity, which only exists inside a running Flower app, so the replies get
    the metadata the SuperLink would deliver (reply to a ``train`` instruction from node i).
    """
    from flwr.app import DEFAULT_TTL, Message, MessageType, Metadata, MetricRecord, RecordDict

    replies = []
    now = time.time()
    for node_id, (record, tokens) in enumerate(records, start=2):
        metadata = Metadata(
            run_id=1, message_id=f"reply-{node_id}", src_node_id=node_id,
            dst_node_id=1,  # the SuperLink/ServerApp side (flwr SUPERLINK_NODE_ID)
            reply_to_message_id=f"instruction-{node_id}", group_id="1", created_at=now,
            ttl=DEFAULT_TTL, message_type=MessageType.TRAIN,
        )
        content = RecordDict({"arrays": record,
                              "metrics": MetricRecord({"num-examples": tokens})})
        replies.append(Message(content, metadata=metadata))
    return replies


def _flower(num_params: int, num_updates: int, precision: str, repeats: int,
            threads: int | None, memory_run: bool) -> dict[str, Any]:
    import logging

    from flwr.serverapp.strategy import FedAvg

    logging.getLogger("flwr").setLevel(logging.WARNING)  # aggregate_train logs every call
    if memory_run:
        return_freed_memory_to_os()
    if threads:
        torch.set_num_threads(threads)
    spec = llama_spec(num_params)
    # Same values as our path: generate in wire precision, hand Flower the fp32 upcast.
    wire = _make_updates(spec, num_updates, precision)
    records = []
    for record, tokens in wire:
        flat = torch.empty(spec.numel, dtype=torch.float32)
        for begin, piece in decode(record, spec, precision):
            flat[begin:begin + piece.numel()].copy_(piece)
        records.append((encode(flat, spec, "fp32"), tokens))
        del flat
    del wire
    replies = _reply_messages(records)
    strategy = FedAvg(min_train_nodes=1, min_available_nodes=1)
    result: dict[str, Any] = {}

    def aggregate() -> None:
        result["arrays"], _ = strategy.aggregate_train(1, replies)

    with PeakMemory() as cold:
        aggregate()  # first two calls, cold, like ours
        aggregate()
    with PeakMemory() as warm:
        times = timed(aggregate, repeats)
    out = {"times": times, "cold_extra_bytes": cold.extra_bytes,
           "warm_extra_bytes": warm.extra_bytes,
           "wire_bytes": sum(payload_nbytes(r) for r, _ in records)}
    if memory_run:
        return out
    # Cross-check: our server path on the same fp32 records equals Flower's average.
    acc = WeightedAccumulator(spec.numel)
    _fold(acc, spec, "fp32", list(records), dict.fromkeys(PHASES, 0.0))
    ours = acc.mean()
    max_diff = 0.0
    for begin, piece in decode(result["arrays"], spec, "fp32"):
        diff = (ours[begin:begin + piece.numel()] - piece).abs_().max()
        max_diff = max(max_diff, float(diff))
    return {**out, "max_abs_diff_vs_ours": max_diff}


def _call(isolate: bool, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run ``fn(*args)`` in a fresh spawned process (isolate) or here."""
    if not isolate:
        return fn(*args)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def _measure(
    num_params: int,
    num_updates: int,
    precision: str,
    repeats: int,
    threads: int | None,
    memory_counts: Sequence[int],
    isolate: bool,
    with_flower: bool,
    copy_elems: int,
) -> tuple[dict[str, Any], dict[int, dict[str, int | None]], dict[str, Any] | None]:
    """All the runs of `run_outer_bench`: our timed run, the peak-memory runs, Flower's runs.

    Returns our main run's raw result, the cold / warm peak extra bytes per update count, and
    Flower's raw result (None without ``with_flower``).
    """
    # Timing runs and memory runs are separate processes when isolated: memory runs change the
    # allocator's policy (see return_freed_memory_to_os), which must not touch the timings.
    main = _call(isolate, _ours, num_params, num_updates, precision, repeats, threads,
                 copy_elems, False)
    memory: dict[int, dict[str, int | None]] = {}
    for k in sorted(set(memory_counts)):
        run = main if (k == num_updates and not isolate) else _call(
            isolate, _ours, num_params, k, precision, 1, threads, 0, isolate)
        memory[k] = {"cold": run["cold_extra_bytes"], "warm": run["warm_extra_bytes"]}
    flower = None
    if with_flower:
        flower = _call(isolate, _flower, num_params, num_updates, precision, repeats, threads,
                       False)
        if isolate:
            mem = _call(isolate, _flower, num_params, num_updates, precision, 1, threads, True)
            flower.update(cold_extra_bytes=mem["cold_extra_bytes"],
                          warm_extra_bytes=mem["warm_extra_bytes"])
    return main, memory, flower


def _path_summaries(main: dict[str, Any], fp32_bytes: int) -> dict[str, dict[str, Any]]:
    """Best / median step time, aggregation time, rates and phases of each path in ``PATHS``."""
    paths: dict[str, dict[str, Any]] = {}
    for path in PATHS:
        times = main[path]["times"]
        best_s = min(times)
        paths[path] = {"best_s": best_s, "median_s": statistics.median(times),
                       "aggregation_s": min(main[path]["aggregation_times"]),
                       "wire_gbps": main["wire_bytes"] / best_s / 1e9,
                       "fp32_gbps": fp32_bytes / best_s / 1e9,
                       "phases": main[path]["phases"]}
    return paths


def _throughput_check(paths: dict[str, dict[str, Any]], bw: dict[str, Any]) -> dict[str, Any]:
    """The throughput target: the batched path's fp32-equivalent rate against a torch copy."""
    # Throughput target. Compared quantity: fp32-equivalent update bytes per second (4 bytes per
    # parameter per update, whatever the wire precision) against the bytes-copied/s of a large
    # torch copy. Why that pairing: a copy moves each byte twice (read src, write dst); folding
    # an update reads it and reads and writes the accumulator, i.e. three fp32-sized streams
    # per fp32-equivalent byte (2.5 with bf16 on the wire), before the norm pass and the
    # amortised outer step. At equal memory efficiency a fold therefore runs at 2/3–4/5 of
    # bytes-copied/s, and 0.5 leaves room for the check and the step. Comparing wire bytes with
    # read+write bytes/s would charge bf16 for being compact. All raw rates are reported.
    ours = paths["batched"]
    throughput_ratio = ours["fp32_gbps"] / bw["copy_gbps"]
    return {"ratio": throughput_ratio, "target": THROUGHPUT_TARGET,
            "pass": throughput_ratio >= THROUGHPUT_TARGET,
            "ratio_vs_lowest": ours["fp32_gbps"] / min(bw["copy_gbps_each"]),
            "one_at_a_time_ratio":
                paths["one_at_a_time"]["fp32_gbps"] / bw["copy_gbps"]}


def _flower_summary(flower: dict[str, Any], fp32_bytes: int) -> dict[str, Any]:
    """The ``flower`` entry of the result: Flower's best / median time, rate and memory."""
    fbest = min(flower["times"])
    return {"best_s": fbest, "median_s": statistics.median(flower["times"]),
            "fp32_gbps": fp32_bytes / fbest / 1e9,
            "cold_extra_bytes": flower["cold_extra_bytes"],
            "warm_extra_bytes": flower["warm_extra_bytes"],
            "max_abs_diff_vs_ours": flower["max_abs_diff_vs_ours"],
            "wire_bytes": flower["wire_bytes"]}


def _speedup_check(fbest: float, paths: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The speed-up target against Flower's best aggregation time ``fbest``."""
    # Strict reading, judged: our whole step (Nesterov included) vs Flower's aggregation
    # alone. Beside it, like for like: aggregation (decode + check + weighted mean) vs
    # aggregation.
    ours = paths["batched"]
    speedup = fbest / ours["best_s"]
    one = paths["one_at_a_time"]
    return {"ratio": speedup, "target": SPEEDUP_TARGET,
            "pass": speedup >= SPEEDUP_TARGET,
            "aggregation_ratio": fbest / ours["aggregation_s"],
            "one_at_a_time_ratio": fbest / one["best_s"],
            "one_at_a_time_aggregation_ratio": fbest / one["aggregation_s"]}


# ---------------------------------------------------------------------------------------------
# Public entry points


def run_outer_bench(
    num_params: int = 100_000_000,
    num_updates: int = 8,
    precision: str = "bf16",
    repeats: int = 3,
    threads: int | None = None,
    memory_counts: Sequence[int] = (2, 4, 8),
    isolate: bool = True,
    with_flower: bool = True,
    copy_elems: int = COPY_ELEMS,
) -> dict[str, Any]:
    """Time one outer step on our server path and Flower's FedAvg aggregation; check targets.

    ``memory_counts``: update counts for the peak-memory runs (the main run's count is reused
    when it is among them). ``isolate=False`` runs everything in this process (fast, for smoke
    tests; memory figures are then less trustworthy). ``copy_elems``: fp32 elements of the
    bandwidth-measuring copy (default 1.2 GB; smoke tests pass less).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if num_updates < 1 or repeats < 1:
        raise ValueError("num_updates and repeats must be >= 1")
    busy_before = cpu_busy()
    main, memory, flower = _measure(num_params, num_updates, precision, repeats, threads,
                                    memory_counts, isolate, with_flower, copy_elems)

    numel = main["numel"]
    fp32_bytes = 4 * numel * num_updates
    bw = main["bandwidth"]
    paths = _path_summaries(main, fp32_bytes)
    ours = paths["batched"]
    result: dict[str, Any] = {
        "config": {"num_params": numel, "num_tensors": main["num_tensors"],
                   "num_updates": num_updates, "precision": precision, "repeats": repeats,
                   "threads": main["threads"], "isolated": isolate,
                   "cpus": os.cpu_count(), "busy_before": busy_before},
        "bandwidth": bw,
        "ours": {**ours, "state_bytes": main["state_bytes"], "wire_bytes": main["wire_bytes"],
                 "bit_identical": main["bit_identical"]},
        "ours_one_at_a_time": paths["one_at_a_time"],
        "memory": memory,
    }
    checks: dict[str, dict[str, Any]] = {"throughput": _throughput_check(paths, bw)}
    if flower is not None:
        result["flower"] = _flower_summary(flower, fp32_bytes)
        checks["speedup"] = _speedup_check(result["flower"]["best_s"], paths)
    checks["memory"] = _memory_check(memory, main["wire_bytes"] / num_updates)
    result["checks"] = checks
    return result


def _memory_check(memory: dict[int, dict[str, int | None]], update_bytes: float
                  ) -> dict[str, Any]:
    """Growth of peak extra memory per additional update, as a fraction of one update's size.

    Judged on the cold figure (first two steps, server state allocated inside the window) and the
    warm one (later steps); both must stay flat. An O(K) design grows by >= 1 per update.
    """
    slopes: dict[str, float] = {}
    for kind in ("cold", "warm"):
        known = {k: v[kind] for k, v in memory.items() if v[kind] is not None}
        if len(known) >= 2:
            lo, hi = min(known), max(known)
            slopes[kind] = (known[hi] - known[lo]) / (hi - lo) / update_bytes
    ok = len(slopes) == 2 and all(v <= MEMORY_SLOPE_TARGET for v in slopes.values())
    return {"slope": max(slopes.values()) if slopes else None, "slopes": slopes,
            "target": MEMORY_SLOPE_TARGET, "pass": ok}

