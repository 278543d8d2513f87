"""Regenerate ``tests/data/bit_identity.json``: the sha256 of the final global model of every method.

Why: refactors of how ``fl-geo run`` builds its strategies (strategy classes, registries, message
protocol, client wrappers) must not change a single bit of what a method computes. This script
runs every method config in ``configs/`` on a tiny budget (``tests/conftest.py``'s ``TINY`` plus
the few overrides each config needs to validate and finish in a few seconds) through the function
``fl-geo run`` calls (``load_config`` then ``fl_geo.simulation.run_simulation``), runs each one
twice to check it is deterministic, and records the sha256 of the final fp32 flat ``params``
tensor saved in ``final_model.pt``. ``tests/test_bit_identity.py`` replays the records.

Regenerate (from the repository root, one process, a minute or two on a small CPU)::

    .venv/bin/python -m tests.data.make_bit_identity            # writes tests/data/bit_identity.json
    .venv/bin/python -m tests.data.make_bit_identity fedavg dips  # only re-record these methods

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
}


def pydoc_corpus_sha256() -> str:
    """The training text's digest: TINY trains on ``pydoc_data.topics``, which changes between
    Python releases, and then every hash changes with it although no code did."""
    from fl_geo.data.corpus import load_corpus

    return load_corpus("pydoc").sha256


def platform_record() -> dict[str, str]:
    """What the hashes depend on besides the code: float kernels differ across torch builds and
    CPUs, and the training text comes with the Python release."""
    import flwr
    import torch

    return {"torch": torch.__version__, "machine": platform.machine(), "flwr": flwr.__version__,
            "python": platform.python_version(), "pydoc_corpus_sha256": pydoc_corpus_sha256()}


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
    }


def main(argv: list[str]) -> int:
    from tests.conftest import TINY

    only = argv or list(METHODS)
    unknown = [m for m in only if m not in METHODS]
    if unknown:
        print(f"unknown methods {unknown}; known: {list(METHODS)}", file=sys.stderr)
        return 2
    old = json.loads(RECORD.read_text()) if RECORD.exists() else {"methods": {}}
    if argv and old.get("methods") and any(old.get(k) != v for k, v in platform_record().items()):
        print("the record was taken on another platform; regenerate all methods", file=sys.stderr)
        return 2
    methods = dict(old.get("methods", {})) if argv else {}
    for name in only:
        config = f"configs/{name}.yaml"
        overrides = [*TINY, *METHODS[name]]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            first = run_entry(config, overrides, Path(tmp) / "a")
            t1 = time.perf_counter()
            second = run_entry(config, overrides, Path(tmp) / "b")
        if first != second:
            print(f"{name}: NOT deterministic: {first} vs {second}", file=sys.stderr)
            return 1
        methods[name] = {"config": config, "overrides": overrides, **first}
        print(f"{name:18s} {first['outer_steps']:3d} steps  {first['sha256'][:16]}  {t1 - t0:5.2f} s", file=sys.stderr)
    record = {
        "about": "sha256 of the final fp32 flat params of each method config on a tiny budget; "
                 "regenerate only when a change is meant to change the numbers (tests/data/make_bit_identity.py)",
        **platform_record(),
        "methods": {m: methods[m] for m in METHODS if m in methods},
    }
    RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RECORD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
