"""``fl-geo``: run experiments, fetch the offline corpora, benchmark the server path.

    fl-geo run CONFIG [CONFIG ...] [key=value ...] [--out DIR [--resume]]
                                                     Flower simulation(s), then a summary table
    fl-geo compare [CONFIG ...] [key=value ...] [--runs DIR ...] [--seeds N] [--target LOSS] [--loss global|workers] [--metric loss|bpb] [--out DIR]
                                                     table + plots of several runs (N seeds: mean ± 95 % t interval)
    fl-geo sweep CONFIG key=a,b,c [key=value ...] [--seeds N] [--out DIR]   every combination, one table + plots
    fl-geo flwr-run [CONFIG] [key=value ...]         the same through Flower's CLI: flwr run . --stream
    fl-geo config CONFIG [key=value ...]             print the resolved configuration
    fl-geo eval RUN_DIR [--batches N] [--json]       a finished run's final model on its held-out text
    fl-geo sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
                                                     generate text with a finished run's final model
    fl-geo data fetch [--data-dir D] [NAME ...]      download + extract the pinned corpora
    fl-geo bench outer [--params N] [--updates K] [--precision P] [--quick]
    fl-geo place SCENARIO [--candidates R1,R2] [--json]   Di-PS cost model: which region hosts the PS
    fl-geo deploy certs|up|run|status|down ...       SuperLink + SuperNodes across sites (docs/deploy.md)
    fl-geo deploy halos-up|halos-run|halos-status|halos-down ...   HALoS's two tiers (docs/deploy.md)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from fl_geo.config import ConfigError, load_config, to_yaml
from fl_geo.deploy.command import add_parser as add_deploy_parser
from fl_geo.errors import OutputError
from fl_geo.runtime.interrupt import RunInterrupted

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments with '=' are overrides; the others are config files."""
    configs = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    return configs, overrides


def format_summary_table(summaries: list[dict[str, Any]]) -> str:
    """A plain Markdown table of finished runs (the compare tool builds on the same JSON); a
    failed run is marked FAILED in its row and its reason is listed under the table. ``virtual``
    is the modelled time (WAN + accelerators) of a run on a scenario, blank on the wall clock."""
    from fl_geo.runtime.progress import format_duration

    head = "| run | strategy | outer steps | final val loss | virtual | wall s | tokens | MB up | MB down | rejected |"
    rows = [head, "|" + "---|" * 10]
    notes = []
    for s in summaries:
        val = s.get("final_val_loss")
        name = s["name"] + (" FAILED" if s.get("failure") else "")
        if s.get("failure"):
            notes.append(f"- {s['name']} FAILED: {s['failure']}")
        virtual = format_duration(s["virtual_s"]) if s.get("virtual_s") is not None else ""
        loss = "n/a" if val is None else f"{val:.4f}"
        rows.append(
            f"| {name} | {s['strategy']} ({s['outer_optimizer']}) | {s['outer_steps']} | {loss} | {virtual} | "
            f"{s['wall_s']:.1f} | {s['tokens']:,} | {s['bytes_up'] / 1e6:.1f} | {s['bytes_down'] / 1e6:.1f} | "
            f"{s['rejected']} |"
        )
    return "\n".join(rows + ([""] + notes if notes else []))


