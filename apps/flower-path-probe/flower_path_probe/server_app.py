"""ServerApp: time round trips of one float32 array through Flower's message path.

Per round trip: build the array (a deterministic pattern, fresh content per round trip), wrap it
in an ``ArrayRecord`` (a copy, Flower's own), drop our array, then time ``push_messages`` until
the reply has been pulled (polling every ``POLL_S``; ``send_and_receive`` would poll every 3 s in
deployment and quantise the measurement). The reply must hold every word of the array XOR 1;
it is checked in full, block by block, against the regenerated pattern.

Round trip 0 is an untimed-for-throughput warm-up with a 1-element array (the SuperNode fetches
the FAB and starts its first ClientApp) and round trip "small" a second 1-element one: the fixed
cost (SuperNode polling, ClientApp process start) that every payload round trip also pays.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

MIB = 1 << 20
POLL_S = 0.02
BLOCK_ELEMS = 4 * MIB  # 16 MiB of uint32 per generation/verification block
HASH_MUL = 2654435761  # odd: i -> i * HASH_MUL mod 2^32 is a bijection (every 5 MiB chunk differs)

log = logging.getLogger("flower_path_probe")
app = ServerApp()


def pattern(start: int, stop: int, salt: int) -> np.ndarray:
    """Words ``start..stop`` of round trip ``salt``'s payload (uint32; viewed as float32 to send)."""
    idx = np.arange(start, stop, dtype=np.uint64)
    idx *= np.uint64(HASH_MUL)
    idx += np.uint64(salt * 0x9E3779B1 + 1)
    return idx.astype(np.uint32)  # keeps the low 32 bits


def make_payload(n: int, salt: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint32)
    for s in range(0, n, BLOCK_ELEMS):
        e = min(n, s + BLOCK_ELEMS)
        out[s:e] = pattern(s, e, salt)
    return out.view(np.float32)


def verify_reply(reply: np.ndarray, n: int, salt: int) -> bool:
    """Every word of ``reply`` == the sent word XOR 1 (compared as bits, so NaN patterns count)."""
    if reply.dtype != np.float32 or reply.shape != (n,):
        return False
    words = reply.view(np.uint32)
    for s in range(0, n, BLOCK_ELEMS):
        e = min(n, s + BLOCK_ELEMS)
        if not np.array_equal(words[s:e], pattern(s, e, salt) ^ np.uint32(1)):
            return False
    return True


def vm_hwm_mib() -> float:
    """Peak resident memory of this process (VmHWM; getrusage where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _wait_for_node(grid: Grid, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if nodes:
            return nodes[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no SuperNode connected after {wait_s:.0f} s")
        time.sleep(0.5)


def round_trip(grid: Grid, node: int, n: int, salt: int, timeout_s: float) -> dict[str, float | bool]:
    """One array out and back; times in seconds."""
    t0 = time.perf_counter()
    arr = make_payload(n, salt)
    record = ArrayRecord({"x": Array(arr)})  # Array copies (np.save): drop ours
    del arr
    content = RecordDict({"payload": record, "meta": ConfigRecord({"salt": salt})})
    msg = Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(salt))
    del record, content
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    (mid,) = grid.push_messages([msg])
    push_s = time.perf_counter() - t1
    del msg
    deadline = t1 + timeout_s
    reply = None
    while reply is None:
        replies = list(grid.pull_messages([mid]))
        if replies:
            reply = replies[0]
            break
        if time.perf_counter() > deadline:
            raise RuntimeError(f"no reply to round trip {salt} within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    rtt = time.perf_counter() - t1
    if reply.has_error():
        raise RuntimeError(f"round trip {salt}: error reply {reply.error.code}: {reply.error.reason}")

    t2 = time.perf_counter()
    echoed = reply.content["payload"]["x"].numpy()
    decode_s = time.perf_counter() - t2
    del reply
    ok = verify_reply(echoed, n, salt)
    return {"round_trip_s": rtt, "push_s": push_s, "build_s": build_s, "decode_s": decode_s, "ok": ok}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    payload_mib = int(cfg["payload_mib"])
    repeats = int(cfg.get("repeats", 1))
    out = str(cfg.get("out", ""))
    timeout_s = float(cfg.get("reply-timeout-s", 900.0))
    if payload_mib < 1 or repeats < 1:
        raise ValueError(f"payload_mib and repeats must be >= 1, got {payload_mib}, {repeats}")
    n = payload_mib * MIB // 4

    node = _wait_for_node(grid, float(cfg.get("node-wait-s", 60.0)))
    warmup = round_trip(grid, node, 1, salt=0, timeout_s=timeout_s)
    small = round_trip(grid, node, 1, salt=1, timeout_s=timeout_s)
    trips = [round_trip(grid, node, n, salt=2 + r, timeout_s=timeout_s) for r in range(repeats)]

    rtts = [t["round_trip_s"] for t in trips]
    median = statistics.median(rtts)
    payload_bytes = n * 4
    result = {
        "payload_bytes": payload_bytes,
        "repeats": repeats,
        "round_trip_s": rtts,
        "median_round_trip_s": median,
        "mb_per_s_each_way": 2 * payload_bytes / 1e6 / median,
        "push_s": [t["push_s"] for t in trips],
        "build_s": [t["build_s"] for t in trips],
        "decode_s": [t["decode_s"] for t in trips],
        "echo_verified": all(t["ok"] for t in trips) and bool(warmup["ok"]) and bool(small["ok"]),
        "warmup_round_trip_s": warmup["round_trip_s"],
        "small_round_trip_s": small["round_trip_s"],
        "peak_rss_serverapp_mib": vm_hwm_mib(),
        "node_id": node,
        "pid": os.getpid(),
    }
    text = json.dumps(result)
    log.warning("flower-path-probe result: %s", text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(path)
    if not result["echo_verified"]:
        raise RuntimeError("the echoed array differs from the sent one")
