"""What every outer loop holds and does the same way, synchronous or asynchronous.

The global model (one fp32 flat buffer, stepped in place), the outer optimizer, the one running
sum, the counters a run summary reports, the profile-aware node bookkeeping, rejection logging and
server-side evaluation. The loops differ only in when they step and whom they send work to.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fl_geo.config import FlGeoConfig, schedule_length, section_to_json, to_dict, warmup_length
from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.claims import ClaimBound
from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.penalty import Penalty
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.dispatch import NODE_DOWN, Dispatcher, JobTiming, NodeProfile, late_report
from fl_geo.runtime.evaluation import GlobalEvaluator
from fl_geo.runtime.metrics import MetricsLogger
from fl_geo.runtime.profiling import probe_timeout_s, profile_nodes
from fl_geo.runtime.protocol import (
    REQUEST_RECORD,
    USER_CONFIG_RECORD,
    EvaluateRequest,
    Request,
    user_config,
)
from fl_geo.runtime.wire import encode
from fl_geo.strategies.replies import ReplyError, Tally, TrainReply, metric_number, metric_whole
from fl_geo.strategies.server_model import ServerModel

log = logging.getLogger("fl_geo")

CHECKPOINT_FORMAT = 1
# An asynchronous loop stops sending jobs to a node after this many failed jobs in a row.
MAX_CONSECUTIVE_ERRORS = 3


class NoLiveNode(RuntimeError):
    """Raised inside a round when no node is left to train on; `run` turns it into `OuterLoop.stop`."""


def client_config_record(cfg: FlGeoConfig) -> dict[str, Any]:
    """The part of the run config every ClientApp needs, as ConfigRecord scalars.

    The server is the single source of truth: clients never read config files, so a deployment
    across sites cannot drift out of sync with the experiment definition.
    """
    return {
        "run_name": cfg.run.name,  # names the node's on-disk inner state (node config state-dir)
        "state_dir": cfg.run.client_state_dir,
        "inner_steps": cfg.strategy.inner_steps,
        "schedule_total": schedule_length(cfg),
        "wire_up": cfg.wire.up,
        "wire_down": cfg.wire.down,
        # inline clients run one at a time in this process and may use every core
        "threads": cfg.run.sim_cpus if cfg.run.backend == "inline" else cfg.run.threads_per_client,
        "seed": cfg.run.seed,
        "client": json.dumps({**to_dict(cfg.client), "warmup_steps": warmup_length(cfg)}, sort_keys=True),
        "model": section_to_json(cfg.model),
        "data": data_section_json(cfg),
    }


def data_section_json(cfg: FlGeoConfig) -> str:
    """The ``data`` section for the ClientApps; with a tokenizer other than bytes it also carries
    ``tokenizer_sha256``, the server's tokenizer identity, which every ClientApp compares with the
    tokenizer it built (a node with another tokenizer.json or cache would train on other ids)."""
    if cfg.data.tokenizer == "byte":
        return section_to_json(cfg.data)
    from fl_geo.runtime.builders import tokenizer

    return json.dumps({**to_dict(cfg.data), "tokenizer_sha256": tokenizer(cfg.data).sha256}, sort_keys=True)


def penalty_from_config(cfg: FlGeoConfig, spec: ParamSpec) -> Penalty | None:
    """The pseudo-gradient penalty of docs/algorithms.md §4, or None when ``penalty.enabled`` is off.

    ``penalty.outlier: false`` (an ablation switch) keeps the statistics but never rejects.
    """
    p = cfg.penalty
    if not p.enabled:
        return None
    return Penalty(
        spec, granularity=p.granularity, rule=p.rule,
        threshold=p.threshold, warmup=p.warmup, reject=p.outlier,
        keying=p.keying, weighting=p.weighting.split("*"),
        temperature="auto" if p.temperature == 0 else p.temperature,
        clip=p.clip or None, clip_mode=p.clip_mode, clip_ratio=p.clip_ratio,
        adaptive_threshold=p.adaptive_threshold,
    )


class OuterLoop:
    """Shared state and helpers of `SyncOuterLoop` and `AsyncOuterLoop`."""

    # Whether a plain Flower ClientApp (model in, trained model out) can take part. Not for
    # loops whose workers must keep their own model between messages (streaming) or move the
    # model on fl-geo's own data path (the sharded parameter server over gRPC).
    supports_plain_clients: ClassVar[bool] = True
    # Why not, in the one-line error a run with plain nodes gets (strategy.py).
    plain_clients_refusal: ClassVar[str] = ("its workers keep their own model between messages or use fl-geo's data "
                                            "path")

    def __init__(
        self,
        cfg: FlGeoConfig,
        spec: ParamSpec,
        global_params: torch.Tensor,
        dispatcher: Dispatcher,
        profiles: dict[int, NodeProfile],
        logger: MetricsLogger,
        evaluator: GlobalEvaluator | None,
        scenario: Any | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.dispatcher = dispatcher
        self.profiles = profiles
        self.logger = logger
        self.evaluator = evaluator
        self.scenario = scenario  # set with a virtual clock (fl_geo.timing.scenario.Scenario)
        self.model = self.server_model(cfg, global_params)
        self.version = 0  # outer steps applied
        self.total_tokens = 0
        self.total_bytes_up = 0
        self.total_bytes_down = 0
        self.total_rejected = 0
        self.total_accepted = 0
        self.total_failed = 0  # jobs that errored, vanished or timed out (logged steps; see failed_jobs)
        # Why the loop stopped before its budget (e.g. every node benched); None when it ran out.
        self.stop_reason: str | None = None
        self._client_cfg = client_config_record(cfg)
        self.history: list[dict[str, Any]] = []
        self.penalty = penalty_from_config(cfg, spec)
        self._clip_last: tuple[float, list[float]] | None = None  # the last outer step's clip (clip_metrics)
        self.checkpoints: CheckpointStore | None = None  # set by the server when checkpointing is on
        self._bound: float | None = None
        self._bound_version = -1
        self.resumed = False
        # Set by the public strategy's start(): nodes may run a plain Flower ClientApp (they are
        # probed, fl_geo.runtime.profiling; accepted only outside the CLI path), and the user's
        # Flower train_config / evaluate_config that every request carries for them.
        self.accept_plain = False
        self.plain_only = False  # every node is a plain Flower ClientApp: joiners are not queried
        self.user_train_config: ConfigRecord | None = None
        self.user_evaluate_config: ConfigRecord | None = None
        self._errors: dict[int, int] = {}  # consecutive failed jobs per node
        self.claims = ClaimBound()  # plain Flower replies' num-examples against the accepted ones
        self.benched: set[int] = set()  # nodes that get no more jobs
        # A failure trace (virtual clock) names nodes by scenario slot = partition id.
        dispatcher.slot_of = self.partition_of

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        """The model part this loop steps: by default the strategy's outer optimizer over all of θ
        and a model-sized sum. Loops whose outer state lives in their own parts return
        `ServerModel.held_elsewhere`. Called once, from ``__init__``, before the loop's own set-up."""
        return ServerModel.from_config(cfg, global_params)

    @property
    def global_params(self) -> torch.Tensor:
        """θ: the fp32 flat buffer the outer step updates in place."""
        return self.model.params

    @property
    def optimizer(self) -> OuterOptimizer:
        return self.model.optimizer

    @property
    def accumulator(self) -> WeightedAccumulator:
        return self.model.accumulator

    def free_nodes(self, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Live nodes with no job in flight, in rank order; nodes seen for the first time are
        asked what they run first (`fl_geo.runtime.profiling.profile_nodes`; under ``"auto"`` the
        profile probe carries the current model). A late node (its job given up at its deadline)
        is busy until its reply comes; a reply that has come frees it here."""
        self.dispatcher.collect_late()
        live = self.dispatcher.live_nodes()
        membership = self.dispatcher.membership
        busy = self.dispatcher.busy_nodes()
        unknown = [n for n in live if n not in self.profiles and not membership.waiting(n) and n not in busy]
        if unknown:
            clients = "flower" if self.plain_only else "auto" if self.accept_plain else "fl-geo"
            s, r = self.cfg.strategy, self.cfg.run
            timeout_s = probe_timeout_s(s.round_timeout_s, r.wait_nodes_timeout_s) if clients == "auto" else 60.0
            self.profiles.update(profile_nodes(self.dispatcher, unknown, clients,
                                               lambda: encode(self.global_params, self.spec, "fp32"),
                                               self.user_train_config, timeout_s, known=self.profiles))
        busy = self.dispatcher.busy_nodes() | set(exclude)
        nodes = [n for n in live if n in self.profiles and n not in busy]
        return sorted(nodes, key=lambda n: self.profiles[n].rank)

    def request_records(self, request: Request, user: ConfigRecord | None) -> dict[str, ConfigRecord]:
        """The records a request travels in: the typed fl-geo request under ``"fl-geo"`` (built, so
        validated, before anything is sent) and the user's Flower config under ``"config"``."""
        return {REQUEST_RECORD: request.to_record(), USER_CONFIG_RECORD: user_config(user)}

    def is_plain(self, node: int) -> bool:
        """A node running a plain Flower ClientApp (it replies the trained model, not Δ)."""
        profile = self.profiles.get(node)
        return profile is not None and not profile.fl_geo_client

    def step_tokens(self, node: int) -> int | None:
        """The token cap of one inner step of ``node``: client.batch_size × client.seq_len × the
        site's devices: its profile's (else client.devices), at most what the server's operator
        allows a site (``strategy.site_devices``; 0: client.devices). The profile is the site's
        own answer, so it may lower its cap, never raise it past the operator's: a profile
        claiming 4096 devices buys no more weight than ``site_devices`` of them. A reply claiming
        more tokens than its steps can produce is refused, so a token-weighted mean cannot be
        owned by one claim. None (trust the claim) with ``strategy.token_cap=none`` and for a
        plain Flower ClientApp, whose examples are counted by its own code."""
        if self.cfg.strategy.token_cap == "none" or self.is_plain(node):
            return None
        allowed = self.cfg.strategy.site_devices or self.cfg.client.devices
        profile = self.profiles.get(node)
        claimed = profile.devices if profile is not None and profile.devices else self.cfg.client.devices
        return self.cfg.client.batch_size * self.cfg.client.seq_len * min(claimed, allowed)

    def arrays_for(self, node: int, wire_arrays: Any, flat: torch.Tensor) -> Any:
        """The model record for ``node``: the wire-precision ``wire_arrays``, or for a plain
        Flower ClientApp the fp32 model (Flower's convention; it knows no bf16 int16 view)."""
        if not self.is_plain(node) or self.cfg.wire.down == "fp32":
            return wire_arrays
        return encode(flat, self.spec, "fp32")

    def base_snapshot(self, node: int, flat: torch.Tensor) -> torch.Tensor | None:
        """The model a job is sent with, kept only for a plain Flower ClientApp: its reply is the
        trained model, and Δ = θ_sent − θ_reply needs θ_sent after the server has moved on. One
        model-sized copy per such job in flight; fl-geo clients reply Δ and cost nothing."""
        return flat.clone() if self.is_plain(node) else None

    def update_bound(self) -> float | None:
        """The largest update norm accepted (``strategy.max_update_ratio`` × max(‖θ‖, 1)), or None.
        Computed once per model version."""
        ratio = self.cfg.strategy.max_update_ratio
        if not ratio:
            return None
        if self._bound_version != self.version or self._bound is None:
            self._bound = ratio * max(float(torch.linalg.vector_norm(self.global_params)), 1.0)
            self._bound_version = self.version
        return self._bound

    def job_failed(self, tally: Tally, node: int, ok: bool, error: str | None = None) -> bool:
        """Count an error reply or a vanished node's job; after `MAX_CONSECUTIVE_ERRORS` in a row
        the node is benched (no more jobs). A good reply clears the node's count. True when the
        job failed (nothing to fold). A job lost to the scenario's failure trace (``error`` is
        `NODE_DOWN`) counts as failed but never benches: the node is repaired, not faulty."""
        if ok:
            self._errors.pop(node, None)
            return False
        tally.errors += 1
        if error == NODE_DOWN:
            return True
        self._errors[node] = self._errors.get(node, 0) + 1
        if self._errors[node] >= MAX_CONSECUTIVE_ERRORS:
            log.warning("node %s failed %d jobs in a row; no more jobs go to it", node, self._errors[node])
            self.benched.add(node)
        return True

    def claims_bounded(self) -> bool:
        """Whether plain replies' example claims are judged (`bound_claims`): not with
        ``strategy.token_cap=none``, which trusts every claim."""
        return self.cfg.strategy.token_cap != "none"

    def bound_claims(self, tally: Tally, items: Sequence[tuple[int, TrainReply]],
                     whole_round: bool = False) -> list[tuple[int, TrainReply]]:
        """Refuse (logged, counted) the plain replies whose ``num-examples`` claim is beyond
        `ClaimBound` (fl_geo.core.claims: 4 × the median of the accepted claims; before any,
        4 × the median of the round's claims when ``whole_round`` holds at least 3) and record
        the claims that pass, by partition. fl-geo replies pass untouched: the token cap bounds
        them. The kept items keep their order (the fold's bits depend on it)."""
        if not self.claims_bounded():
            return list(items)
        round_claims = [r.tokens for _, r in items if r.plain] if whole_round else []
        kept = []
        for node, r in items:
            reason = self.claims.judge(r.tokens, round_claims) if r.plain else None
            if reason is not None:
                self._reject(tally, node, reason)
                continue
            kept.append((node, r))
        for node, r in kept:
            if r.plain:
                site = self.partition_of(node)  # -1: a node that answered no profile
                self.claims.accepted(site if site >= 0 else f"node {node}", r.tokens)
        return kept

    def _reject(self, tally: Tally, node: int, reason: str) -> None:
        """Log a rejected update with its node, partition and reason, and count it."""
        part = self.profiles[node].partition_id if node in self.profiles else -1
        log.warning("rejected update from node %s (partition %s): %s", node, part, reason)
        tally.rejected += 1
        if self.dispatcher.goodput is not None:
            self.dispatcher.goodput.verdict(node)

    def _virtual_zero(self) -> dict[str, float]:
        """``time/virtual_s`` = 0 for the step-0 record, only when the run has a virtual clock."""
        return {"time/virtual_s": 0.0} if self.dispatcher.clock.is_virtual else {}

    def _virtual_now(self) -> float:
        clock = self.dispatcher.clock
        return clock.now() if clock.is_virtual else float("nan")

    def evaluate(self) -> dict[str, float]:
        """Server-side evaluation of the global model (fl-geo's held-out text, or a Flower user's
        ``evaluate_fn``): ``val/loss`` and whatever else the evaluator reports."""
        if self.evaluator is None:
            return {}
        return self.evaluator.metrics(self.global_params, self.version)

    def client_eval(self, rnd: int) -> dict[str, float]:
        """Each free node's validation loss of the global model on its own partition,
        token-weighted (``run.client_eval_every``)."""
        nodes = self.free_nodes()
        arrays = encode(self.global_params, self.spec, self.cfg.wire.down)
        records = self.request_records(EvaluateRequest(**self._client_cfg, round=rnd, base_version=self.version),
                                      self.user_evaluate_config)
        msgs = [Message(RecordDict({"arrays": self.arrays_for(n, arrays, self.global_params), **records}), dst_node_id=n,
                        message_type=MessageType.EVALUATE) for n in nodes]
        losses = self.collect_val_losses(msgs, nodes)
        tokens = sum(t for _, t in losses)
        return {"val/client_loss": sum(v * t for v, t in losses) / tokens} if tokens else {}

    def collect_val_losses(self, msgs: list[Message], nodes: list[int]) -> list[tuple[float, int]]:
        """Send evaluation messages (one per node, in ``nodes`` order) and return each good
        reply's ``(val_loss, val_tokens)``; a missing or non-finite figure is logged and skipped.

        The jobs cost no modelled time (`JobTiming.free`): evaluating is a measurement, and on a
        virtual clock it must not move the time axis the loss is plotted against.
        """
        out: list[tuple[float, int]] = []

        def keep(group: Sequence[tuple[int, Message]]) -> None:
            for node, reply in group:
                m = reply.content.metric_records.get("metrics")
                if m is None or "val_loss" not in m or "val_tokens" not in m:
                    log.warning("evaluate reply from node %s lacks val_loss/val_tokens; ignored", node)
                    continue
                try:  # the same checks as a train reply's scalars: a lie is skipped, never a crash
                    out.append((metric_number(m, "val_loss"), metric_whole(m, "val_tokens", 1)))
                except ReplyError as exc:
                    log.warning("evaluate reply from node %s ignored: %s", node, exc)

        timings = [JobTiming(self.profiles[n].partition_id if n in self.profiles else 0, free=True) for n in nodes]
        self.dispatcher.run_jobs(msgs, on_replies=keep, order=nodes, timeout_s=self.cfg.strategy.round_timeout_s,
                                 timings=timings)
        return out

    def late_nodes(self) -> list[dict[str, Any]]:
        """Who was late this run (`fl_geo.runtime.dispatch.late_report`); summary.json reports
        this list as ``late_nodes``."""
        return late_report(self.dispatcher.late, self.profiles)

    def failed_jobs(self) -> int:
        """Failed jobs so far: those of logged steps plus those still in an unlogged tally (an
        asynchronous loop whose nodes all failed before its first step logs none)."""
        pending = getattr(self, "tally", None)
        return self.total_failed + (pending.errors if isinstance(pending, Tally) else 0)

    def stop(self, reason: str, quiet: bool = False) -> None:
        """End the run before its budget; the strategy reports ``reason`` as the run's failure.
        ``quiet``: the user asked for it (Ctrl-C), which the CLI reports in one line itself."""
        if not quiet:
            log.error("stopping at outer step %d: %s", self.version, reason)
        self.stop_reason = reason

    def tally_metrics(self, t: Tally) -> dict[str, float]:
        """Add a step's tally to the run totals and return the metrics every loop logs for it."""
        self.total_tokens += t.tokens
        self.total_bytes_up += t.bytes_up
        self.total_rejected += t.rejected
        self.total_accepted += t.accepted
        self.total_failed += t.errors
        return {
            **self.goodput_metrics(),
            "outer/step": self.version,
            "outer/accepted": t.accepted,
            "outer/rejected": t.rejected,
            "outer/rejected_total": self.total_rejected,
            "outer/failed": t.errors,
            "outer/update_norm": t.mean(t.norm_sum),
            "train/loss": t.loss_x_tokens / t.loss_tokens if t.loss_tokens else float("nan"),
            "train/tokens": self.total_tokens,
            "comm/bytes_up": t.bytes_up,
            "comm/bytes_up_total": self.total_bytes_up,
            "comm/bytes_down_total": self.total_bytes_down,
            "time/virtual_s": self._virtual_now(),
        }

    def goodput_metrics(self, folded: bool = True) -> dict[str, float]:
        """Cumulative goodput (fl_geo.runtime.goodput) at this step, on a virtual clock: the
        replies of this step were folded into it (``folded``) or wasted (the step was not taken)."""
        meter = self.dispatcher.goodput
        if meter is None:
            return {}
        meter.settle(accepted=folded)
        return meter.metrics(self.dispatcher.clock.now(), self.dispatcher.in_flight_s())

    # ---- checkpoint and resume (fl_geo/core/checkpoint.py) -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the server needs to continue where it stopped: model, outer optimizer,
        penalty statistics, counters, versions, clock and RNG. Loops add their own part in
        `extra_state`. Jobs in flight are not part of it: a resumed server sends fresh work."""
        clock = self.dispatcher.clock.state_dict()
        if "jobs" in clock:
            clock["jobs"] = []  # in-flight work is re-sent by the resumed server
        return {
            "format": CHECKPOINT_FORMAT,
            "strategy": self.cfg.strategy.name,
            "param_spec": self.spec.to_json(),
            **self.model_state(),
            "penalty": self.penalty.state_dict() if self.penalty is not None else None,
            "counters": {
                "version": self.version,
                "total_tokens": self.total_tokens,
                "total_bytes_up": self.total_bytes_up,
                "total_bytes_down": self.total_bytes_down,
                "total_rejected": self.total_rejected,
                "total_accepted": self.total_accepted,
                "total_failed": self.total_failed,
            },
            "history": [json.dumps(h) for h in self.history],
            "claims": self.claims.state_dict(),
            "clock": clock,
            "torch_rng": torch.get_rng_state(),
            "loop": self.extra_state(),
        }

    def model_state(self) -> dict[str, Any]:
        """``params`` and ``optimizer`` of a checkpoint (the sharded loop keeps them elsewhere)."""
        return self.model.state_dict()

    def prepare_model_state(self, state: dict[str, Any]) -> Callable[[], None]:
        """Validate a checkpoint's model part; return the function that installs it."""
        return self.model.prepare_load(state)

    def extra_state(self) -> dict[str, Any]:
        """The loop-specific part of a checkpoint (overridden by the loops)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore `extra_state` output (overridden by the loops)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`. Everything is validated against this run (format, strategy,
        model layout, buffer size) before anything changes; a mismatch raises ValueError and
        leaves the loop as it was."""
        missing = [k for k in ("format", "strategy", "param_spec", "params", "optimizer", "counters",
                               "history", "clock", "loop") if k not in state]
        if missing:
            raise ValueError(f"checkpoint lacks keys {missing}")
        if state["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state['format']} is not {CHECKPOINT_FORMAT}")
        if state["strategy"] != self.cfg.strategy.name:
            raise ValueError(f"checkpoint was written by strategy '{state['strategy']}', this run is '{self.cfg.strategy.name}'")
        if state["param_spec"] != self.spec.to_json():
            raise ValueError("checkpoint holds a model with a different parameter layout (model section changed?)")
        # The pieces that validate themselves: load into scratch copies first, then swap in.
        install_model = self.prepare_model_state(state)
        penalty = None
        if self.penalty is not None:
            if state.get("penalty") is None:
                raise ValueError("checkpoint has no penalty statistics but this run uses the penalty")
            penalty = penalty_from_config(self.cfg, self.spec)
            assert penalty is not None
            penalty.load_state_dict(state["penalty"])
        claims = ClaimBound()
        if "claims" in state:  # checkpoints before 2026-11-28 lack them: the bound starts empty
            claims.load_state_dict(dict(state["claims"]))
        self.load_extra_state(dict(state["loop"]))  # validates before it sets anything
        self.dispatcher.clock.load_state_dict(dict(state["clock"]))
        install_model()
        self.penalty = penalty
        self.claims = claims
        c = state["counters"]
        self.version = int(c["version"])
        self.total_tokens = int(c["total_tokens"])
        self.total_bytes_up = int(c["total_bytes_up"])
        self.total_bytes_down = int(c["total_bytes_down"])
        self.total_rejected = int(c["total_rejected"])
        self.total_accepted = int(c.get("total_accepted", 0))  # checkpoints before 2026-11 lack them
        self.total_failed = int(c.get("total_failed", 0))
        self.history = [json.loads(h) for h in state["history"]]
        self._client_cfg["resumed"] = True  # nodes may reload their inner state from disk
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        self.resumed = True

    def partition_of(self, node: int) -> int:
        """A node's partition id: the key that survives restarts (Flower node ids do not)."""
        return self.profiles[node].partition_id if node in self.profiles else -1

    def nodes_of(self, partitions: Sequence[int]) -> set[int]:
        """The live nodes (by profile) that serve the given partitions."""
        wanted = set(int(p) for p in partitions)
        return {n for n, prof in self.profiles.items() if prof.partition_id in wanted}

    def wait_for_quorum(self) -> None:
        """``run.min_live_nodes``: pause before an outer step while fewer nodes are live, rather
        than step on too little; give up with a clear error after ``run.min_live_wait_s``."""
        need = self.cfg.run.min_live_nodes
        # under a failure trace, virtual time moves on to repairs (nothing is in flight between steps)
        while need and len(self.dispatcher.live_nodes()) < need and self.dispatcher.wait_for_repair():
            pass
        if not need or len(self.dispatcher.live_nodes()) >= need:
            return
        wait_s = self.cfg.run.min_live_wait_s
        log.warning("only %d live node(s) < run.min_live_nodes=%d: outer steps paused (up to %.0f s)",
                    len(self.dispatcher.live_nodes()), need, wait_s)
        deadline = time.monotonic() + wait_s
        while len(live := self.dispatcher.live_nodes()) < need:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(live)} live node(s) after waiting {wait_s:.0f} s for run.min_live_nodes={need}; "
                    "the model is unchanged since the last step (resume from its checkpoint when nodes are back)"
                )
            time.sleep(0.5)
        log.info("%d live nodes again: outer steps resume", len(live))

    def maybe_checkpoint(self, step: int, last: bool = False) -> None:
        """Write a checkpoint after outer step ``step`` when ``run.checkpoint_every`` says so
        (and after the last one)."""
        every = self.cfg.run.checkpoint_every
        if self.checkpoints is None or not every or not (step % every == 0 or last):
            return
        path = self.checkpoints.save(step, self.state_dict())
        log.info("checkpoint after step %d: %s", step, path)

    def log_initial(self) -> None:
        """The step-0 record: the untrained model's validation loss."""
        if self.resumed:
            return  # the restored history already holds it
        first = self.evaluate()
        if first:
            self.history.append(self.logger.log(0, {**first, "outer/step": 0, "train/tokens": 0, **self._virtual_zero()}))

    # ---- the pseudo-gradient penalty (docs/algorithms.md §4), shared by Di-PS, EDiT and HALoS --------
    def fold_penalised(self, tally: Tally, node: int, update: Any, tokens: int, staleness: float = 0,
                       scored: Any = None) -> Any:
        """Norms -> outlier test against the step-start statistics -> weighted fold.

        ``scored``: the update as it arrived, when ``update`` is what a robust rule made of it
        (centered clipping): the outlier test, the statistics and the weights see the arrived
        norms, so a clip cannot hide a ×10 update from the penalty; ``update`` is what folds.
        Returns the verdict, or None when every group was rejected (logged with node and score).
        Statistics are keyed by partition id: Flower's node ids change from run to run.
        """
        assert self.penalty is not None
        norms = self.penalty.norms(update if scored is None else scored)
        if not bool(torch.isfinite(norms).all()):
            self._reject(tally, node, "update holds NaN or Inf values")
            return None
        bound = self.update_bound()
        if bound is not None and float(norms.norm()) > bound:
            self._reject(tally, node, f"update norm {float(norms.norm()):.4g} exceeds the bound {bound:.4g} (strategy.max_update_ratio)")
            return None
        key = self.profiles[node].partition_id if node in self.profiles else node
        verdict = self.penalty.observe(key, norms, tokens=tokens, staleness=staleness)
        if bool(verdict.scored.any()):
            z = float(verdict.z[verdict.scored].max())
            tally.max_z = z if math.isnan(tally.max_z) else max(tally.max_z, z)
        if not verdict.any_accepted:
            tally.rejected_groups += self.penalty.num_groups
            z = float(verdict.z.max()) if verdict.z.numel() else float("nan")
            self._reject(tally, node, f"outlier (z={z:.2f}, norm={float(norms.norm()):.4g}, rule {self.cfg.penalty.rule})")
            return None
        if not bool(verdict.accepted.all()):
            bad = [n for n, ok in zip(self.penalty.group_names, verdict.accepted.tolist(), strict=True) if not ok]
            zs = [f"{float(z):.2f}" for z, ok in zip(verdict.z.tolist(), verdict.accepted.tolist(), strict=True) if not ok]
            log.warning("node %s (partition %s): modules %s rejected as outliers (z=%s)", node, key, ", ".join(bad), ", ".join(zs))
            tally.rejected_groups += len(bad)
        self.penalty.fold_(self.accumulator, update, verdict)
        return verdict

    def record_clip(self, pre_norm: float, factors: Sequence[float]) -> None:
        """Remember how hard this outer step's clip φ bound, for `clip_metrics`.

        ``pre_norm`` is ‖Δ̄‖ over the whole model before the clip; ``factors`` the per-group
        min(1, φ/(‖Δ̄_g‖+ε)) applied (one for a global clip). Why it is logged: whether φ binds
        depends on the model's scale (docs/benchmarks.md, "Scale ladder"), and nothing else in
        the log says so.
        """
        self._clip_last = (float(pre_norm), [float(f) for f in factors])

    def clip_metrics(self) -> dict[str, float]:
        """``outer/clip_norm`` (‖Δ̄‖ before the clip), ``outer/clip_scale`` (the mean factor over
        groups: 1 = φ did not bind, 0.1 = the step was cut to a tenth) and ``outer/clip_bound``
        (the share of groups whose factor was below 1) of the last clipped step, then forgotten;
        empty when no clip ran since the last call (clip off, or no step taken)."""
        last, self._clip_last = self._clip_last, None
        if last is None:
            return {}
        pre, factors = last
        return {"outer/clip_norm": pre, "outer/clip_scale": sum(factors) / len(factors),
                "outer/clip_bound": sum(f < 1.0 for f in factors) / len(factors)}

    def penalised_step(self, buf: torch.Tensor | None = None) -> list[str]:
        """Clip, then the outer step; modules every worker failed on are not stepped (rollback:
        their parameters and outer momentum stay as they were). ``buf`` is the normalised mean
        (``self.accumulator.buffer`` after `Penalty.normalise_` by default). Returns the
        rolled-back module names."""
        assert self.penalty is not None
        if buf is None:
            buf = self.accumulator.buffer
            self.penalty.normalise_(buf)
        if self.penalty.clip is not None:
            pre = float(torch.linalg.vector_norm(buf))  # one read of Δ̄: the clip's input, for the log
            self.record_clip(pre, self.penalty.clip_(buf).tolist())
        rolled = self.penalty.rolled_back
        skip = self.penalty.ranges(rolled)
        live = [t for t in self.optimizer.state_dict().values() if torch.is_tensor(t) and t.numel() == self.spec.numel]
        saved = [(b, e, [x[b:e].clone() for x in (self.global_params, *live)]) for b, e in skip]
        self.optimizer.step(self.global_params, buf)
        for b, e, copies in saved:
            for x, c in zip((self.global_params, *live), copies, strict=True):
                x[b:e].copy_(c)
        if skip:
            log.warning("outer step %d: modules %s had no accepted update and were not stepped",
                        self.version + 1, ", ".join(rolled))
        return rolled
