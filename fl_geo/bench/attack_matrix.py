"""``fl-geo bench attack --matrix``: turned updates × claims × client kinds × methods.

Every cell is one attacked run on the in-process grid (real ClientApps and Messages, one process,
one seed, the virtual clock for the asynchronous methods):

- **method**: DiLoCo (synchronous), Di-PS and FedBuff (asynchronous), each from its config under
  ``configs/bench/attack_matrix_*.yaml`` with the robust rule docs/robustness.md ("Which robust
  rule") names for it (`ROBUST`) and the default token cap;
- **hostile / n**: 1 of 4 or 2 of 8 sites (partitions 0 .. f − 1);
- **scale** s: each hostile reply is *turned and scaled*: θ_sent − s·(θ_local − θ_sent), i.e. an
  fl-geo client replies −s·Δ instead of its pseudo-gradient Δ = θ_sent − θ_local, a plain Flower
  client replies that model instead of its trained θ_local (`turned_reply_hook`);
- **claim**: ``honest`` (the site's true count), ``4096-device`` (an fl-geo site's profile answer
  says 4096 devices and its replies claim 4096 × its true tokens; a plain site, which has no
  profile, says ``devices: 4096`` in its reply and claims 4096 × its true ``num-examples``) or
  ``2^40`` (tokens / ``num-examples`` = 2**40);
- **client kind**: ``fl-geo`` (fl-geo's datacenter ClientApp) or ``plain`` (`plain_client_app`: a
  Flower-convention ClientApp around the same training, the trained model and ``num-examples``
  in its reply, no fl-geo declaration, no profile; the server is told ``clients="flower"``).

Each (method, n, kind) also has an honest run, the reference: a cell passes when its final
validation loss is at most `TARGET_RATIO` × the honest one. With ``undefended`` the ×3 and ×10
cells with 2^40 claims run once more with ``strategy.robust=none strategy.token_cap=none``: what
the defence is there for.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.bench.attack import rewritten_reply
from fl_geo.config import FlGeoConfig, load_config
from fl_geo.errors import ConfigError
from fl_geo.paths import CONFIGS_DIR

__all__ = ["CLAIMS", "KINDS", "METHODS", "ROBUST", "MatrixRun", "format_matrix", "markdown_table", "plain_client_app",
           "run_attack_matrix", "turned_reply_hook"]

TARGET_RATIO = 1.10
METHODS = ("diloco", "dips", "fedbuff")
SIZES = ((1, 4), (2, 8))
SCALES = (1.0, 3.0, 10.0)
CLAIMS = ("honest", "4096-device", "2^40")
KINDS = ("fl-geo", "plain")
DEVICES_CLAIM = 4096
HUGE_CLAIM = 2**40
# The documented robust setting per method (docs/robustness.md, "Which robust rule"): cosine for
# synchronous rounds (f < n/2 against turned updates of any norm), centered clipping for buffers.
ROBUST = {"diloco": "cosine", "dips": "cosine", "fedbuff": "cosine"}
UNDEFENDED = ("strategy.robust=none", "strategy.token_cap=none")
UNDEFENDED_SCALES = (3.0, 10.0)  # with 2^40 claims


def matrix_config(method: str) -> Path:
    return CONFIGS_DIR / "bench" / f"attack_matrix_{method}.yaml"


# ---- the plain Flower client ---------------------------------------------------------------------------

def plain_client_app() -> ClientApp:
    """A plain Flower ClientApp: the model in, the trained model and ``num-examples`` out.

    It trains with fl-geo's datacenter ClientApp (the same model, data partition and inner loop as
    the fl-geo kind, so the two kinds' honest runs are comparable), then replies the Flower way:
    θ_local = θ_sent − Δ in fp32 under ``"arrays"`` and ``num-examples`` (the sequences it trained
    on: its tokens / ``client.seq_len``) and ``train_loss`` in a MetricRecord, without fl-geo's
    reply declaration. It has no ``query`` handler: the server must run it as ``clients="flower"``.
    """
    from fl_geo.clients.datacenter import app as fl_geo_app
    from fl_geo.runtime.protocol import REQUEST_RECORD

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = fl_geo_app(msg, context)
        if reply.has_error():
            return reply
        decl = reply.content.config_records[REQUEST_RECORD]
        sent = msg.content.array_records["arrays"].to_torch_state_dict()
        out = reply.content.array_records["arrays"].to_torch_state_dict()
        if decl["payload"] == "pseudo_grad":  # fp32 both ways for a plain node (the matrix configs' wire)
            model = {k: sent[k].float() - out[k].float() for k in sent}
        else:
            model = {k: out[k].float() for k in sent}
        metrics = reply.content.metric_records["metrics"]
        seq_len = int(json.loads(str(msg.content.config_records[REQUEST_RECORD]["client"]))["seq_len"])
        examples = max(1, int(metrics["tokens"]) // seq_len)
        return Message(RecordDict({"arrays": ArrayRecord(model),
                                   "metrics": MetricRecord({"num-examples": examples,
                                                            "train_loss": float(metrics["train_loss"])})}),
                       reply_to=msg)

    return app


# ---- the hostile sites ---------------------------------------------------------------------------------

ReplyHook = Callable[[int, Message, Message], Message]


def turned_reply_hook(cfg: FlGeoConfig, hostile: Iterable[int], scale: float, claim: str) -> ReplyHook:
    """A reply hook for the in-process grid: every train reply of the nodes ``hostile`` (node ids)
    is turned and scaled, θ_sent − ``scale``·(θ_local − θ_sent), and carries ``claim``:

    - an fl-geo reply (declared ``pseudo_grad``): its Δ becomes −scale·Δ, re-encoded in the run's
      uplink precision; ``params``: the turned model; the claim goes into ``tokens``;
    - a Flower-convention reply (the trained model): θ_sent is the model of the request ``msg``
      (fp32, as a plain node is sent); the claim goes into ``num-examples``.

    ``claim``: ``honest`` (unchanged), ``2^40``, or ``4096-device``: 4096 × the true count, and the
    site says it has 4096 devices (an fl-geo node in its profile answer, a plain one in its reply
    metrics). Other replies pass untouched."""
    from fl_geo.core.state import ParamSpec
    from fl_geo.runtime.builders import make_model
    from fl_geo.runtime.protocol import PROFILE_KEY, declaration_of
    from fl_geo.runtime.wire import decode_into, encode

    if claim not in CLAIMS:
        raise ConfigError(f"claim must be one of {', '.join(CLAIMS)}, got {claim!r}")
    hostile = frozenset(hostile)
    spec = ParamSpec.from_state_dict(make_model(cfg.model, cfg.run.seed).state_dict())

    def claimed(true: int) -> int:
        return {"honest": true, "2^40": HUGE_CLAIM, "4096-device": DEVICES_CLAIM * true}[claim]

    def hook(node: int, msg: Message, reply: Message) -> Message:
        if node not in hostile or reply.has_error():
            return reply
        kind = msg.metadata.message_type
        if kind == "query" and claim == "4096-device" and PROFILE_KEY in reply.content.config_records:
            profile = dict(reply.content.config_records[PROFILE_KEY])
            profile["devices"] = DEVICES_CLAIM
            records = dict(reply.content.config_records.items())
            records[PROFILE_KEY] = ConfigRecord(profile)
            return Message(RecordDict(records), reply_to=msg)
        if kind != "train":
            return reply
        metrics = dict(reply.content.metric_records["metrics"])
        decl = declaration_of(reply)
        if decl is None:  # a Flower-convention reply: the trained model
            sent = msg.content.array_records["arrays"].to_torch_state_dict()
            local = reply.content.array_records["arrays"].to_torch_state_dict()
            turned = {k: sent[k].float() - scale * (local[k].float() - sent[k].float()) for k in sent}
            metrics["num-examples"] = claimed(int(metrics["num-examples"]))
            if claim == "4096-device":
                metrics["devices"] = DEVICES_CLAIM
            return Message(RecordDict({"arrays": ArrayRecord(turned), "metrics": MetricRecord(metrics)}), reply_to=msg)
        up = decode_into(reply.content.array_records["arrays"], spec, decl.precision)
        if decl.payload == "pseudo_grad":
            out = -scale * up
        elif decl.payload == "params":
            sent_flat = decode_into(msg.content.array_records["arrays"], spec, cfg.wire.down)
            out = sent_flat - scale * (up - sent_flat)
        else:
            raise ConfigError(f"the attack matrix turns pseudo_grad or params replies, not {decl.payload!r}")
        metrics["tokens"] = claimed(int(metrics["tokens"]))
        return rewritten_reply(msg, reply, encode(out, spec, decl.precision), metrics)

    return hook


# ---- one run -------------------------------------------------------------------------------------------

@dataclass
class MatrixRun:
    """One run of the matrix (``scale`` 0 and ``claim`` "-": the honest reference)."""

    method: str
    hostile: int
    n: int
    kind: str
    scale: float
    claim: str
    setting: str  # "robust=<rule>" or "undefended"
    final_val_loss: float
    rejected: int
    outer_steps: int
    wall_s: float
    honest_loss: float = float("nan")
    reasons: dict[str, int] = field(default_factory=dict)  # why updates were refused, by rule

    @property
    def ratio(self) -> float:
        return self.final_val_loss / self.honest_loss

    @property
    def passed(self) -> bool:
        return math.isfinite(self.ratio) and self.ratio <= TARGET_RATIO


# What refused an update, from the reason the server logs with it (strategies/base.py ``_reject``).
REASONS = (
    ("steps can produce", "token cap"),
    ("of the accepted claims so far", "claim bound"),
    ("claims this round", "claim bound"),
    ("strategy.robust=cosine", "cosine"),
    ("strategy.robust=median_norm", "median_norm"),
    ("strategy.max_update_ratio", "update bound"),
    ("outlier (z=", "penalty"),
    ("NaN or Inf", "non-finite"),
    ("non-finite", "non-finite"),
)


class _Reasons(logging.Handler):
    """Counts the server's ``rejected update from node ...`` warnings by the rule that refused."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not text.startswith("rejected update from node"):
            return
        self.counts[next((name for needle, name in REASONS if needle in text), "other")] += 1


