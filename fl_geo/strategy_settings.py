"""The ``strategy`` section: the server's outer loop, its outer optimizer and its rounds.

The tables here (which outer optimizers each strategy may use, its default outer lr and momentum,
which loops are asynchronous, streaming or lack checkpoints) are derived from the method registry
(`fl_geo.registry`), so the section is checked beside the table it is checked against.
`StrategySection.check` also fills the unset outer settings in place, so that the resolved config
written with a run is explicit. The strategies themselves (``fl_geo.strategies``) import the
config schema, so the section cannot live in that package without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require
from fl_geo.registry import METHODS

WEIGHTINGS = ("uniform", "tokens")
# strategy.robust: fl_geo.core.robust (median_norm) and fl_geo.core.robust_agg (the others)
ROBUST_RULES = ("none", "median_norm", "trimmed_mean", "median", "centered_clip", "cosine")

# The strategy tables, derived from the one registry entry per method (fl_geo.registry): which
# outer optimizers a strategy may use (first = default), the outer lr / momentum it gets when the
# config leaves them unset, and which loops checkpoints cover. The rest of a method's defaults
# (`Method.defaults`) is merged under the user's keys by `fl_geo.config.load_config`.
STRATEGY_OPTIMIZERS: dict[str, tuple[str, ...]] = {m.name: m.optimizers for m in METHODS.values()}
STRATEGY_DEFAULTS: dict[str, tuple[float, float]] = {m.name: (m.outer_lr, m.outer_momentum) for m in METHODS.values()}
NO_CHECKPOINT_STRATEGIES = tuple(m.name for m in METHODS.values() if not m.checkpoints)
ASYNC_STRATEGIES = tuple(m.name for m in METHODS.values() if m.is_async)
STREAMING_STRATEGIES = tuple(m.name for m in METHODS.values() if m.family == "streaming")


@dataclass
class StrategySection:
    """Server side: which synchronous outer loop and its outer optimizer."""

    name: str = "diloco"  # a key of STRATEGY_OPTIMIZERS (diloco, fedavg, ..., dips, edit, a_edit)
    outer_optimizer: str = ""  # "" = the strategy's default (STRATEGY_OPTIMIZERS)
    outer_lr: float | None = None  # None = the strategy's default (STRATEGY_DEFAULTS)
    outer_momentum: float | None = None
    beta1: float = 0.9  # fedadam / fedyogi
    beta2: float = 0.99
    tau: float = 1e-3
    delay_buffer: int = 1  # delayed_nesterov N
    delay_activation: float = 0.0  # delayed_nesterov c
    # asynchronous strategies (docs/algorithms.md §5). A method's own values (FedBuff's K = 2 and
    # staleness weights, FedAsync's mixing, Di-PS's grace window) are its registry defaults.
    buffer_size: int = 1  # accepted updates per outer step (FedBuff K; Di-PS 1_000_000 = no cap)
    staleness_weighting: bool = False  # weight each update by s(tau) = 1/sqrt(1 + tau) (FedBuff)
    # FedAsync: scale each one-update step by alpha_t = mixing (1 + tau)^-staleness_exponent
    staleness_mixing: bool = False
    mixing: float = 0.6  # FedAsync alpha
    staleness_exponent: float = 0.5  # FedAsync a: alpha_t = alpha (1 + tau)^-a
    # close a step once grace_s has passed since the last arrival (Di-PS); grace_s >= 0 turns it on
    grace: bool = False
    grace_s: float = -1.0  # grace window; -1 = ski-rental estimate, >= 0 fixed
    grace_max_s: float = 60.0
    # dispatch: workers send Δ against the model they started from; current: they send parameters
    # and g = θ_current − θ_worker (Di-PS line 10; FedAsync's mixing)
    pseudo_grad_base: str = "dispatch"
    schedule_clock: str = ""  # local | global; "" = local for synchronous, global for asynchronous
    dynupd: bool = False  # H_i = ceil(H * speed_i / max speed) (DyLU / DynUpd)
    # none: every outer step uses outer_lr. share: lr x (accepted updates / live workers), so that
    # N single-update asynchronous steps add up to one synchronous step over N updates (as
    # delayed Nesterov's g/N does); not in the Di-PS paper: an fl-geo option.
    outer_lr_scaling: str = "none"
    weighting: str = "uniform"  # uniform | tokens
    inner_steps: int = 50  # H
    # A-EDiT: each inner loop runs for this long instead of H steps (0 = off). Wall clock: the
    # client trains until the elapsed time reaches it, finishing the step that crosses it, with H
    # as a cap; virtual clock: max(1, ceil(budget / step_time_i)) steps from the scenario.
    time_budget_s: float = 0.0
    # A-EDiT (atorch use_step_weight): w_i = (1 - r) * penalty weight_i + r * steps_i / sum steps
    step_weight_ratio: float = 0.0
    # EDiT warm-up (Algorithm 1, lines 7 and 19-20): the first t_warm inner steps are averaged
    # every step (rounds of one inner step, plain model averaging, no penalty) before the
    # periodic syncs start. Counted in inner steps; these rounds come on top of run.rounds.
    sync_warmup_steps: int = 0
    clients_per_round: int = 0  # 0 = every live node
    min_replies: int = 1  # fewer accepted updates than this: skip the outer step
    # Wall seconds a job may go without a reply before it is given up and its node counted as late
    # (it gets no new work until it replies; that reply is discarded). > 0: this bound for every
    # job. 0: the bound derived from the run (fl_geo.core.deadline): max(reply_deadline_floor_s,
    # reply_deadline_factor x the median time comparable jobs took to reply; comparable = the same
    # message type and inner steps), and reply_deadline_first_s until one of them has replied.
    round_timeout_s: float = 0.0
    reply_deadline_factor: float = 10.0  # k; 0 = no derived bound (with round_timeout_s 0: wait for every reply)
    reply_deadline_floor_s: float = 300.0  # the derived bound is never shorter
    reply_deadline_first_s: float = 3600.0  # before any comparable job replied; 0 = no bound until one has
    # Quorum rounds (synchronous): the round steps once ceil(quorum x selected) nodes replied
    # (0 = wait for all). The others keep training, their nodes busy; their replies come in a
    # later round and are dropped, or folded there with FedBuff's staleness weight 1/sqrt(1 + tau).
    quorum: float = 0.0
    late_replies: str = "drop"  # drop | fold
    # Reject an update whose L2 norm exceeds this multiple of the global model's (at least 1):
    # a broken or hostile update scaled x1e6 is finite and well-shaped. 0 = no bound.
    max_update_ratio: float = 10.0
    # job: a reply may claim at most steps x client.batch_size x client.seq_len x the site's
    # devices tokens (what its job could produce); none: trust the claim (a user's ClientApp
    # whose batches do not follow client.batch_size / seq_len).
    token_cap: str = "job"
    # The most devices a site may count towards its token cap, set by the server's operator
    # (0: client.devices). A site's profile (its node config ``devices``) may claim fewer, never
    # more: a site cannot raise its own cap.
    site_devices: int = 0
    # Bounded influence (fl_geo.core.robust): median_norm rejects an update whose norm is more
    # than robust_factor x the median norm of the round's updates (synchronous; the round's
    # replies are held until it completes) or of the last robust_window updates (asynchronous).
    # Direction-aware rules (fl_geo.core.robust_agg, docs/robustness.md "Which robust rule"):
    # trimmed_mean drops robust_trim values at each end of every coordinate (synchronous);
    # median takes the coordinate median (synchronous); centered_clip clips each update's
    # distance to a running center at the median distance, robust_clip_iters times (1: more
    # iterations let a hostile update of a small asynchronous buffer drag the result); cosine
    # rejects an update whose cosine with the consensus is below robust_cos_min: the round's
    # coordinate median (synchronous), or a running center (asynchronous) seeded with the
    # coordinate median of the first step, which waits for robust_seed updates (or every live
    # site), the kept updates then centered-clipped. The seed tolerates fewer than half of those
    # first updates hostile.
    robust: str = "none"  # none | median_norm | trimmed_mean | median | centered_clip | cosine
    robust_factor: float = 3.0
    robust_window: int = 16
    robust_trim: int = 1
    robust_clip_iters: int = 1
    robust_cos_min: float = 0.0
    robust_seed: int = 5
    # rank: fold replies in partition order (bit-reproducible sums; an early reply may wait in
    # memory for the ones before it); arrival: fold on arrival (never holds a reply).
    fold_order: str = "rank"

    def check(self) -> None:
        """Fill the strategy's defaults for unset outer settings, grace window and schedule clock in
        place, and raise `ConfigError` for a value this strategy cannot use."""
        require(
            self.name in STRATEGY_OPTIMIZERS,
            f"strategy.name '{self.name}' is unknown; valid: {', '.join(STRATEGY_OPTIMIZERS)}",
        )
        self._check_outer_step()
        self._check_asynchrony()
        self._check_inner_budget()
        self._check_rounds()
        self._check_robust()
        self._check_constants()

    def _check_outer_step(self) -> None:
        allowed = STRATEGY_OPTIMIZERS[self.name]
        # Fill strategy defaults in place so the resolved config written with the run is explicit.
        self.outer_optimizer = self.outer_optimizer or allowed[0]
        default_lr, default_mom = STRATEGY_DEFAULTS[self.name]
        self.outer_lr = default_lr if self.outer_lr is None else self.outer_lr
        self.outer_momentum = default_mom if self.outer_momentum is None else self.outer_momentum
        require(
            self.outer_optimizer in allowed,
            f"strategy '{self.name}' uses outer_optimizer {' or '.join(allowed)}, got '{self.outer_optimizer}'",
        )
        require(self.weighting in WEIGHTINGS, f"strategy.weighting must be one of {WEIGHTINGS}, got '{self.weighting}'")
        require(self.inner_steps >= 1, f"strategy.inner_steps must be >= 1, got {self.inner_steps}")
        require(self.outer_lr > 0, f"strategy.outer_lr must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"strategy.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        require(self.delay_buffer >= 1, "strategy.delay_buffer must be >= 1")
        require(self.buffer_size >= 1, f"strategy.buffer_size must be >= 1 (leave it out for the strategy's default), "
                                       f"got {self.buffer_size}")

    def _check_asynchrony(self) -> None:
        """Staleness, grace window, pseudo-gradient base and schedule clock (defaults filled here)."""
        is_async = self.name in ASYNC_STRATEGIES
        buffered = METHODS[self.name].family == "async"  # the asynchronous buffered loop (not HALoS)
        require(not self.staleness_mixing or (buffered and self.buffer_size == 1),
                "strategy.staleness_mixing (FedAsync) mixes one update at a time: it needs an asynchronous "
                f"buffered strategy and strategy.buffer_size=1, got '{self.name}' with buffer_size={self.buffer_size}")
        self.grace = self.grace or self.grace_s >= 0  # a fixed window turns the grace window on (resolved explicitly)
        require(self.pseudo_grad_base in ("dispatch", "current"), "strategy.pseudo_grad_base must be dispatch or current")
        require(not (self.pseudo_grad_base == "current" and not is_async),
                "strategy.pseudo_grad_base=current is for asynchronous strategies")
        self.schedule_clock = self.schedule_clock or ("global" if is_async else "local")
        require(self.schedule_clock in ("local", "global"), "strategy.schedule_clock must be local or global")
        require(self.grace_s >= 0 or self.grace_s == -1, "strategy.grace_s must be >= 0 or -1 (auto)")
        require(0 < self.mixing <= 1, "strategy.mixing must be in (0, 1]")
        require(self.outer_lr_scaling in ("none", "share"), "strategy.outer_lr_scaling must be none or share")
        require(self.outer_lr_scaling == "none" or is_async, "strategy.outer_lr_scaling=share is for asynchronous strategies")

    def _check_inner_budget(self) -> None:
        """A-EDiT's time budget and step weights, EDiT's warm-up."""
        is_async = self.name in ASYNC_STRATEGIES
        require(self.time_budget_s >= 0, f"strategy.time_budget_s must be >= 0, got {self.time_budget_s}")
        require(not (self.time_budget_s > 0 and is_async), "strategy.time_budget_s is for synchronous strategies (A-EDiT)")
        require(0 <= self.step_weight_ratio <= 1, f"strategy.step_weight_ratio must be in [0, 1], got {self.step_weight_ratio}")
        require(self.sync_warmup_steps >= 0, f"strategy.sync_warmup_steps must be >= 0, got {self.sync_warmup_steps}")
        require(self.sync_warmup_steps == 0 or not is_async, "strategy.sync_warmup_steps (EDiT warm-up) is for synchronous strategies")

    def _check_rounds(self) -> None:
        """Selection, replies, reply deadlines, quorum and late replies, the bounds on one update."""
        require(self.clients_per_round >= 0, "strategy.clients_per_round must be >= 0")
        require(self.min_replies >= 1, "strategy.min_replies must be >= 1")
        require(self.round_timeout_s >= 0, "strategy.round_timeout_s must be >= 0")
        require(self.reply_deadline_factor == 0 or self.reply_deadline_factor >= 1,
                "strategy.reply_deadline_factor must be 0 (off) or >= 1 (a multiple of the median reply time), "
                f"got {self.reply_deadline_factor}")
        require(self.reply_deadline_floor_s >= 0, f"strategy.reply_deadline_floor_s must be >= 0, got {self.reply_deadline_floor_s}")
        require(self.reply_deadline_first_s == 0 or self.reply_deadline_first_s >= self.reply_deadline_floor_s,
                "strategy.reply_deadline_first_s must be 0 (no bound before the first reply) or >= "
                f"strategy.reply_deadline_floor_s ({self.reply_deadline_floor_s}), got {self.reply_deadline_first_s}")
        require(self.max_update_ratio >= 0, f"strategy.max_update_ratio must be >= 0, got {self.max_update_ratio}")
        require(0 <= self.quorum <= 1,
                f"strategy.quorum must be in [0, 1] (a share of the selected nodes; 0 = all), got {self.quorum}")
        require(self.quorum == 0 or self.name not in ASYNC_STRATEGIES,
                "strategy.quorum is for synchronous strategies (asynchronous ones never wait)")
        require(self.quorum == 0 or (self.name not in STREAMING_STRATEGIES and self.name != "halos"),
                f"strategy.quorum is for the synchronous DiLoCo-style loop, not for strategy '{self.name}'")
        require(self.late_replies in ("drop", "fold"), f"strategy.late_replies must be drop or fold, got '{self.late_replies}'")
        require(0 <= self.site_devices <= 4096, f"strategy.site_devices must be in [0, 4096], got {self.site_devices}")
        require(self.token_cap in ("job", "none"), f"strategy.token_cap must be job or none, got '{self.token_cap}'")

    def _check_robust(self) -> None:
        """Bounded influence (median_norm) and the late replies it cannot judge."""
        require(self.late_replies == "drop" or self.robust == "none",
                f"strategy.late_replies=fold with strategy.robust={self.robust} is not supported: a late reply is folded "
                "outside the round whose median it would be judged against; use late_replies=drop")
        require(self.robust in ROBUST_RULES, f"strategy.robust must be one of {', '.join(ROBUST_RULES)}, got '{self.robust}'")
        require(self.robust not in ("trimmed_mean", "median") or self.name not in ASYNC_STRATEGIES,
                f"strategy.robust={self.robust} is for synchronous rounds (an asynchronous buffer holds too few "
                "updates for a consensus of peers); use cosine, centered_clip or median_norm")
        require(self.robust_seed >= 3, f"strategy.robust_seed must be >= 3, got {self.robust_seed}")
        require(self.robust_trim >= 1, f"strategy.robust_trim must be >= 1, got {self.robust_trim}")
        require(self.robust_clip_iters >= 1, f"strategy.robust_clip_iters must be >= 1, got {self.robust_clip_iters}")
        require(-1 <= self.robust_cos_min < 1, f"strategy.robust_cos_min must be in [-1, 1), got {self.robust_cos_min}")
        require(self.robust_factor >= 1, f"strategy.robust_factor must be >= 1, got {self.robust_factor}")
        require(self.robust_window >= 3, f"strategy.robust_window must be >= 3, got {self.robust_window}")

    def _check_constants(self) -> None:
        """The outer optimizers' constants and the fold order."""
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.tau > 0,
                f"strategy.beta1 and beta2 must be in [0, 1) and strategy.tau > 0, got {self.beta1}, {self.beta2}, {self.tau}")
        require(self.delay_activation >= 0 and self.staleness_exponent >= 0 and self.grace_max_s >= 0,
                "strategy.delay_activation, staleness_exponent and grace_max_s must be >= 0, got "
                f"{self.delay_activation}, {self.staleness_exponent}, {self.grace_max_s}")
        require(self.fold_order in ("rank", "arrival"), f"strategy.fold_order must be rank or arrival, got '{self.fold_order}'")
