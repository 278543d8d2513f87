"""Regenerate ``tests/data/bit_identity.json``: the sha256 of the final global model of every method.

Why: refactors of how ``fl-geo run`` builds its strategies (strategy classes, registries, message
protocol, client wrappers) must not change a single bit of what a method computes. This script
runs every method config in ``configs/`` on a tiny budget (``tests/conftest.py``'s ``TINY`` plus
the few overrides each config needs to validate and finish in a few seconds) through the function
``fl-geo run`` calls (``load_config`` then ``fl_geo.simulation.run_simulation``), runs each one
twice to check it is deterministic, and records two things about the final fp32 flat ``params``
tensor saved in ``final_model.pt``:

- float64 statistics (norm, mean, projections on fixed random directions), compared on any CPU
  within ``STATISTICS_RTOL`` of the model's norm;
- the sha256 of its bits, under this CPU's kernel fingerprint (``kernel_fingerprint.py``): the same
  torch wheel rounds differently on CPUs with other vector units, so bits are compared only where
  the fingerprint matches. ``tests/test_bit_identity.py`` replays the records.

Regenerate (from the repository root, one process, a minute or two on a small CPU)::

    .venv/bin/python -m tests.data.make_bit_identity            # everything, this CPU's bits only
    .venv/bin/python -m tests.data.make_bit_identity fedavg dips  # only re-record these methods
    .venv/bin/python -m tests.data.make_bit_identity --add-this-cpu  # add this CPU's exact bits,
                                                 # after checking its statistics match the record

Regenerating is only right when a change is *meant* to change the numbers (a bug fix in a
method, a new default, a different torch on the reference platform) -- say so in the commit
message. If a refactor makes ``tests/test_bit_identity.py`` fail, the refactor changed the
arithmetic: fix the refactor, do not regenerate.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECORD = Path(__file__).resolve().parent / "bit_identity.json"

# Per method config: what TINY leaves invalid or too slow, and a few settings that make the tiny
# run reach the method's distinctive code (a penalty past its warm-up, staleness, two HALoS local
# servers, more than one fragment). Applied after TINY, so these win.
SYNC = ["run.rounds=4"]
ASYNC = ["run.rounds=8"]  # asynchronous runs: outer steps = updates applied; 8 gives stale updates
METHODS: dict[str, list[str]] = {
    "diloco": SYNC,
    "diloco_bf16": SYNC,
    # a 512-token BPE trains in well under a second on pydoc (the config's 4096 would too, but
    # would make the 1-layer model's embedding most of its parameters)
    "diloco_bpe": [*SYNC, "data.bpe_vocab_size=512"],
    # Muon on the hidden matrices, AdamW on the rest (client.optimizer=muon)
    "diloco_muon": SYNC,
    "fedavg": SYNC,
    "fedavgm": SYNC,
    "fedadam": SYNC,
    "fedyogi": SYNC,
    # penalty warm-up 20 would leave the z-score rule idle for the whole tiny run
    "edit": [*SYNC, "penalty.warmup=1"],
    # straggler_3x: 0.6 s per step at speed 1, so a 1.8 s budget gives 3 steps to the fast workers
    # and 1 to the 3x straggler (the config's 30 s would be 50 steps)
    "a_edit": [*SYNC, "penalty.warmup=1", "strategy.time_budget_s=1.8"],
    "fedbuff": ASYNC,
    "fedasync": ASYNC,
    "async_diloco": ASYNC,
    "async_local_sgd": ASYNC,
    "dips": [*ASYNC, "penalty.warmup=2"],
    # in-process followers: the gRPC data path starts servers and threads; the arithmetic is the
    # same (the config's comment: 1, 2 or 4 followers, in-process or as processes, same bits)
    "dips_sharded": [*ASYNC, "penalty.warmup=2", "ps.transport=local"],
    # the first 3 nodes of halos_4x4 are all in R-1: group_size=2 gives two local servers; K, N and
    # H small enough for several global updates in a few seconds
    "halos": ["run.rounds=3", "halos.group_size=2", "halos.accumulate=2", "halos.local_buffer=2",
              "strategy.delay_buffer=2", "strategy.inner_steps=2"],
    # P fragments need >= P layers and H divisible by P; overlap tau < H / P
    "streaming_diloco": ["run.rounds=3", "model.n_layers=2", "streaming.fragments=2", "strategy.inner_steps=4",
                         "streaming.overlap=1"],
    "cocodc": ["run.rounds=3", "model.n_layers=2", "streaming.fragments=2", "strategy.inner_steps=4",
               "streaming.overlap=1"],
    # one gradient per site per step (H = 1); 6 steps pass the warm-up and the clip binds
    "ddp": ["run.rounds=6", "strategy.inner_steps=1"],
}


def pydoc_corpus_sha256() -> str:
    """The training text's digest: TINY trains on the pydoc topics, which change between Python
    releases, and then every hash changes with it although no code did (so the tests and this
    script read the topics pinned in tests/data, `tests.data.pin_pydoc_topics`)."""
    from fl_geo.data.corpus import load_corpus

    return load_corpus("pydoc").sha256


def platform_record() -> dict[str, str]:
    """What the numbers depend on besides the code and the CPU: float kernels differ across torch
    builds, and the training text comes with the Python release."""
    import flwr
    import torch

    return {"torch": torch.__version__, "flwr": flwr.__version__, "python": platform.python_version(),
            "pydoc_corpus_sha256": pydoc_corpus_sha256()}


# What must match for the records to be comparable at all (flwr and Python are kept for the reader:
# Python's release shows in the corpus digest, and flwr does not touch the arithmetic).
COMPARABLE_ON = ("torch", "pydoc_corpus_sha256")


def run_entry(config: str, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Run ``config`` with ``overrides`` exactly as ``fl-geo run`` does; sha256 of the final model.

    The global torch state is reset first (seed 0, two threads, as ``tests/conftest.py``), so the
    record does not depend on what ran before in the same process.
    """
    import torch

    from fl_geo.config import load_config
    from fl_geo.simulation import run_simulation

    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = load_config(str(REPO / config), overrides)
    summary = run_simulation(cfg, run_dir)
    params = torch.load(Path(summary["run_dir"]) / "final_model.pt")["params"]
    if params.dtype != torch.float32 or params.dim() != 1:
        raise RuntimeError(f"{config}: final_model.pt params is {params.dtype} {tuple(params.shape)}, not flat fp32")
    if not torch.isfinite(params).all():
        raise RuntimeError(f"{config}: the final model has non-finite values; a hash of it guards nothing")
    return {
        "sha256": hashlib.sha256(params.contiguous().numpy().tobytes()).hexdigest(),
        "outer_steps": int(summary["outer_steps"]),
        "numel": int(params.numel()),
        "statistics": model_statistics(params),
    }


