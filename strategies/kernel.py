"""The outer-loop kernel: the one `run` every fl-geo loop shares, told apart by policy hooks.

A loop (synchronous DiLoCo and the FL baselines, the asynchronous family, Streaming DiLoCo /
CoCoDC, HALoS and its regional servers, the sharded Di-PS leader) differs from the others only
in when it steps and whom it sends work to. So the run itself is written once, here: `open`,
the step-0 record, `begin`, `advance` until `done`, `finish`, and `close` always last; each
logged step goes through `record_step`. A loop implements `done` and `advance` (and any other
hook it needs); `strategies/base.py` `OuterLoop` supplies what the kernel calls on the loop's
state (`log_initial`, `evaluate`, `client_eval`, `maybe_checkpoint`, `stop`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from fl_geo.runtime.progress import Progress

if TYPE_CHECKING:
    from fl_geo.config import FlGeoConfig
    from fl_geo.runtime.dispatch import Dispatcher
    from fl_geo.runtime.metrics import MetricsLogger


class NoLiveNode(RuntimeError):
    """Raised inside a move when no node is left to train on; `run` turns it into `stop`."""


class LoopKernel(ABC):
    """The template of every outer loop (see the module docstring)."""

    cfg: FlGeoConfig
    dispatcher: Dispatcher
    logger: MetricsLogger
    history: list[dict[str, Any]]
    total_tokens: int
    progress: Progress | None = None  # the run's progress line, set by `run`

    def run(self, progress: Progress | None = None) -> dict[str, Any]:
        """Run the loop to its budget; the last logged record (empty when none was logged).

        Log the untrained model's loss, `begin` (e.g. the first dispatch), then `advance` (one
        round, event or tick) until `done` or until it returns False (the loop stopped early,
        `stop` says why); a node loss no round can survive (`NoLiveNode`) stops it too. Then
        `finish` (by default: let in-flight jobs end, `drain`). `close` runs last, even after an
        error: what the loop started outside this process (the sharded PS's followers) stops.
        """
        self.progress = progress
        try:
            self.open()
            self.log_initial()
            self.begin()
            while not self.done():
                try:
                    if not self.advance():
                        break
                except NoLiveNode as exc:
                    self.stop(str(exc))
                    break
            self.finish()
            return self.history[-1] if self.history else {}
        finally:
            self.close()

    def open(self) -> None:
        """Before the first evaluation: start what the loop needs outside this process. Nothing by default."""
        return None

    def begin(self) -> None:
        """After the step-0 record: the loop's first move (an asynchronous loop's first dispatch). Nothing by default."""
        return None

    @abstractmethod
    def done(self) -> bool:
        """Whether the budget (steps, rounds or tokens) is spent."""

    @abstractmethod
    def advance(self) -> bool:
        """One move of the policy: a synchronous round, an asynchronous event, a streaming tick.
        False when the loop must stop before its budget (after `stop`)."""

    def finish(self) -> None:
        """After the last move: by default the clean `drain`."""
        self.drain()

    def close(self) -> None:
        """Always last, also after an error: stop what `open` started. Nothing by default."""
        return None

    def drain(self) -> None:
        """Let in-flight jobs finish (nothing is folded), so no node is left mid-message when the
        run ends; a job still without a reply at its deadline is given up (its node named late)."""
        while self.dispatcher.in_flight():
            self.dispatcher.next_event()

    def eval_due(self, step: int, last: bool) -> bool:
        """Whether logged step ``step`` is validated: every ``run.eval_every`` steps and the last."""
        every = self.cfg.run.eval_every
        return bool(every and step % every == 0) or last

    def step_evaluations(self, step: int, last: bool) -> dict[str, float]:
        """The validation a logged step carries when `eval_due`: the server's, by default."""
        return self.evaluate() if self.eval_due(step, last) else {}

    def record_step(self, step: int, metrics: dict[str, Any], last: bool, *, client_eval: bool = True,
                    shown: int | None = None) -> None:
        """Log one outer step: `step_evaluations`, the clients' validation every
        ``run.client_eval_every`` steps and the last (``client_eval``: for loops whose nodes are
        idle between steps), the metrics record, the checkpoint ``run.checkpoint_every`` asks
        for, and the progress line (at ``shown``, default ``step``)."""
        r = self.cfg.run
        metrics.update(self.step_evaluations(step, last))
        if client_eval and r.client_eval_every and (step % r.client_eval_every == 0 or last):
            metrics.update(self.client_eval(step))
        self.history.append(self.logger.log(step, metrics))
        self.maybe_checkpoint(step, last)
        if self.progress is not None:
            self.progress.update(step if shown is None else shown, metrics.get("train/loss"), metrics.get("val/loss"),
                                 tokens=self.total_tokens, virtual_s=metrics.get("time/virtual_s"))

    # ---- what the kernel calls on the loop's state (`OuterLoop`) ----------------------------------
    @abstractmethod
    def log_initial(self) -> None:
        """The step-0 record: the untrained model's validation loss."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """The server's validation of the current model."""

    @abstractmethod
    def client_eval(self, rnd: int) -> dict[str, float]:
        """The clients' validation on their partitions."""

    @abstractmethod
    def maybe_checkpoint(self, step: int, last: bool = False) -> None:
        """A checkpoint after ``step`` when ``run.checkpoint_every`` asks for one."""

    @abstractmethod
    def stop(self, reason: str, quiet: bool = False) -> None:
        """End the run before its budget, for ``reason``."""