def _run(cfg: FlGeoConfig, kind: str, hook_of: Callable[[list[int]], ReplyHook] | None) -> tuple[float, int, int, float,
                                                                                             dict[str, int]]:
    """Run ``cfg`` on an InlineGrid of ``kind`` clients; ``hook_of(node_ids)``: the reply hook."""
    from fl_geo.clients.datacenter import app as fl_geo_app
    from fl_geo.runtime.builders import make_model
    from fl_geo.runtime.evaluation import GlobalEvaluator
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.strategies import build_strategy

    grid = InlineGrid(fl_geo_app if kind == "fl-geo" else plain_client_app(), cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook_of(list(grid.get_node_ids())) if hook_of is not None else None
    strategy = build_strategy(cfg, evaluator=lambda num_partitions: GlobalEvaluator(cfg, num_partitions))
    if kind == "plain":
        strategy.clients = "flower"  # plain Flower ClientApps on every node: asked nothing, read as models
    initial = ArrayRecord(make_model(cfg.model, cfg.run.seed).state_dict())
    reasons = _Reasons()
    logger = logging.getLogger("fl_geo")
    logger.addHandler(reasons)
    t0 = time.perf_counter()
    try:
        strategy.start(grid, initial, num_rounds=cfg.run.rounds, timeout=cfg.strategy.round_timeout_s)
    finally:
        logger.removeHandler(reasons)
    stats = strategy.stats
    loss = stats.last.get("val/loss")
    return (float(loss) if loss is not None else float("nan"), int(stats.rejected), int(stats.outer_steps),
            time.perf_counter() - t0, dict(reasons.counts))


def _cells(methods: Sequence[str], sizes: Sequence[tuple[int, int]], scales: Sequence[float], claims: Sequence[str],
           kinds: Sequence[str], undefended: bool, rules: Mapping[str, str]) -> list[tuple[str, int, int, str, float, str, str]]:
    cells = []
    for method in methods:
        for f, n in sizes:
            for kind in kinds:
                for scale in scales:
                    for claim in claims:
                        cells.append((method, f, n, kind, scale, claim, f"robust={rules[method]}"))
                if undefended and "2^40" in claims:
                    cells.extend((method, f, n, kind, s, "2^40", "undefended") for s in UNDEFENDED_SCALES if s in scales)
    return cells


def run_attack_matrix(overrides: Sequence[str] = (), *, methods: Sequence[str] = METHODS,
                      sizes: Sequence[tuple[int, int]] = SIZES, scales: Sequence[float] = SCALES,
                      claims: Sequence[str] = CLAIMS, kinds: Sequence[str] = KINDS, undefended: bool = True,
                      rules: Mapping[str, str] | None = None, out: str | Path | None = None,
                      config_of: Callable[[str], str | Path | None] = matrix_config,
                      echo: Callable[[str], None] | None = None) -> list[MatrixRun]:
    """Run the matrix (see the module docstring); ``overrides`` apply to every run after the
    method's config; ``rules``: a robust rule per method in place of the documented one (`ROBUST`).
    Writes ``attack_matrix.json`` and ``attack_matrix.md`` (`markdown_table`) into ``out`` after
    every run (a partial matrix survives an interrupted one); ``echo`` gets one line per finished run."""
    for name, got, allowed in (("method", methods, METHODS), ("claim", claims, CLAIMS), ("client kind", kinds, KINDS)):
        bad = [g for g in got if g not in allowed]
        if bad:
            raise ConfigError(f"unknown {name} {bad}: choose from {', '.join(allowed)}")
    if set(rules or {}) - set(METHODS):
        raise ConfigError(f"--rule names no method of the matrix: {sorted(set(rules or {}) - set(METHODS))}")
    rules = {**ROBUST, **(rules or {})}
    for f, n in sizes:
        if not 1 <= f < n:
            raise ConfigError(f"{f} hostile of {n} sites: need 1 <= hostile < sites")
    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="fl-geo-attack-matrix-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[MatrixRun] = []
    honest: dict[tuple[str, int, str], float] = {}

    def config(method: str, n: int, extra: Sequence[str]) -> FlGeoConfig:
        return load_config(config_of(method), [f"run.num_clients={n}", *overrides, "run.backend=inline", *extra])

    def record(run: MatrixRun) -> None:
        results.append(run)
        (out_dir / "attack_matrix.json").write_text(json.dumps(
            [{**asdict(r), "ratio": r.ratio, "pass": r.passed} for r in results], indent=2, allow_nan=True))
        (out_dir / "attack_matrix.md").write_text(markdown_table(results) + "\n")
        if echo is not None:
            echo(format_row(run))

    for method, f, n, kind, scale, claim, setting in _cells(methods, sizes, scales, claims, kinds, undefended, rules):
        key = (method, n, kind)
        if key not in honest:  # the reference: no attacker, the method as configured (no robust rule)
            loss, rejected, steps, wall, reasons = _run(config(method, n, ()), kind, None)
            honest[key] = loss
            record(MatrixRun(method, 0, n, kind, 0.0, "-", "honest", loss, rejected, steps, wall, loss, reasons))
            # what the rule costs with no attacker (shown, not judged)
            loss, rejected, steps, wall, reasons = _run(config(method, n, (f"strategy.robust={rules[method]}",)), kind, None)
            record(MatrixRun(method, 0, n, kind, 0.0, "-", f"honest robust={rules[method]}", loss, rejected, steps,
                             wall, honest[key], reasons))
        extra = UNDEFENDED if setting == "undefended" else (f"strategy.robust={rules[method]}",)
        cfg = config(method, n, extra)

        def hook_of(nodes: list[int], cfg: FlGeoConfig = cfg, f: int = f, scale: float = scale,
                    claim: str = claim) -> ReplyHook:
            return turned_reply_hook(cfg, nodes[:f], scale, claim)  # InlineGrid: node i is partition i

        loss, rejected, steps, wall, reasons = _run(cfg, kind, hook_of)
        record(MatrixRun(method, f, n, kind, scale, claim, setting, loss, rejected, steps, wall, honest[key], reasons))
    return results


# ---- the table -----------------------------------------------------------------------------------------

HEADER = (f"{'method':<8} {'hostile':>7} {'clients':<7} {'scale':>5} {'claim':<11} {'setting':<20} "
          f"{'final val loss':>14} {'vs honest':>9} {'rejected':>8}  {'verdict':<7} refused by")


def format_row(r: MatrixRun) -> str:
    scale = f"x{r.scale:g}" if r.claim != "-" else "-"
    verdict = "-" if r.setting.startswith("honest") else "PASS" if r.passed else "FAIL"
    if r.setting == "undefended":
        verdict = f"({verdict})"  # shown for contrast: the target is the defended setting's
    why = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items())) or "-"
    return (f"{r.method:<8} {f'{r.hostile}/{r.n}':>7} {r.kind:<7} {scale:>5} {r.claim:<11} {r.setting:<20} "
            f"{r.final_val_loss:>14.4f} {r.ratio:>8.3f}x {r.rejected:>8d}  {verdict:<7} {why}")