# Statistics of the final model compared across CPUs, as a fraction of its L2 norm. Measured on
# 2026-11-28 (torch 2.13.0, one Xeon run with its AVX-512 kernels and again with
# ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2): kernel drift is at most 2.7e-7
# (dips), 1e-9 to 5e-8 for most methods; a 1 % change of DiLoCo's outer lr moves them by 1.8e-3,
# outer momentum 0.9 -> 0.89 by 2.9e-3, FedBuff without staleness weighting by 1.3e-3. 1e-5 sits
# 37x above the first and over 100x below the others.
N_PROJECTIONS = 8
STATISTICS_RTOL = 1e-5
# Methods whose arithmetic amplifies kernel rounding, with their own tolerance (kept in their record).
# diloco_muon: torch.optim.Muon orthogonalises in bf16 (Newton-Schulz), so a last-bit difference of
# fp32 kernels flips bf16 roundings and grows over the steps. 2026-11-29, the Xeon record (AVX-512)
# replayed on an AMD EPYC with AVX2 kernels: 1.0e-4 of the norm; a 0.5 % change of the outer lr
# moves the statistics by 1.1e-3, a 1 % change of muon_lr by 9.9e-4. 4e-4: 4x above the first,
# 2.5x below the others.
METHOD_STATISTICS_RTOL: dict[str, float] = {"diloco_muon": 4e-4}


def statistics_rtol(records: dict[str, Any], method: str) -> float:
    """The tolerance ``method``'s statistics are compared with: its record's own, else the file's."""
    return float(records["methods"][method].get("statistics_rtol", records["statistics_rtol"]))


def model_statistics(params) -> dict[str, Any]:
    """Float64 numbers that summarise the final model: its L2 norm, mean, mean absolute value and
    its projections on ``N_PROJECTIONS`` fixed random unit directions (seeded, so the same on every
    machine). Unlike a hash they change smoothly, so they can be compared with a tolerance on a
    CPU whose float kernels round differently."""
    import torch

    x = params.detach().double().flatten()
    gen = torch.Generator().manual_seed(20261128)
    dirs = torch.randn(N_PROJECTIONS, x.numel(), generator=gen, dtype=torch.float64)
    dirs /= dirs.norm(dim=1, keepdim=True)
    return {"l2": float(x.norm()), "mean": float(x.mean()), "abs_mean": float(x.abs().mean()),
            "projections": [float(v) for v in dirs @ x]}