def cmd_run(args: argparse.Namespace) -> int:
    from fl_geo.simulation import run_simulation

    configs, overrides = _split(args.items)
    if not configs:
        configs = [None]  # schema defaults (DiLoCo, 4 datacenters)
    resolved = [load_config(c, overrides) for c in configs]  # validate all before running any
    if args.resume:
        if not args.out:
            raise ConfigError("--resume needs --out: it looks for each run in OUT/<run.name>")
        from fl_geo.run_reuse import check_resumable

        check_resumable(resolved, args.out)  # every folder checked before the first run starts or moves
    summaries = []
    for cfg in resolved:
        run_dir = None
        if args.out:
            run_dir = Path(args.out) / cfg.run.name
        if args.resume:
            from fl_geo.run_reuse import plan_run

            plan = plan_run(cfg, run_dir)
            if plan.summary is not None:
                summaries.append(plan.summary)
                print(f"run {cfg.run.name}: finished earlier with this config: reused -> {run_dir}", file=sys.stderr)
                continue
            cfg = plan.cfg
        summary = run_simulation(cfg, run_dir)
        summaries.append(summary)
        if summary.get("interrupted"):
            print(f"fl-geo: run {cfg.run.name} interrupted after {summary['outer_steps']} outer step(s); "
                  f"results so far in {summary['run_dir']}", file=sys.stderr)
            return INTERRUPTED
        loss = summary.get("final_val_loss")
        print(f"run {cfg.run.name}: final val loss {'n/a' if loss is None else f'{loss:.4f}'} -> {summary['run_dir']}",
              file=sys.stderr)
    table = format_summary_table(summaries)
    print(table)
    if args.table:
        Path(args.table).write_text(table + "\n", encoding="utf-8")
    failed = [s for s in summaries if s.get("failure")]
    for s in failed:
        print(f"fl-geo: run {s['name']} FAILED: {s['failure']}", file=sys.stderr)
    return 1 if failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    """``fl-geo compare``: run the configs (``--seeds N`` times each), read ``--runs``, compare all."""
    from fl_geo.compare import compare, load_run
    from fl_geo.run_pool import run_in_parallel
    from fl_geo.run_reuse import check_resumable
    from fl_geo.seed_groups import group_by_seed_suffix, run_seeds, seeded_configs

    configs, overrides = _split(args.items)
    if args.seeds != 1 and not configs:
        raise ConfigError("--seeds runs each config N times; it needs config files (finished --runs named "
                          "<name>-seed=<k> are grouped by that suffix on their own)")
    resolved = [load_config(c, overrides) for c in configs]
    plans = [(cfg.run.name, seeded_configs(cfg, args.seeds)) for cfg in resolved]  # all checked before any run
    out = Path(args.out)
    planned = [c for _, cfgs in plans for c in cfgs]
    if args.resume:  # every planned run's folder checked before the first run starts or moves
        check_resumable(planned, out / "runs")
    runs = [load_run(p, args.loss, args.metric) for p in args.runs]
    groups = group_by_seed_suffix(runs)
    parallel = args.jobs > 1 and len(planned) > 1
    if parallel:  # each run its own `fl-geo run` process, --jobs at a time; then read them
        run_in_parallel(planned, out / "runs", args.jobs, args.resume)
    for name, cfgs in plans:
        group, _ = run_seeds(cfgs, out / "runs", name, args.loss, args.metric, resume=args.resume, ran=parallel)
        groups.append(group)
        runs += group.runs
    if not runs:
        raise ConfigError("fl-geo compare needs config files to run and/or --runs DIR ...")
    result = compare(runs, out, args.target, groups, args.reference)
    print(result["table"])
    for kind, path in result["plots"].items():
        print(f"plot ({kind}): {path}", file=sys.stderr)
    ran_failed = [r for r in runs[len(args.runs):] if r.summary.get("failure")]
    for r in ran_failed:
        print(f"fl-geo: run {r.name} FAILED: {r.summary['failure']}", file=sys.stderr)
    return 1 if ran_failed else 0  # finished runs read with --runs are marked in the table only


def cmd_sweep(args: argparse.Namespace) -> int:
    """``fl-geo sweep``: every combination of the swept keys, one table (fl_geo/sweep.py)."""
    from fl_geo.sweep import run_sweep

    configs, overrides = _split(args.items)
    if len(configs) > 1:
        raise ConfigError("fl-geo sweep takes one config file (plus key=value and key=a,b,c overrides)")
    result = run_sweep(configs[0] if configs else None, overrides, args.out, args.target, args.loss, args.seeds,
                       resume=args.resume, jobs=args.jobs)
    print(result["table"])
    print(f"table: {Path(args.out) / 'compare.md'}", file=sys.stderr)
    for kind, path in result["plots"].items():
        print(f"plot ({kind}): {path}", file=sys.stderr)
    failed = [s for s in result["summaries"] if s.get("failure")]
    for s in failed:
        print(f"fl-geo: run {s['name']} FAILED: {s['failure']}", file=sys.stderr)
    return 1 if failed else 0


