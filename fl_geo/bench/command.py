"""``fl-geo bench``: routes to the benchmark named first; each benchmark module owns its options.

``outer`` is the outer step on the server path against memory bandwidth and Flower's FedAvg
(`fl_geo.bench.outer`); the others (``dispatch``, ``ps``, ``attack``, ``inner``, ``gpu``,
``flower-path``, ``compress``, ``site``: `_ROUTED`) hand the rest of the command line to their own modules, which are
imported only when asked for (they start processes or import Flower's simulation).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fl_geo.bench.outer import QUICK_PARAMS, run_outer_bench
from fl_geo.bench.outer_report import format_outer_bench
from fl_geo.runtime.wire import PRECISIONS

__all__ = ["main"]

# The benchmarks that own their options: name -> its help line. `main` hands the rest of the
# command line to ``fl_geo.bench.<name>.main`` (a dash in the name is an underscore in the module),
# importing that module only then: several start processes or import Flower's simulation.
_ROUTED: dict[str, str] = {
    "dispatch": "server overhead per update vs Flower's message cost (no-op client)",
    "ps": "sharded parameter server: follower memory, outer-step time, data path vs Flower",
    "attack": "one hostile site of four: honest vs undefended vs defended final loss",
    "inner": "inner loop tokens/s vs a plain torch loop; inner training's share of a simulation",
    "gpu": "accelerator check: Pythia-70M-shaped DiLoCo vs Di-PS, tokens/s, MFU, outer step",
    "flower-path": "Flower's own message path on a loopback SuperLink + SuperNode (MB/s each way)",
    "compress": "compression codecs on synthetic pseudo-gradients: bytes, encode/decode time, error, EF",
    "site": "multi-device site: per-round overhead of spawned ranks vs the persistent site group",
}


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench {outer,dispatch,ps,attack,inner,gpu,flower-path,compress,site} [...]`` (or ``python -m fl_geo.bench ...``);
    returns 1 only with --strict and a FAIL."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _ROUTED:  # a benchmark that owns its options gets the rest of the line
        module = importlib.import_module(f"fl_geo.bench.{argv[0].replace('-', '_')}")
        return module.main(argv[1:])
    parser = argparse.ArgumentParser(prog="fl-geo bench",
                                     description="fl-geo benchmarks")
    sub = parser.add_subparsers(dest="bench", required=True)
    outer = sub.add_parser("outer", help="one outer step on the server path vs Flower FedAvg")
    outer.add_argument("--params", type=int, default=100_000_000, help="model parameters")
    outer.add_argument("--updates", type=int, default=8, help="replies per outer step")
    outer.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    outer.add_argument("--quick", action="store_true",
                       help=f"{QUICK_PARAMS:,} parameters (overrides --params)")
    outer.add_argument("--repeats", type=int, default=3)
    outer.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    outer.add_argument("--no-flower", action="store_true", help="skip the Flower baseline")
    outer.add_argument("--strict", action="store_true", help="exit 1 if a target fails")
    for name, text in _ROUTED.items():  # listed in the help; parsed by their own modules
        sub.add_parser(name, add_help=False, help=text)
    args = parser.parse_args(argv)
    num_params = QUICK_PARAMS if args.quick else args.params
    result = run_outer_bench(num_params=num_params, num_updates=args.updates,
                             precision=args.precision, repeats=args.repeats,
                             threads=args.threads, with_flower=not args.no_flower)
    print(format_outer_bench(result))
    failed = not all(c["pass"] for c in result["checks"].values())
    return 1 if args.strict and failed else 0