def format_matrix(results: Sequence[MatrixRun], wall_s: float | None = None) -> str:
    lines = [HEADER, *(format_row(r) for r in results)]
    judged = [r for r in results if r.setting.startswith("robust=")]
    failed = [r for r in judged if not r.passed]
    lines.append(f"target: every defended cell <= {TARGET_RATIO:.2f} x its honest run: "
                 f"{len(judged) - len(failed)} of {len(judged)} pass" + (f", {len(failed)} FAIL" if failed else ""))
    if wall_s is not None:
        lines.append(f"{len(results)} runs in {wall_s:.0f} s")
    return "\n".join(lines)


SHORT = {"token cap": "cap", "claim bound": "claim", "cosine": "cos", "median_norm": "norm", "penalty": "pen",
         "update bound": "bound", "non-finite": "nan", "other": "other"}


def markdown_table(results: Sequence[MatrixRun]) -> str:
    """The matrix as one Markdown row per (method, hostile/n, client kind, scale): the honest
    run's loss, then per claim the ratio to it and the refused replies (by rule), then the
    undefended ratio with 2^40 claims where it was run. Bold: a defended cell above the target."""
    def cell(r: MatrixRun | None) -> str:
        if r is None:
            return "—"
        why = " ".join(f"{SHORT.get(k, k)} {v}" for k, v in sorted(r.reasons.items()))
        ratio = f"{r.ratio:.3f}" if r.passed or r.setting == "undefended" else f"**{r.ratio:.3f}**"
        return f"{ratio} ({why})" if why else ratio

    claims = [c for c in CLAIMS if any(r.claim == c for r in results)]
    rows = ["| method | hostile | clients | honest loss | scale | " + " | ".join(f"{c} claim" for c in claims)
            + " | undefended, 2^40 |", "|---" * (6 + len(claims)) + "|"]
    keys = dict.fromkeys((r.method, r.hostile, r.n, r.kind, r.scale) for r in results if r.claim != "-")
    for method, f, n, kind, scale in keys:
        mine = [r for r in results if (r.method, r.hostile, r.n, r.kind, r.scale) == (method, f, n, kind, scale)]
        defended = {r.claim: r for r in mine if r.setting.startswith("robust=")}
        undefended = next((r for r in mine if r.setting == "undefended"), None)
        rule = next(iter(defended.values())).setting if defended else ""
        rows.append(f"| {method} ({rule}) | {f} of {n} | {kind} | {mine[0].honest_loss:.4f} | ×{scale:g} | "
                    + " | ".join(cell(defended.get(c)) for c in claims) + f" | {cell(undefended)} |")
    return "\n".join(rows)


def matrix_passed(results: Sequence[MatrixRun]) -> bool:
    return all(r.passed for r in results if r.setting.startswith("robust="))
