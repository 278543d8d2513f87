"""``fl-geo bench attack``: one hostile site of four, with and without fl-geo's defences.

The attack (issue: bounded influence): the site of partition ``--attacker`` trains honestly, then
replies its update multiplied by ``--scale`` (negative: sign-flipped, so it pushes the model
uphill) and claims ``--claim`` tokens (0: its true count), so that under token weighting it would
own the mean. The same config runs five times on the in-process grid (real ClientApps and
Messages, one process, the same seed):

1. **honest**: no attacker: the reference loss;
2. **undefended**: the attack with ``strategy.token_cap=none`` and ``strategy.robust=none``
   (every claim trusted, no bound relative to the peers);
3. **token cap**: the attack with ``strategy.token_cap=job`` only;
4. **norm bound**: the attack with ``strategy.robust=median_norm`` only;
5. **defended**: both (what ``strategy.robust=median_norm`` gives next to the default cap).

It prints each run's final validation loss, its ratio to the honest run and the rejected
updates; the target is defended ≤ 1.05 × honest. Exit 1 with ``--strict`` when it is missed.

With ``--matrix`` it runs the matrix of `fl_geo.bench.attack_matrix` instead: 1 of 4 and 2 of 8
sites sending a turned update × 1, 3 and 10 with honest, 4096-device and 2^40 claims, through
fl-geo and plain Flower clients, for DiLoCo, Di-PS and FedBuff, each with its documented robust
rule; the target there is every defended cell ≤ 1.10 × its honest run.

Usage::

    fl-geo bench attack [CONFIG] [--scale -10] [--claim 1099511627776] [--attacker 0]
                        [--out DIR] [--strict] [KEY=VALUE ...]
    fl-geo bench attack --matrix [--methods diloco,dips,fedbuff] [--sizes 1/4,2/8] [--scales 1,3,10]
                        [--claims honest,4096-device,2^40] [--kinds fl-geo,plain] [--rule METHOD=RULE]
                        [--no-undefended]
                        [--out DIR] [--strict] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fl_geo.config import FlGeoConfig, load_config
from fl_geo.errors import ConfigError
from fl_geo.paths import CONFIGS_DIR

__all__ = ["AttackResult", "hostile_reply_hook", "main", "rewritten_reply", "run_attack_bench"]

DEFAULT_CONFIG = CONFIGS_DIR / "bench" / "attack_diloco.yaml"
TARGET_RATIO = 1.05

ReplyHook = Callable[[int, Message, Message], Message]


def rewritten_reply(msg: Message, reply: Message, arrays: ArrayRecord, metrics: dict[str, Any]) -> Message:
    """``reply`` to ``msg`` as a hostile site sends it: ``arrays`` and ``metrics`` in place of its
    own, its config records kept (an fl-geo reply's declaration of what ``arrays`` holds), so the
    server reads it as it would have read the honest one. Shared by the attack hooks here and in
    `fl_geo.bench.attack_matrix`."""
    records: dict[str, Any] = {"arrays": arrays, "metrics": MetricRecord(metrics)}
    records.update(reply.content.config_records.items())
    return Message(RecordDict(records), reply_to=msg)


def hostile_reply_hook(cfg: FlGeoConfig, attacker: int, scale: float, claim: int) -> ReplyHook:
    """A reply hook for the in-process grid: the train replies of partition ``attacker`` carry
    their update × ``scale`` (decoded and re-encoded in the run's uplink precision, so the reply
    stays well-formed) and claim ``claim`` tokens (0: their true count); every other reply
    passes untouched."""
    from fl_geo.core.state import ParamSpec
    from fl_geo.runtime.builders import make_model
    from fl_geo.runtime.wire import decode_into, encode

    spec = ParamSpec.from_state_dict(make_model(cfg.model, cfg.run.seed).state_dict())
    precision = cfg.wire.up

    def hook(node: int, msg: Message, reply: Message) -> Message:
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        metrics = dict(reply.content.metric_records["metrics"])
        if metrics.get("partition_id") != attacker:
            return reply
        flat = decode_into(reply.content.array_records["arrays"], spec, precision)
        if claim:
            metrics["tokens"] = claim
        return rewritten_reply(msg, reply, encode(flat * scale, spec, precision), metrics)

    return hook


@dataclass
class AttackResult:
    """One run of the benchmark."""

    name: str
    final_val_loss: float
    rejected: int
    outer_steps: int
    wall_s: float


def _run(cfg: FlGeoConfig, run_dir: Path, name: str, hook: ReplyHook | None) -> AttackResult:
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    t0 = time.perf_counter()
    summary = run_server(grid, cfg, run_dir / name)
    return AttackResult(name, float(summary["final_val_loss"]), int(summary["rejected"]),
                        int(summary["outer_steps"]), time.perf_counter() - t0)


def run_attack_bench(config: str | Path | None, overrides: Sequence[str] = (), *, attacker: int = 0, scale: float = -10.0,
                     claim: int = 2**40, out: str | Path | None = None) -> list[AttackResult]:
    """Run the honest run of ``config`` and the attacked runs under each defence (see the module
    docstring); ``config`` None: the defaults plus ``overrides``."""
    base = [*overrides, "run.backend=inline"]
    honest_cfg = load_config(config, base)
    if not 0 <= attacker < honest_cfg.run.num_clients:
        raise ConfigError(f"--attacker {attacker} is not a partition of the run's {honest_cfg.run.num_clients} sites")
    defences = {
        "undefended": ("strategy.token_cap=none", "strategy.robust=none"),
        "token cap": ("strategy.token_cap=job", "strategy.robust=none"),
        "norm bound": ("strategy.token_cap=none", "strategy.robust=median_norm"),
        "defended": ("strategy.token_cap=job", "strategy.robust=median_norm"),
    }
    run_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="fl-geo-attack-"))
    results = [_run(honest_cfg, run_dir, "honest", None)]
    for name, extra in defences.items():
        cfg = load_config(config, [*base, *extra])
        results.append(_run(cfg, run_dir, name.replace(" ", "_"), hostile_reply_hook(cfg, attacker, scale, claim)))
        results[-1].name = name
    (run_dir / "attack.json").write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return results


def format_attack_bench(results: Sequence[AttackResult], scale: float, claim: int) -> str:
    honest = results[0].final_val_loss
    claimed = f"claims {claim} tokens" if claim else "claims its true token count"
    lines = [f"one site of the run sends its update x {scale:g} and {claimed}",
             f"{'run':<12} {'final val loss':>15} {'vs honest':>10} {'rejected':>9} {'outer steps':>12} {'wall s':>7}"]
    for r in results:
        lines.append(f"{r.name:<12} {r.final_val_loss:>15.4f} {r.final_val_loss / honest:>9.3f}x "
                     f"{r.rejected:>9d} {r.outer_steps:>12d} {r.wall_s:>7.1f}")
    ratio = results[-1].final_val_loss / honest
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    lines.append(f"target: defended <= {TARGET_RATIO:.2f} x honest: {ratio:.3f}x {verdict}")
    return "\n".join(lines)


def _matrix_main(args: argparse.Namespace, overrides: list[str]) -> int:
    from fl_geo.bench import attack_matrix as m

    def items(text: str) -> list[str]:
        return [t.strip() for t in text.split(",") if t.strip()]

    try:
        sizes = [(int(f), int(n)) for f, n in (s.split("/") for s in items(args.sizes))]
        scales = [float(s) for s in items(args.scales)]
        rules = dict(r.split("=", 1) for r in args.rule)
    except ValueError:
        raise ConfigError(f"--sizes takes HOSTILE/SITES pairs (1/4,2/8), --scales numbers, --rule METHOD=RULE; got "
                          f"{args.sizes!r}, {args.scales!r}, {args.rule!r}") from None
    print(m.HEADER, flush=True)
    t0 = time.perf_counter()
    results = m.run_attack_matrix(overrides, methods=items(args.methods), sizes=sizes, scales=scales,
                                  claims=items(args.claims), kinds=items(args.kinds), undefended=not args.no_undefended,
                                  rules=rules, out=args.out, echo=lambda line: print(line, flush=True))
    print(format_matrix_summary(results, time.perf_counter() - t0), flush=True)
    return 1 if args.strict and not m.matrix_passed(results) else 0


def format_matrix_summary(results: Sequence[Any], wall_s: float) -> str:
    """The whole table again (in run order) under the rows printed as they finished, and the verdict."""
    from fl_geo.bench.attack_matrix import format_matrix

    return "\n" + format_matrix(results, wall_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fl-geo bench attack",
                                     description="one hostile site: honest, undefended and defended runs; "
                                                 "--matrix: turned updates x claims x client kinds x methods")
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="run config (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides")
    parser.add_argument("--attacker", type=int, default=0, help="partition id of the hostile site")
    parser.add_argument("--scale", type=float, default=-10.0, help="factor on the hostile update (negative: flipped)")
    parser.add_argument("--claim", type=int, default=2**40, help="tokens the hostile site claims (0: its true count)")
    parser.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if the target is missed")
    matrix = parser.add_argument_group("the matrix (--matrix; CONFIG is then not used, KEY=VALUE apply to every run)")
    matrix.add_argument("--matrix", action="store_true", help="run the attack matrix (fl_geo.bench.attack_matrix)")
    matrix.add_argument("--methods", default="diloco,dips,fedbuff")
    matrix.add_argument("--sizes", default="1/4,2/8", help="HOSTILE/SITES pairs")
    matrix.add_argument("--scales", default="1,3,10", help="the turned update's scale s")
    matrix.add_argument("--claims", default="honest,4096-device,2^40")
    matrix.add_argument("--kinds", default="fl-geo,plain", help="client kinds")
    matrix.add_argument("--rule", action="append", default=[], metavar="METHOD=RULE",
                        help="another strategy.robust for METHOD than the documented one (repeatable)")
    matrix.add_argument("--no-undefended", action="store_true",
                        help="skip the undefended runs (x3 and x10 with 2^40 claims)")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if "=" in args.config:  # only overrides were given
        overrides.insert(0, args.config)
        args.config = str(DEFAULT_CONFIG)
    if args.matrix:
        if args.config != str(DEFAULT_CONFIG):
            raise ConfigError("--matrix runs configs/bench/attack_matrix_<method>.yaml; give KEY=VALUE overrides, "
                              "not a config")
        return _matrix_main(args, overrides)
    results = run_attack_bench(args.config, overrides, attacker=args.attacker, scale=args.scale, claim=args.claim,
                               out=args.out)
    print(format_attack_bench(results, args.scale, args.claim), flush=True)
    ok = results[-1].final_val_loss <= TARGET_RATIO * results[0].final_val_loss
    return 1 if args.strict and not ok else 0
