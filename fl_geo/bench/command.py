"""``fl-geo bench``: routes to the benchmark named first; each benchmark module owns its options.

``outer`` is the outer step on the server path against memory bandwidth and Flower's FedAvg
(`fl_geo.bench.outer`); ``dispatch``, ``ps`` and ``flower-path`` hand the rest of the command
line to their own modules, which are imported only when asked for (they start processes or
import Flower's simulation).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fl_geo.bench.outer import QUICK_PARAMS, run_outer_bench
from fl_geo.bench.outer_report import format_outer_bench
from fl_geo.runtime.wire import PRECISIONS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``fl-geo bench {outer,dispatch,ps,attack,inner,gpu,flower-path} [...]`` (or ``python -m fl_geo.bench ...``);
    returns 1 only with --strict and a FAIL."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dispatch"]:  # server overhead per update; fl_geo.bench.dispatch owns its options
        from fl_geo.bench.dispatch import main as dispatch_main

        return dispatch_main(argv[1:])
    if argv[:1] == ["ps"]:  # the sharded parameter server on loopback; fl_geo.bench.ps owns its options
        from fl_geo.bench.ps import main as ps_main

        return ps_main(argv[1:])
    if argv[:1] == ["attack"]:  # one hostile site: honest / undefended / defended; fl_geo.bench.attack owns its options
        from fl_geo.bench.attack import main as attack_main

        return attack_main(argv[1:])
    if argv[:1] == ["inner"]:  # the inner loop vs plain torch, and its share of a simulation; fl_geo.bench.inner
        from fl_geo.bench.inner import main as inner_main

        return inner_main(argv[1:])
    if argv[:1] == ["gpu"]:  # the accelerator check (make gpu-check); fl_geo.bench.gpu owns its options
        from fl_geo.bench.gpu import main as gpu_main

        return gpu_main(argv[1:])
    if argv[:1] == ["flower-path"]:  # Flower's loopback deployment path; fl_geo.bench.flower_path owns its options
        from fl_geo.bench.flower_path import main as flower_path_main

        return flower_path_main(argv[1:])
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
    sub.add_parser("dispatch", add_help=False,
                   help="server overhead per update vs Flower's message cost (no-op client)")
    sub.add_parser("ps", add_help=False,
                   help="sharded parameter server: follower memory, outer-step time, data path vs Flower")
    sub.add_parser("attack", add_help=False,
                   help="one hostile site of four: honest vs undefended vs defended final loss")
    sub.add_parser("inner", add_help=False,
                   help="inner loop tokens/s vs a plain torch loop; inner training's share of a simulation")
    sub.add_parser("gpu", add_help=False,
                   help="accelerator check: Pythia-70M-shaped DiLoCo vs Di-PS, tokens/s, MFU, outer step")
    sub.add_parser("flower-path", add_help=False,
                   help="Flower's own message path on a loopback SuperLink + SuperNode (MB/s each way)")
    args = parser.parse_args(argv)
    num_params = QUICK_PARAMS if args.quick else args.params
    result = run_outer_bench(num_params=num_params, num_updates=args.updates,
                             precision=args.precision, repeats=args.repeats,
                             threads=args.threads, with_flower=not args.no_flower)
    print(format_outer_bench(result))
    failed = not all(c["pass"] for c in result["checks"].values())
    return 1 if args.strict and failed else 0