def cmd_flwr_run(args: argparse.Namespace) -> int:
    """``fl-geo flwr-run``: the same app through ``flwr run`` on a local simulation SuperLink."""
    from fl_geo.deploy.local_run import flwr_run_local

    configs, overrides = _split(args.items)
    if len(configs) > 1:
        raise ConfigError("fl-geo flwr-run takes one config file (plus key=value overrides)")
    return flwr_run_local(configs[0] if configs else None, overrides)


def cmd_config(args: argparse.Namespace) -> int:
    configs, overrides = _split(args.items)
    if len(configs) > 1:
        raise ConfigError("fl-geo config takes one config file")
    print(to_yaml(load_config(configs[0] if configs else None, overrides)), end="")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``fl-geo eval``: the final model's validation loss, as the run's own evaluator computes it
    (and bits per byte, which the line shows where a token is not a byte)."""
    import json
    import math

    from fl_geo.results import evaluate_run

    res = evaluate_run(args.run_dir, args.batches)
    if args.json:
        print(json.dumps({"run_dir": str(res.run_dir), "val_loss": res.loss, "val_bpb": res.bpb, "tokens": res.tokens,
                          "batches": res.batches, "weights": str(res.weights)}))
    elif abs(res.bpb * math.log(2) - res.loss) <= 1e-9 * max(1.0, res.loss):  # byte-level: a token is a byte
        print(f"{res.run_dir}: val loss {res.loss:.4f} nats/byte ({res.tokens:,} tokens)")
    else:
        print(f"{res.run_dir}: val loss {res.loss:.4f} nats/token, {res.bpb:.4f} bits/byte ({res.tokens:,} tokens)")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    """``fl-geo sample``: the prompt and its continuation, bytes decoded with errors="replace"."""
    from fl_geo.data import ByteTokenizer
    from fl_geo.results import load_run_model, sample

    if not args.temperature >= 0:  # before loading anything
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    from fl_geo.runtime.builders import tokenizer

    model, cfg = load_run_model(args.run_dir)
    tok = None if cfg.data.tokenizer == "byte" else tokenizer(cfg.data)
    out = sample(model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, tokenizer=tok)
    print(ByteTokenizer().decode(out))
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from fl_geo.data.fetch import fetch_corpora

    names = tuple(args.names) or ("bible", "shakespeare")
    info = fetch_corpora(names, args.data_dir)
    for name, e in info.items():
        mb = e.get("bytes", 0) / 1e6
        groups = ", ".join(e.get("groups", []))
        print(f"{name}: {e.get('status')} - {e.get('documents')} documents, {mb:.1f} MB, groups {groups}; "
              f"text sha256 {str(e.get('text_sha256', ''))[:12]}... at {e.get('path')}")
    return 0


def cmd_place(args: argparse.Namespace) -> int:
    """``fl-geo place``: the Di-PS PS-placement scores of a scenario (docs/placement_and_schedule.md)."""
    import json

    from fl_geo.scenario_files import load_scenario
    from fl_geo.timing.placement import format_placement, place_from_scenario

    candidates = None
    if args.candidates is not None:
        candidates = [c.strip() for c in args.candidates.split(",") if c.strip()]
    placement = place_from_scenario(load_scenario(args.scenario), candidates)
    print(json.dumps(placement.to_dict(), indent=2) if args.json else format_placement(placement))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from fl_geo.bench.command import main as bench_main

    return int(bench_main(args.bench_argv) or 0)


RESUME_HELP = ("run the command again after an interruption: reuse the runs that finished in OUT/runs with the same "
               "config, continue interrupted ones from their newest checkpoint (configs with run.checkpoint_every), "
               "start again those that left none (their folder moved to <name>.interrupted-<time>); a folder "
               "holding another config's run is an error")


JOBS_HELP = ("run N runs at a time, each its own `fl-geo run` process (output in OUT/runs/.logs/<name>.log); give each "
             "run 1/N of the cores (run.sim_cpus), the same threads give the same bits as one at a time (default 1)")


def _add_experiment_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``run``, ``compare``, ``sweep`` and ``flwr-run``: the commands that train."""
    r = sub.add_parser("run", help="run one or more configs as Flower simulations")
    r.add_argument("items", nargs="*", help="config files and key=value overrides (applied to every config)")
    r.add_argument("--out", help="put each run in OUT/<run.name> instead of run.out_dir/<name>-<time> "
                   "(refused if it holds an earlier run's results, unless run.resume=true)")
    r.add_argument("--table", help="also write the summary table (Markdown) to this file")
    r.add_argument("--resume", action="store_true",
                   help="run the same command again after an interruption (needs --out): a run that finished in "
                        "OUT/<run.name> with the same config is reused, an interrupted one continues from its "
                        "newest checkpoint (configs with run.checkpoint_every), one that left none is moved to "
                        "<name>.interrupted-<time> and starts again; a folder holding another config's run is an "
                        "error naming the values that differ")
    r.set_defaults(func=cmd_run)

    cmp_ = sub.add_parser("compare", help="run configs and/or read finished runs; write a table and plots")
    cmp_.add_argument("items", nargs="*", help="config files to run and key=value overrides for them")
    cmp_.add_argument("--runs", nargs="*", default=[], help="finished run directories to include")
    cmp_.add_argument("--target", type=float, default=None, help="target val loss (default: the worst final loss)")
    cmp_.add_argument("--out", default="runs/compare", help="where compare.md and the PNG plots go")
    cmp_.add_argument("--loss", choices=("global", "workers"), default="global",
                      help="whose validation loss: the server's model (val/loss), or the workers' own "
                           "models where a streaming run logged them (val/worker_loss; streaming.eval_workers)")
    cmp_.add_argument("--metric", choices=("loss", "bpb"), default="loss",
                      help="tabulate and plot the validation loss (nats/token) or bits per byte (val/bpb: fair "
                           "across tokenizers; --target is then in bits per byte)")
    cmp_.add_argument("--seeds", type=int, default=1, metavar="N",
                      help="run every config N times, run.seed = its own seed + 0, 1, ..., N-1 (runs named "
                           "<run.name>-seed=<seed>); each row then shows the mean and the half-width of the "
                           "95 %% Student-t interval over the seeds, a difference counts only where the "
                           "intervals are disjoint, and the plots draw the mean with a min-max band "
                           "(default 1: one run, no interval)")
    cmp_.add_argument("--reference", metavar="NAME",
                      help="pair every other config with this one by seed (its run.name, without -seed=<k>): "
                           "the speed-up to its final loss and the relative final loss, each as a mean ± 95 %% "
                           "t interval over the seeds both ran")
    cmp_.add_argument("--resume", action="store_true", help=RESUME_HELP)
    cmp_.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    cmp_.set_defaults(func=cmd_compare)

    sw = sub.add_parser("sweep", help="run every combination of key=a,b,c values; one table and plots")
    sw.add_argument("items", nargs="+", help="a config file, key=a,b,c values to sweep and key=value overrides")
    sw.add_argument("--out", default="runs/sweep", help="where compare.md, the plots and runs/<name> go")
    sw.add_argument("--target", type=float, default=None, help="target val loss (default: the worst final loss)")
    sw.add_argument("--loss", choices=("global", "workers"), default="global", help="as for fl-geo compare")
    sw.add_argument("--seeds", type=int, default=1, metavar="N",
                    help="run every point of the grid N times (run.seed + 0..N-1): mean ± 95 %% Student-t "
                         "interval per point, as for fl-geo compare")
    sw.add_argument("--resume", action="store_true", help=RESUME_HELP)
    sw.add_argument("--jobs", type=int, default=1, metavar="N", help=JOBS_HELP)
    sw.set_defaults(func=cmd_sweep)

    fr = sub.add_parser("flwr-run", help="the same run through Flower's CLI (flwr run . --stream) on a local "
                                         "simulation SuperLink sized for the config, stopped afterwards")
    fr.add_argument("items", nargs="*", help="a config file (default configs/quickstart_diloco.yaml) and key=value overrides")
    fr.set_defaults(func=cmd_flwr_run)