def statistics_mismatch(got: dict[str, Any], rec: dict[str, Any], rtol: float = STATISTICS_RTOL) -> list[str]:
    """The statistics of ``got`` that differ from ``rec`` by more than ``rtol`` of the recorded
    norm (the scale every statistic is measured against), as readable lines; empty when close."""
    scale = rtol * rec["l2"]
    pairs = [("l2", got["l2"], rec["l2"]), ("mean", got["mean"], rec["mean"]),
             ("abs_mean", got["abs_mean"], rec["abs_mean"])]
    pairs += [(f"projection {i}", g, r) for i, (g, r) in enumerate(zip(got["projections"], rec["projections"], strict=True))]
    return [f"{name}: {g:.9g} recorded {r:.9g} (|diff| {abs(g - r):.3g} > {scale:.3g})"
            for name, g, r in pairs if abs(g - r) > scale]


def _run_twice(name: str) -> dict[str, Any]:
    """One record of ``name``: run it twice (it must be deterministic) and return the first."""
    from tests.conftest import TINY

    overrides = [*TINY, *METHODS[name]]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        first = run_entry(f"configs/{name}.yaml", overrides, Path(tmp) / "a")
        t1 = time.perf_counter()
        second = run_entry(f"configs/{name}.yaml", overrides, Path(tmp) / "b")
    if first != second:
        raise SystemExit(f"{name}: NOT deterministic: {first} vs {second}")
    print(f"{name:18s} {first['outer_steps']:3d} steps  {first['sha256'][:16]}  {t1 - t0:5.2f} s", file=sys.stderr)
    own = {"statistics_rtol": METHOD_STATISTICS_RTOL[name]} if name in METHOD_STATISTICS_RTOL else {}
    return {"config": f"configs/{name}.yaml", "overrides": overrides, **first, **own}


def main(argv: list[str]) -> int:
    """``[--add-this-cpu] [method ...]``; see the module docstring."""
    from tests.data import pin_pydoc_topics
    from tests.data.kernel_fingerprint import kernel_description

    pin_pydoc_topics()  # the text the tests train on, not this Python's own (tests/data/__init__.py)

    add_cpu = "--add-this-cpu" in argv
    only = [a for a in argv if a != "--add-this-cpu"] or list(METHODS)
    unknown = [m for m in only if m not in METHODS]
    if unknown:
        print(f"unknown methods {unknown}; known: {list(METHODS)}", file=sys.stderr)
        return 2
    old = json.loads(RECORD.read_text()) if RECORD.exists() else {"methods": {}, "exact": {}}
    platform_now = platform_record()
    if (add_cpu or len(only) < len(METHODS)) and any(old.get(k) != platform_now[k] for k in COMPARABLE_ON):
        print("the record was taken with another torch, flwr, Python or corpus; regenerate all methods", file=sys.stderr)
        return 2
    cpu = kernel_description()
    exact = {fp: dict(entry, sha256=dict(entry["sha256"])) for fp, entry in old.get("exact", {}).items()}
    methods = {m: dict(r) for m, r in old.get("methods", {}).items()}
    if not add_cpu and len(only) == len(METHODS):
        exact, methods = {}, {}  # a full regeneration: the numbers changed, every CPU's bits are stale
    mine = exact.setdefault(cpu["fingerprint"], {**{k: v for k, v in cpu.items() if k != "fingerprint"}, "sha256": {}})
    for name in only:
        rec = _run_twice(name)
        sha = rec.pop("sha256")
        if add_cpu:
            drift = statistics_mismatch(rec["statistics"], methods[name]["statistics"], statistics_rtol(old, name))
            if drift or rec["outer_steps"] != methods[name]["outer_steps"]:
                print(f"{name}: this CPU's run is not within tolerance of the record: {drift}", file=sys.stderr)
                return 1
        else:
            methods[name] = rec
            for fp, entry in exact.items():  # other CPUs' bits for a re-recorded method are stale
                if fp != cpu["fingerprint"]:
                    entry["sha256"].pop(name, None)
        mine["sha256"][name] = sha
    record = {
        "about": "per method config on a tiny budget: float64 statistics of the final model, compared with "
                 "statistics_rtol on any CPU, and the sha256 of its fp32 bits per CPU kernel fingerprint "
                 "(tests/data/make_bit_identity.py)",
        **platform_now,
        "statistics_rtol": STATISTICS_RTOL,
        "methods": {m: methods[m] for m in METHODS if m in methods},
        "exact": {fp: dict(e, sha256={m: e["sha256"][m] for m in METHODS if m in e["sha256"]})
                  for fp, e in exact.items() if e["sha256"]},
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RECORD} (this CPU: {cpu})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
