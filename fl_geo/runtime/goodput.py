"""Goodput: the share of provisioned node-time that produced accepted progress (virtual clock).

Provisioned node-time is the sum over the run's nodes of the virtual seconds each was *up*
(a failure trace's down time is not provisioned: a failed node can do no work and a comparison of
methods under one trace should not charge a method for it). Every provisioned second falls in
exactly one bucket, so the buckets add up to the provisioned time:

- ``useful``: compute time (inner steps x modelled step time) of train jobs whose update was
  accepted, i.e. folded into an outer step;
- ``comm``: the modelled model transfers (down and up) of those accepted jobs;
- ``lost``: the whole time of jobs that produced nothing because of a fault: lost to a failure
  of the trace (up to the failure), error replies, vanished nodes, round time-outs;
- ``rejected``: the whole time of jobs whose reply was refused (invalid, outlier, beyond the
  norm bound) or whose round took no outer step (fewer than ``strategy.min_replies``);
- ``stale``: the whole time of jobs discarded as too stale: a quorum round's late reply under
  ``strategy.late_replies=drop`` (asynchronous loops down-weight stale updates instead of
  discarding them, and a late reply that is folded is useful);
- ``in_flight``: the time so far of jobs not resolved yet (at the end of a run: work that will
  never be folded);
- ``waiting``: the rest: up time with no job, e.g. waiting for a synchronous round's slowest node
  and all-reduce, or for an asynchronous step's new model.

The meter is framework-free: the dispatcher reports resolved jobs, the loop its verdicts. Its
buckets go into a server checkpoint (`GoodputMeter.state_dict`), so a resumed run's ratio covers
the whole run; the jobs in flight when the checkpoint was taken are booked there as ``lost``, as
the resumed server sends that work again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BUCKETS", "GoodputMeter", "JobCost"]

BUCKETS = ("useful", "comm", "lost", "rejected", "stale", "in_flight", "waiting")


@dataclass(frozen=True)
class JobCost:
    """A resolved train job's modelled time: all of it, and the compute part of it."""

    total_s: float
    compute_s: float


class GoodputMeter:
    """Cumulative goodput accounting over one run.

    ``provisioned(t)``: node-seconds the run's nodes were up in ``[0, t)``. Replies wait in
    ``held`` (per node) for the loop's verdict: :meth:`verdict` moves the latest one to a loss
    bucket, :meth:`settle` moves every held one to ``useful``/``comm`` (or to ``rejected`` when
    the outer step they were meant for was not taken).
    """

    def __init__(self, provisioned: Callable[[float], float]) -> None:
        self._provisioned = provisioned
        self.seconds = {b: 0.0 for b in BUCKETS if b not in ("in_flight", "waiting")}
        self.held: dict[int, list[JobCost]] = {}

    def resolved(self, node: int, cost: JobCost, ok: bool) -> None:
        """A train job ended: a reply (held for the verdict) or a fault (``lost`` at once)."""
        if not ok:
            self.seconds["lost"] += cost.total_s
            return
        self.held.setdefault(node, []).append(cost)

    def verdict(self, node: int, bucket: str = "rejected") -> None:
        """The loop refused ``node``'s latest reply; unknown nodes are ignored (not a train reply)."""
        if bucket not in ("rejected", "stale"):
            raise ValueError(f"a refused reply goes to 'rejected' or 'stale', not {bucket!r}")
        jobs = self.held.get(node)
        if jobs:
            self.seconds[bucket] += jobs.pop().total_s

    def settle(self, accepted: bool = True) -> None:
        """An outer step was logged: every reply still held was folded into it (``accepted``)
        or the step was not taken and they were all wasted."""
        for jobs in self.held.values():
            for c in jobs:
                if accepted:
                    self.seconds["useful"] += c.compute_s
                    self.seconds["comm"] += c.total_s - c.compute_s
                else:
                    self.seconds["rejected"] += c.total_s
        self.held.clear()

    def metrics(self, now: float, in_flight_s: float) -> dict[str, float]:
        """``goodput/ratio`` (useful / provisioned) and every bucket in seconds, cumulative to ``now``.

        Replies still held count as in flight (their verdict is not known yet)."""
        provisioned = self._provisioned(now)
        held = sum(c.total_s for jobs in self.held.values() for c in jobs)
        out = {f"goodput/{b}_s": s for b, s in self.seconds.items()}
        out["goodput/in_flight_s"] = in_flight_s + held
        out["goodput/waiting_s"] = provisioned - sum(self.seconds.values()) - in_flight_s - held
        out["goodput/provisioned_s"] = provisioned
        out["goodput/ratio"] = self.seconds["useful"] / provisioned if provisioned > 0 else math.nan
        return out

    # ---- checkpoint and resume --------------------------------------------------------------------
    def state_dict(self, in_flight_s: float = 0.0) -> dict[str, Any]:
        """The buckets and the replies held for a verdict, for a server checkpoint. ``in_flight_s``
        (the jobs in flight now) is booked as ``lost`` in it: a checkpoint keeps no job in flight,
        so a run resumed from it sends that work again and the time already spent on it is lost."""
        seconds = dict(self.seconds)
        seconds["lost"] += max(0.0, float(in_flight_s))
        return {"seconds": seconds,
                "held": {str(node): [[c.total_s, c.compute_s] for c in jobs] for node, jobs in self.held.items()}}

    def prepare_load(self, state: Any) -> Callable[[], None]:
        """Check a `state_dict` whole and return the function that installs it; ValueError (the
        meter unchanged) for a malformed one: other buckets, a negative or non-finite second, a
        held job whose compute time exceeds its total."""
        if not isinstance(state, dict) or set(state) != {"seconds", "held"}:
            raise ValueError("goodput state must be a mapping with 'seconds' and 'held'")
        seconds, held = state["seconds"], state["held"]
        if not isinstance(seconds, dict) or set(seconds) != set(self.seconds):
            raise ValueError(f"goodput state must have the buckets {sorted(self.seconds)}")
        parsed = {b: _seconds(v, f"goodput bucket {b!r}") for b, v in seconds.items()}
        if not isinstance(held, dict):
            raise ValueError("goodput state's held replies must be a mapping of node to jobs")
        jobs: dict[int, list[JobCost]] = {}
        for node, costs in held.items():
            try:
                key = int(node)
            except (TypeError, ValueError):
                raise ValueError(f"goodput state holds replies of node {node!r:.40}, not a node id") from None
            if not isinstance(costs, list) or not all(isinstance(c, list) and len(c) == 2 for c in costs):
                raise ValueError(f"goodput state's held jobs of node {key} must be [total_s, compute_s] pairs")
            pairs = [(_seconds(t, "a held job's total_s"), _seconds(c, "a held job's compute_s")) for t, c in costs]
            if any(c > t for t, c in pairs):
                raise ValueError(f"goodput state holds a job of node {key} with more compute than total time")
            jobs[key] = [JobCost(t, c) for t, c in pairs]

        def install() -> None:
            self.seconds = parsed
            self.held = jobs

        return install


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r:.40}")
    return float(value)