def _add_finished_run_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``eval`` and ``sample``: the commands that read a finished run's final model."""
    ev = sub.add_parser("eval", help="validation loss of a finished run's final model (its own held-out text)")
    ev.add_argument("run_dir", help="a run directory (holds config.yaml and final_model.*)")
    ev.add_argument("--batches", type=int, default=None,
                    help="validation batches (default: the run's run.eval_batches, which reproduces its final val/loss)")
    ev.add_argument("--json", action="store_true", help="print a JSON object")
    ev.set_defaults(func=cmd_eval)

    sa = sub.add_parser("sample", help="generate text with a finished run's final model (byte-level)")
    sa.add_argument("run_dir", help="a run directory (holds config.yaml and final_model.*)")
    sa.add_argument("--prompt", required=True, help="text to continue")
    sa.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    sa.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    sa.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest bytes (0 = all)")
    sa.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    sa.set_defaults(func=cmd_sample)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fl-geo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    _add_experiment_parsers(sub)

    c = sub.add_parser("config", help="print a resolved config")
    c.add_argument("items", nargs="*")
    c.set_defaults(func=cmd_config)

    _add_finished_run_parsers(sub)

    d = sub.add_parser("data", help="offline corpora")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    f = dsub.add_parser("fetch", help="download (pinned, hash-checked) and extract corpora")
    f.add_argument("names", nargs="*", help="bible, shakespeare (default: both)")
    f.add_argument("--data-dir", default=None, help="default: $FL_GEO_DATA_DIR or ~/.cache/fl-geo/corpora")
    f.set_defaults(func=cmd_data)

    pl = sub.add_parser("place", help="Di-PS placement cost model: score each region as the PS host")
    pl.add_argument("scenario", help="scenario name (configs/scenarios/<name>.yaml) or YAML path")
    pl.add_argument("--candidates", default=None,
                    help="comma-separated candidate regions (default: every region of the scenario)")
    pl.add_argument("--json", action="store_true", help="print the scores, B and p as JSON")
    pl.set_defaults(func=cmd_place)

    b = sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks: `fl-geo bench outer --help` (one outer step vs memory bandwidth and Flower's FedAvg)",
    )
    b.set_defaults(func=cmd_bench)
    sn = sub.add_parser("site-node", help="node K > 0 of a site that spans nodes: run its ranks of the site group "
                                          "(docs/multidevice.md)")
    sn.add_argument("--rendezvous", required=True, help="host:port of the site's store (node 0's site-rendezvous)")
    sn.add_argument("--node-rank", required=True, help="this node's index in the site, 1..nodes-1")
    sn.add_argument("--devices", required=True, help="comma-separated devices, one rank each (cpu,cpu or cuda:0,cuda:1)")
    sn.set_defaults(func=cmd_site_node)
    add_deploy_parser(sub)
    return p


def cmd_site_node(args: argparse.Namespace) -> int:
    """`fl-geo site-node`: `python -m fl_geo.clients.site_node` (it runs until SIGTERM or Ctrl-C)."""
    from fl_geo.clients.site_node import main as site_node_main

    return site_node_main(["--rendezvous", args.rendezvous, "--node-rank", str(args.node_rank),
                           "--devices", args.devices])


def _configure_logging(verbose: bool) -> None:
    """Our own logger only: configuring the root logger would echo Flower's DEBUG records."""
    logger = logging.getLogger("fl_geo")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "bench" in argv[:2]:  # the benchmark module owns its own options
        args, rest = parser.parse_known_args(argv[: argv.index("bench") + 1])
        args.bench_argv = argv[argv.index("bench") + 1 :] or ["outer", "--help"]
    else:
        args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return args.func(args)
    except OutputError as exc:  # a ConfigError too, but no config key is wrong
        print(f"fl-geo: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"fl-geo: config error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted:
        print("fl-geo: interrupted before the first outer step; nothing was trained", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a run
        print("fl-geo: interrupted", file=sys.stderr)
        return INTERRUPTED
    except FileNotFoundError as exc:
        print(f"fl-geo: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
