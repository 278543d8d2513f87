"""What every outer loop holds and does the same way, synchronous or asynchronous.

On top of the kernel (`strategies/kernel.py`: the one `run`, told apart by policy hooks): the
global model (one fp32 flat buffer, stepped in place), the outer optimizer, the one
running sum, the counters a run summary reports, the profile-aware node bookkeeping, rejection
logging and server-side evaluation. Collaborators do the rest: the cost model
(`fl_geo.timing.cost`), checkpoint state and penalty folding. The loops differ only by their
policy hooks: when they step and whom they send work to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fl_geo.config import FlGeoConfig, uplink_wire
from fl_geo.core.accumulate import WeightedAccumulator
from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.compress import Compressor
from fl_geo.core.outer import OuterOptimizer
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.dispatch import NODE_DOWN, Dispatcher, JobTiming, NodeProfile, late_report
from fl_geo.runtime.evaluation import GlobalEvaluator
from fl_geo.runtime.metrics import MetricsLogger
from fl_geo.runtime.profiling import probe_timeout_s, profile_nodes
from fl_geo.runtime.progress import Progress
from fl_geo.runtime.protocol import (
    REQUEST_RECORD,
    USER_CONFIG_RECORD,
    EvaluateRequest,
    Request,
    user_config,
)
from fl_geo.runtime.wire import encode
from fl_geo.strategies import loop_checkpoint
from fl_geo.strategies.client_record import client_config_record
from fl_geo.strategies.downlink import Downlink, DownMessage
from fl_geo.strategies.kernel import LoopKernel
from fl_geo.strategies.penalised_fold import PenalisedFold, penalty_from_config
from fl_geo.strategies.plain_claims import PlainClaims
from fl_geo.strategies.replies import ReplyError, Tally, metric_number, metric_whole
from fl_geo.strategies.server_model import ServerModel
from fl_geo.timing.cost import CostModel

log = logging.getLogger("fl_geo")

# An asynchronous loop stops sending jobs to a node after this many failed jobs in a row.
MAX_CONSECUTIVE_ERRORS = 3


class OuterLoop(LoopKernel):
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
        # job bytes and modelled times, one model for every loop (fl_geo.timing.cost)
        # wire.compress: the sites' pseudo-gradients arrive compressed (fl_geo.runtime.compressed);
        # read_reply decompresses them and the clock charges the compressed bytes
        uplink = uplink_wire(cfg).uplink()  # wire.compress (or streaming.quantize, its alias)
        self.uplink: Compressor | None = Compressor(uplink) if uplink is not None else None
        # wire.compress_down: sites are sent compressed deltas of a public model x̂ (strategies/downlink.py)
        self.cost = CostModel(spec.numel, scenario, uplink=uplink, downlink=cfg.wire.downlink())
        self.model = self.server_model(cfg, global_params)
        self.downlink = self.global_downlink(cfg, spec, global_params)
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
        self.penalised = PenalisedFold(self)  # fold, clip and step with the penalty (when it is on)
        self.checkpoints: CheckpointStore | None = None  # set by the server when checkpointing is on
        self._bound: float | None = None
        self._bound_version = -1
        self.resumed = False
        # The outer step of the newest checkpoint this run wrote or resumed from (0: none yet). A
        # synchronous round carries it, so each node keeps the state it had at that checkpoint.
        self.checkpoint_step = 0
        self.progress: Progress | None = None  # the run's progress line, set by `run`
        # Set by the public strategy's start(): nodes may run a plain Flower ClientApp (they are
        # probed, fl_geo.runtime.profiling; accepted only outside the CLI path), and the user's
        # Flower train_config / evaluate_config that every request carries for them.
        self.accept_plain = False
        self.plain_only = False  # every node is a plain Flower ClientApp: joiners are not queried
        self.user_train_config: ConfigRecord | None = None
        self.user_evaluate_config: ConfigRecord | None = None
        self._errors: dict[int, int] = {}  # consecutive failed jobs per node
        self.claims = PlainClaims(self)  # plain Flower replies' num-examples against the accepted ones
        self.benched: set[int] = set()  # nodes that get no more jobs
        # A failure trace (virtual clock) names nodes by scenario slot = partition id.
        dispatcher.slot_of = self.partition_of

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        """The model part this loop steps: by default the strategy's outer optimizer over all of θ
        and a model-sized sum. Loops whose outer state lives in their own parts return
        `ServerModel.held_elsewhere`. Called once, from ``__init__``, before the loop's own set-up."""
        return ServerModel.from_config(cfg, global_params)

    def global_downlink(self, cfg: FlGeoConfig, spec: ParamSpec, global_params: torch.Tensor) -> Downlink | None:
        """The public model of θ that sites are sent deltas of (``wire.compress_down``), or None:
        off, or a loop whose sites train from other models (HALoS: one per local server)."""
        settings = cfg.wire.downlink()
        return None if settings is None else Downlink(settings, spec, cfg.wire.down, global_params, 0)

    def down_message(self, downlink: Downlink | None, node: int, x: torch.Tensor, key: Any) -> DownMessage | None:
        """``node``'s compressed-downlink message (`Downlink.message`), or None: the downlink is
        off, or the node runs a plain Flower ClientApp (it gets x whole, `arrays_for`)."""
        if downlink is None or self.is_plain(node):
            return None
        return downlink.message(node, x, key)

    def downlink_metrics(self) -> dict[str, float]:
        """The downlink's path counts (`Downlink.metrics`), none when it is off."""
        return self.downlink.metrics() if self.downlink is not None else {}

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

    def job_steps(self, node: int) -> int:
        """The inner steps of ``node``'s next job: H, or with ``strategy.dynupd`` on a scenario
        DynUpd's ``max(1, ceil(H · speed_i / max speed))`` (HALoS Table 1), so slow sites are not
        waited for."""
        h = self.cfg.strategy.inner_steps
        if self.cfg.strategy.dynupd and self.scenario is not None:
            return int(self.scenario.dynupd_steps(h, self.profiles[node].partition_id))
        return h

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
        site's ranks: its profile's (else client.devices × client.nodes), at most what the server's
        operator allows a site (``strategy.site_devices``; 0: client.devices × client.nodes). The profile is the site's
        own answer, so it may lower its cap, never raise it past the operator's: a profile
        claiming 4096 devices buys no more weight than ``site_devices`` of them. A reply claiming
        more tokens than its steps can produce is refused, so a token-weighted mean cannot be
        owned by one claim. None (trust the claim) with ``strategy.token_cap=none`` and for a
        plain Flower ClientApp, whose examples are counted by its own code."""
        if self.cfg.strategy.token_cap == "none" or self.is_plain(node):
            return None
        allowed = self.cfg.strategy.site_devices or self.cfg.client.devices * self.cfg.client.nodes
        profile = self.profiles.get(node)
        claimed = profile.devices if profile is not None and profile.devices else \
            self.cfg.client.devices * self.cfg.client.nodes
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

    def others_training(self) -> bool:
        """Whether a live node is still training: one whose reply could still join this step."""
        return bool({j.node for j in self.dispatcher.in_flight()} & set(self.dispatcher.live_nodes()))

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
            **self.downlink_metrics(),
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

    # ---- checkpoint and resume (strategies/loop_checkpoint.py) ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the server needs to continue where it stopped (`loop_checkpoint.capture`)."""
        return loop_checkpoint.capture(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; a checkpoint that does not fit this run raises ValueError and
        leaves the loop as it was (`loop_checkpoint.restore`: every part is validated before
        anything is installed). A value of the wrong type or shape met while validating (a
        string where a count belongs, a row too short) is a ValueError too."""
        try:
            loop_checkpoint.restore(self, state)
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"checkpoint holds a value of the wrong type or shape: {type(exc).__name__}: {exc}") from exc

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
        """Restore `extra_state` output (overridden by the loops); validate before setting anything."""

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
        self.checkpoint_step = step
        log.info("checkpoint after step %d: %s", step, path)

    def log_initial(self) -> None:
        """The step-0 record: the untrained model's validation loss."""
        if self.resumed:
            return  # the restored history already holds it
        first = self.evaluate()
        if first:
            self.history.append(self.logger.log(0, {**first, "outer/step": 0, "train/tokens": 0, **self._virtual_zero()}))
