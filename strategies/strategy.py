"""`FlGeoStrategy`: the base of fl-geo's public Flower strategies.

Every method (`DiLoCo`, `DiPS`, `HALoS`, ...) is a subclass of Flower's
``flwr.serverapp.strategy.Strategy`` built from plain keyword arguments, and honours its contract::

    result = strategy.start(grid, initial_arrays, num_rounds, timeout, train_config,
                            evaluate_config, evaluate_fn)

Why ``start()`` is overridden instead of Flower's round hooks: Flower's ``start()`` runs a
synchronous loop of ``configure_train`` / ``send_and_receive`` / ``aggregate_train``, which cannot
express an asynchronous method (the server steps while other workers are still training), a
streaming one (fragments synced mid-round) or a two-tier one (HALoS). So every fl-geo strategy
drives the grid itself through one dispatcher (``fl_geo.runtime.dispatch``: non-blocking push/pull, at
most one message in flight per node, error replies and vanished nodes, a virtual clock), and
reuses Flower's own pieces: the ``Grid``, ``Message`` and record types, node liveness, the
``Result`` type and the ``evaluate_fn`` convention. The four round hooks are not used; calling
them says so.

What ``start()`` does, for every method: read the model layout from ``initial_arrays``; wait for
``min_nodes`` nodes; find out what each runs (``clients="auto"``: the profile probe, a ``train``
message every ClientApp handles, fl_geo.runtime.profiling: an fl-geo client answers with its
profile; a plain Flower ClientApp trains, gets a default profile, is sent the fp32 model, and its
reply, the trained model plus ``num-examples``, is turned into a pseudo-gradient against the model
its job was sent with); run the method's outer loop; return a Flower ``Result`` (final arrays,
per-step train metrics, server-side evaluation per step).

``fl-geo run`` builds the same classes from a config (`build_strategy`), so the CLI and a Flower
user's ServerApp run one code path.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fl_geo.clients.settings import ClientSection
from fl_geo.config import ConfigError, FlGeoConfig, load_config, validate
from fl_geo.core.checkpoint import Checkpoint, CheckpointStore
from fl_geo.core.deadline import ReplyDeadline
from fl_geo.core.state import ParamSpec
from fl_geo.registry import Method, method
from fl_geo.runtime.dispatch import Dispatcher, NodeProfile
from fl_geo.runtime.interrupt import RunInterrupted
from fl_geo.runtime.metrics import MemoryLogger
from fl_geo.runtime.profiling import probe_timeout_s, profile_nodes
from fl_geo.runtime.progress import Progress
from fl_geo.runtime.wire import encode
from fl_geo.strategies.flower_model import (  # noqa: F401  (re-exported: tools import them from here)
    EvaluateFn,
    FlowerEvaluateFn,
    ServerEvaluator,
    arrays_from_flat,
    spec_and_params,
)
from fl_geo.strategies.settings import MethodSettings, places
from fl_geo.timing.scenario import Scenario

log = logging.getLogger("fl_geo")

CLIENT_KINDS = ("auto", "flower", "fl-geo")

def reply_deadline(cfg: FlGeoConfig) -> ReplyDeadline:
    """The wall-clock reply deadline of every job of a run (`fl_geo.core.deadline`): the explicit
    ``strategy.round_timeout_s`` when > 0, else the one derived from the jobs' reply times with
    ``strategy.reply_deadline_factor`` / ``_floor_s`` / ``_first_s``."""
    s = cfg.strategy
    return ReplyDeadline(s.reply_deadline_factor, s.reply_deadline_floor_s, s.reply_deadline_first_s,
                         explicit_s=s.round_timeout_s)


@dataclass
class RunStats:
    """What a finished ``start()`` measured (the CLI writes it into summary.json)."""

    outer_steps: int = 0
    tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0
    late_replies: int = 0
    wall_s: float = 0.0
    virtual_s: float | None = None
    scenario: str | None = None
    num_params: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    accepted: int = 0  # updates folded into an outer step over the whole run
    failed: int = 0  # jobs that errored, vanished or timed out
    steps_this_run: int = 0  # outer steps taken by this start() (a resumed run starts above 0)
    stop_reason: str | None = None  # why the loop ended before its budget
    interrupted: bool = False  # the user stopped it (Ctrl-C)
    lost_jobs: int = 0  # jobs lost to the scenario's failure trace (virtual clock)
    late_nodes: list[dict[str, Any]] = field(default_factory=list)  # `OuterLoop.late_nodes`: given up at a deadline

    @property
    def failure(self) -> str | None:
        """Why this run must not count as a success, in one line; None when it trained.

        A run fails when it stopped before its budget (every node gone), or when this start()
        took no outer step at all (every job failed or was rejected: the returned model is the
        initial one, or the checkpoint's)."""
        if self.interrupted:
            return f"interrupted by the user (Ctrl-C) after {self.outer_steps} outer step(s)"
        if self.stop_reason is not None:
            return f"stopped after {self.outer_steps} outer step(s): {self.stop_reason}"
        if self.steps_this_run == 0 and self.failed:
            return f"no outer step was taken: all {self.failed} job(s) failed (see the node errors above)"
        if self.steps_this_run == 0 and self.rejected:
            return f"no outer step was taken: all {self.rejected} update(s) were rejected"
        return None


# The keyword arguments of a public class that are not the method's settings: what it runs
# with (a scenario, what runs on the nodes, where metrics and checkpoints go) and how it waits
# for nodes. Everything else a class takes is a field of its settings dataclass.
COLLABORATORS = ("inner", "scenario", "clients", "min_nodes", "wait_nodes_timeout_s", "checkpoint_every", "options", "logger",
                 "progress", "checkpoints", "resume_from")


def _class_doc(cls: type[FlGeoStrategy]) -> str:
    """``cls``'s docstring followed by its keyword arguments' documentation: the docstrings of its
    settings dataclass and of the bases it inherits fields from (most specific first), so that
    ``help(DiPS)`` lists every argument with the docstring that defines it, written once."""
    parts = [inspect.cleandoc(cls.__doc__ or cls.__name__),
             f"Parameters\n----------\nThe fields of `{cls.Settings.__name__}`, then the collaborators of `FlGeoStrategy`."]
    for base in cls.Settings.__mro__:
        if isinstance(base, type) and issubclass(base, MethodSettings) and base.__doc__:
            parts.append(f"{base.__name__}: {inspect.cleandoc(base.__doc__)}")
    return "\n\n".join(parts)


class FlGeoStrategy(Strategy):
    """Base of fl-geo's public strategies.

    A subclass names its settings dataclass (``Settings``, a `fl_geo.strategies.settings.MethodSettings`)
    and takes exactly its fields as keyword arguments, plus these collaborators:

    Collaborators
    -------------
    inner : fl_geo.clients.settings.ClientSection, optional
        The typed inner-loop settings the strategy sends with every job to fl-geo's ClientApp
        (``make_client_app`` / the built-in one): AdamW lr, betas, weight decay, warm-up and
        cosine schedule, grad clip, batch size, sequence length, device, precision, devices per
        site. A plain Flower ClientApp gets your ``train_config`` instead and ignores them.
        Default: `ClientSection()`'s values. The token cap (``token_cap="job"``) reads its batch
        size and sequence length.
    scenario : str or fl_geo.timing.scenario.Scenario, optional
        A scenario name (``configs/scenarios``), a YAML path or a `Scenario` object: runs on a
        virtual clock that models the scenario's WAN links and accelerator speeds (deterministic
        event order). Without one, replies are handled as they arrive (wall clock).
    clients : str (default: "auto")
        What runs on the nodes. ``"auto"``: probe each node with a ``train`` message that carries
        the first job's model and config and fl-geo's profile query (fl-geo's ClientApp answers
        with its profile; a plain Flower ClientApp trains, and that reply is its first update), so
        a plain ClientApp never gets a message type it has no handler for. ``"flower"``: every
        node is a plain Flower ClientApp (nothing is asked). ``"fl-geo"``: every node runs
        fl-geo's ClientApp and is asked with a ``query`` message (the model is not sent twice);
        one that does not answer gets no job, and none answering is an error.
    min_nodes : int (default: 1)
        Nodes to wait for before the first job (``wait_nodes_timeout_s`` at most, default 120).
    options : Mapping[str, Any], optional
        Any other fl-geo setting as dotted keys (``{"client.lr": 1e-3}``); ``fl-geo config FILE``
        lists them. Unknown keys are a one-line error; a key that is a field of ``Settings`` is
        refused (pass the keyword argument).
    logger : optional
        Where per-step metrics go: ``fl_geo.runtime.metrics.MetricsLogger(run_dir)`` (JSONL + TensorBoard);
        default: kept in memory only (and returned in the `Result`).
    progress : bool or fl_geo.runtime.progress.Progress (default: False)
        Print one progress line per outer step.
    checkpoints : fl_geo.core.checkpoint.CheckpointStore, optional
        Write a server checkpoint every ``checkpoint_every`` outer steps into this store.
    resume_from : fl_geo.core.checkpoint.Checkpoint, optional
        Continue from this checkpoint (validated against the run first).
    """

    Settings: ClassVar[type[MethodSettings]] = MethodSettings
    method: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Tie the class to its settings: ``method`` is theirs, and ``help(cls)`` /
        ``inspect.signature(cls)`` show the settings' fields (typed, with their defaults) and the
        collaborators, which is exactly what ``__init__`` accepts."""
        super().__init_subclass__(**kwargs)
        cls.method = cls.Settings.method
        own = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                 default=inspect.Parameter.empty if f.default is MISSING else f.default)
               for f in fields(cls.Settings)]
        base = inspect.signature(FlGeoStrategy.__init__).parameters
        extra = [base[name] for name in COLLABORATORS]
        cls.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        cls.__doc__ = _class_doc(cls)

    def __init__(
        self,
        *,
        inner: ClientSection | None = None,
        scenario: str | Scenario | None = None,
        clients: str = "auto",
        min_nodes: int = 1,
        wait_nodes_timeout_s: float = 120.0,
        checkpoint_every: int = 0,
        options: Mapping[str, Any] | None = None,
        logger: Any = None,
        progress: bool | Progress = False,
        checkpoints: CheckpointStore | None = None,
        resume_from: Checkpoint | None = None,
        **settings: Any,
    ) -> None:
        settings_obj = type(self).Settings(**settings)  # a TypeError names an unknown argument
        values = settings_obj.config_values()
        values.setdefault("run", {}).update(
            min_nodes=min_nodes, wait_nodes_timeout_s=wait_nodes_timeout_s, checkpoint_every=checkpoint_every,
            tensorboard=False, progress=bool(progress))
        if scenario is not None:
            name = scenario.name if isinstance(scenario, Scenario) else str(scenario)
            values["run"].update(clock="virtual", scenario=name)
        if clients not in CLIENT_KINDS:
            raise ConfigError(f"clients must be one of {', '.join(CLIENT_KINDS)}, got {clients!r}")
        if inner is not None:
            if not isinstance(inner, ClientSection):
                raise ConfigError(f"inner must be a fl_geo.clients.settings.ClientSection, got {type(inner).__name__}")
            if any(str(key).startswith("client.") for key in options or {}):
                raise ConfigError("inner= and client.* options both set the inner loop: give it once, in inner=")
            values["client"] = asdict(inner)
        own = {place for f in fields(settings_obj) for place in places(f)}
        for key, value in (options or {}).items():
            section, dot, name = str(key).partition(".")
            if not dot or not name:
                raise ConfigError(f"option {key!r} is not a dotted key such as 'client.lr'")
            if key in own:
                raise ConfigError(f"option {key!r} is a setting of {type(self).__name__}: pass it as a keyword argument")
            values.setdefault(section, {})[name] = value
        # own_model: the model is the one start() is handed, not the config's model section
        config = load_config(None, None, values, own_model=True)
        self._init(config, logger=logger, progress=progress, checkpoints=checkpoints, resume_from=resume_from,
                   from_kwargs=True)
        self.settings = settings_obj
        self.clients = clients
        self._scenario = scenario if isinstance(scenario, Scenario) else None

    def _init(self, config: FlGeoConfig, *, logger: Any, progress: bool | Progress, checkpoints: CheckpointStore | None,
              resume_from: Checkpoint | None, from_kwargs: bool, evaluator: Any = None,
              on_ready: Callable[..., None] | None = None) -> None:
        self.config = config
        self.logger = logger
        self.progress = progress
        self.checkpoints = checkpoints
        self.resume_from = resume_from
        self._from_kwargs = from_kwargs
        self._evaluator = evaluator  # an evaluator, or a factory of one from the partition count
        self._on_ready = on_ready
        self.clients = "fl-geo"  # from a config: fl-geo's ClientApp on every node
        self._scenario: Scenario | None = None  # a scenario object passed in (else the config names one)
        self.stats = RunStats()
        self.loop: Any = None

    @classmethod
    def from_config(cls, config: FlGeoConfig, *, logger: Any = None, progress: bool | Progress = False,
                    checkpoints: CheckpointStore | None = None, resume_from: Checkpoint | None = None,
                    evaluator: Any = None, on_ready: Callable[..., None] | None = None) -> FlGeoStrategy:
        """Build from a resolved fl-geo config (``fl-geo run`` / ``flwr run .``).

        ``evaluator``: a `ServerEvaluator` or a callable ``num_partitions -> ServerEvaluator``
        (fl-geo's held-out text evaluator needs the partition count the nodes report).
        ``on_ready(spec, profiles, evaluator)``: called once nodes are profiled, before training.
        """
        if cls.method and config.strategy.name != cls.method:
            raise ConfigError(f"{cls.__name__} runs strategy '{cls.method}', the config names '{config.strategy.name}'")
        self = cls.__new__(cls)
        self._init(config, logger=logger, progress=progress, checkpoints=checkpoints, resume_from=resume_from,
                   from_kwargs=False, evaluator=evaluator, on_ready=on_ready)
        self.settings = cls.Settings.from_config(config)
        return self

    @property
    def registry_entry(self) -> Method:
        return method(self.config.strategy.name)

    # ---- Flower's round hooks: not used (see the module docstring) -------------------------------
    def _no_round_hooks(self, name: str) -> Any:
        raise RuntimeError(
            f"{type(self).__name__}.{name}: fl-geo strategies drive the grid from start() (asynchronous, "
            "streaming and two-tier methods cannot be written as Flower's synchronous round hooks); call "
            "strategy.start(grid, initial_arrays, ...)"
        )

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Any:
        return self._no_round_hooks("configure_train")

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        return self._no_round_hooks("aggregate_train")

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Any:
        return self._no_round_hooks("configure_evaluate")

    def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:
        return self._no_round_hooks("aggregate_evaluate")

    def summary(self) -> None:
        s = self.config.strategy
        log.info("%s (%s): outer %s lr=%s momentum=%s, H=%d, weighting=%s, wire %s/%s",
                 type(self).__name__, self.registry_entry.summary, s.outer_optimizer, s.outer_lr, s.outer_momentum,
                 s.inner_steps, s.weighting, self.config.wire.up, self.config.wire.down)

    # ---- the run ---------------------------------------------------------------------------------
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        max_tokens: int | None = None,
    ) -> Result:
        """Run the method on ``grid`` from ``initial_arrays`` and return Flower's `Result`.

        ``num_rounds`` counts outer steps (for asynchronous methods too); ``max_tokens`` ends the
        run earlier once that many accepted tokens were folded. ``timeout``: wall seconds any job
        waits for its reply before it is given up and its node counted as late (0 or None: the
        deadline derived from the run's reply times, ``strategy.reply_deadline_*`` in ``options``).
        ``train_config`` / ``evaluate_config`` reach every ClientApp in the message's ``"config"``
        record, as with Flower's own strategies. ``evaluate_fn(step, arrays)`` is Flower's
        centralised evaluation: called before the first step and every ``run.eval_every`` steps;
        its ``"loss"`` is the validation loss fl-geo logs.
        """
        cfg = self._run_config(num_rounds, timeout, max_tokens)
        self.summary()
        spec, params = spec_and_params(initial_arrays)
        t0 = time.perf_counter()
        threads_before = torch.get_num_threads()
        torch.set_num_threads(cfg.run.server_threads)
        try:
            result = self._run(grid, cfg, spec, params, train_config, evaluate_config, evaluate_fn)
        finally:
            torch.set_num_threads(threads_before)
        self.stats.wall_s = round(time.perf_counter() - t0, 3)
        return result

    def _run_config(self, num_rounds: int, timeout: float, max_tokens: int | None) -> FlGeoConfig:
        cfg = copy.deepcopy(self.config)
        if not isinstance(num_rounds, int) or isinstance(num_rounds, bool) or num_rounds < 1:
            raise ConfigError(f"num_rounds must be a positive integer, got {num_rounds!r}")
        cfg.run.rounds = num_rounds
        if max_tokens is not None:
            cfg.run.max_tokens = int(max_tokens)
        if self._from_kwargs:  # (a config from fl-geo run was validated when it was loaded)
            cfg.strategy.round_timeout_s = float(timeout or 0)
            validate(cfg, own_model=True)
        return cfg

    def _profiles(self, dispatcher: Dispatcher, cfg: FlGeoConfig, nodes: list[int], spec: ParamSpec,
                  params: torch.Tensor, train_config: ConfigRecord | None) -> dict[int, NodeProfile]:
        """Who runs on ``nodes`` (`profile_nodes`). Under ``"auto"`` the profile probe carries the
        model the run starts from, so a plain node's reply to it answers its first train job.
        The first message to a node also waits for its ClientApp to start (Ray actors, a fresh
        process per message in deployment), which is slow on a loaded machine: the query waits
        ``wait_nodes_timeout_s``, the probe a round's time at least (`probe_timeout_s`)."""
        timeout_s = cfg.run.wait_nodes_timeout_s if self.clients == "fl-geo" else \
            probe_timeout_s(cfg.strategy.round_timeout_s, cfg.run.wait_nodes_timeout_s)
        profiles = profile_nodes(dispatcher, nodes, self.clients, lambda: encode(self._start_params(params), spec, "fp32"),
                                 train_config, timeout_s)
        if self.clients == "fl-geo" and not profiles:
            raise RuntimeError("no node answered the profile query")
        return profiles

    def _start_params(self, params: torch.Tensor) -> torch.Tensor:
        """The model the first jobs carry: a resumed run's checkpoint model (when it is one this
        run can load; `load_state_dict` checks it fully later), else ``params``."""
        saved = self.resume_from.state.get("params") if self.resume_from is not None else None
        if torch.is_tensor(saved) and saved.shape == params.shape and saved.dtype == params.dtype:
            return saved
        return params

    def _run(self, grid: Grid, cfg: FlGeoConfig, spec: ParamSpec, params: torch.Tensor,
             train_config: ConfigRecord | None, evaluate_config: ConfigRecord | None,
             evaluate_fn: EvaluateFn | None) -> Result:
        from fl_geo.strategies.loops import loop_class, make_clock, make_wall_faults
        from fl_geo.timing.clock import WallClock

        minimum = cfg.run.min_nodes or cfg.run.num_clients
        nodes = Dispatcher(grid, WallClock()).wait_for_nodes(minimum, cfg.run.wait_nodes_timeout_s)
        if self._from_kwargs:  # the schedule length and the scenario's node slots follow the grid
            cfg.run.num_clients = len(nodes)
            validate(cfg, own_model=True)
        clock, scenario = make_clock(cfg, self._scenario)
        dispatcher = Dispatcher(grid, clock)
        dispatcher.reply_deadline = reply_deadline(cfg)
        dispatcher.wall_faults = make_wall_faults(cfg, spec.numel, self._scenario)
        if scenario is not None:  # partition id = scenario slot: a claim beyond them is refused
            dispatcher.membership.slots = scenario.num_nodes
        # started before the nodes are profiled: under "auto" a plain node's first job runs then
        progress = self.progress if isinstance(self.progress, Progress) else Progress(
            cfg.run.name, cfg.run.rounds, enabled=bool(self.progress), max_tokens=cfg.run.max_tokens)
        profiles = self._profiles(dispatcher, cfg, nodes, spec, params, train_config)
        evaluator: Any = self._evaluator
        if evaluate_fn is not None:
            evaluator = FlowerEvaluateFn(evaluate_fn, spec)
        elif evaluator is not None and not hasattr(evaluator, "metrics"):  # a factory
            evaluator = evaluator(max(p.num_partitions for p in profiles.values()))
        if self._on_ready is not None:
            self._on_ready(spec, profiles, evaluator)
        loop_cls = loop_class(cfg)
        plain = sorted(n for n, p in profiles.items() if not p.fl_geo_client)
        if plain and not loop_cls.supports_plain_clients:
            raise ConfigError(
                f"{type(self).__name__} needs fl-geo's ClientApp on every node (fl_geo.clients): "
                f"{loop_cls.plain_clients_refusal}; nodes {plain} run a plain Flower "
                "ClientApp (they did not answer the profile probe with an fl-geo profile)")
        if plain and cfg.wire.compress != "none":
            raise ConfigError(
                f"wire.compress={cfg.wire.compress} compresses the uplink of fl-geo's ClientApp only: nodes {plain} run a "
                "plain Flower ClientApp (they did not answer the profile probe with an fl-geo profile); use wire.compress=none")
        logger = self.logger if self.logger is not None else MemoryLogger()
        loop = loop_cls(cfg, spec, params, dispatcher, profiles, logger, evaluator, scenario)
        loop.accept_plain = self.clients != "fl-geo" and loop_cls.supports_plain_clients
        loop.plain_only = self.clients == "flower"
        loop.user_train_config = train_config
        loop.user_evaluate_config = evaluate_config
        loop.checkpoints = self.checkpoints
        if self.resume_from is not None:
            try:
                loop.load_state_dict(self.resume_from.state)
            except ValueError as exc:
                raise ConfigError(f"cannot resume from {self.resume_from.path}: {exc}") from exc
            loop.checkpoint_step = self.resume_from.step
            log.info("fl-geo: resumed from %s (outer step %d, %d tokens)", self.resume_from.path, loop.version, loop.total_tokens)
        self.loop = loop
        first_version = loop.version
        interrupted = False
        try:
            last = loop.run(progress)
        except RunInterrupted as exc:  # Ctrl-C: the model and counters are those of the last whole step
            loop.stop(str(exc), quiet=True)
            interrupted = True
            last = loop.history[-1] if loop.history else {}
        self.stats = RunStats(
            outer_steps=loop.version, tokens=loop.total_tokens, bytes_up=loop.total_bytes_up,
            bytes_down=loop.total_bytes_down, rejected=loop.total_rejected, late_replies=dispatcher.late_replies,
            virtual_s=clock.now() if clock.is_virtual else None,
            scenario=scenario.name if scenario is not None else None, num_params=spec.numel, last=dict(last),
            accepted=loop.total_accepted, failed=loop.failed_jobs(), steps_this_run=loop.version - first_version,
            stop_reason=loop.stop_reason, interrupted=interrupted, lost_jobs=dispatcher.lost_jobs,
            late_nodes=loop.late_nodes(),
        )
        if self.stats.late_nodes:
            log.warning("late nodes (no reply within the deadline; given no new work until they replied): %s",
                        ", ".join(f"node {n['node']} (partition {n['partition']}{', site ' + n['site'] if n['site'] else ''}: "
                                  f"{n['late_jobs']} job(s) given up after {n['deadline_s']} s)" for n in self.stats.late_nodes))
        if self.stats.failure and not interrupted:
            log.error("run failed: %s", self.stats.failure)
        return self._result(loop, spec, evaluator)

    def _result(self, loop: Any, spec: ParamSpec, evaluator: Any) -> Result:
        result = Result(arrays=arrays_from_flat(loop.global_params, spec))
        for record in loop.history:
            step = int(record.get("step", 0))
            train = {k: float(v) for k, v in record.items()
                     if isinstance(v, int | float) and not k.startswith("val/") and math.isfinite(float(v))}
            if step > 0 and train:
                result.train_metrics_clientapp[step] = MetricRecord(train)
            if isinstance(evaluator, FlowerEvaluateFn):
                continue
            val = {k[4:]: float(v) for k, v in record.items()
                   if k.startswith("val/") and isinstance(v, int | float) and math.isfinite(float(v))}
            if val:
                result.evaluate_metrics_serverapp[step] = MetricRecord(val)
        if isinstance(evaluator, FlowerEvaluateFn):
            result.evaluate_metrics_serverapp.update(evaluator.by_step)
        return result

