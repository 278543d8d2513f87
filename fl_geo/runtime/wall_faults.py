"""Wall-clock faults: a scenario's failure trace replayed as real faults in a Flower simulation.

``run.wall_faults: true`` (with ``run.clock: wall``) takes the failure trace of ``run.scenario``
(``fl_geo.timing.failures``) and makes the nodes really fail: the ClientApp of a node that fails
with a job in flight answers that job with an *error reply* at the failure, and the server sends
the node nothing until its repair. So the same scenario that a virtual-clock run replays on its
modelled time axis exercises the real paths of a wall-clock run: error replies in
``fl_geo.runtime.dispatch``, the strategy's failed-job accounting, live-node selection and the
wait for a repair.

**Which jobs fail: by dispatch order, per node (deterministic).** Mapping the trace onto wall
time (``now / scale``) would make the set of failed jobs depend on how fast the real processes
ran. Instead each scenario node (slot) has its own modelled time line: its jobs are laid end to
end in the order they are sent to it, each lasting its modelled time (the scenario's download,
``inner_steps`` x step time and upload at the request's wire precisions, link windows included).
A job fails when the trace puts a failure of its node inside that interval; the node's next job
then starts at the repair. Which jobs fail, and after how much of their modelled time, is thus a
function of the trace and of the sequence of jobs each node is sent, not of real timing: a run
whose dispatch sequence is deterministic (synchronous rounds, one node's jobs in order) loses
the same jobs every time. It is *not* the virtual clock's time line (that one also counts the
time a node waits between jobs): waiting is not modelled here, so a trace meets a wall-fault run
later in its jobs than the same trace meets a virtual-clock run.

**When, in wall time: ``run.wall_fault_scale``** wall seconds per modelled second. A failing job
errors ``scale x (failure - job start)`` s after the ClientApp receives it (the job in flight
until then), and the node stays down ``scale x repair time`` s after the server saw the error
(for good when the trace never repairs it). ``scale = 0``: the job errors at once and the node is
back for its next job.

The fault travels to the ClientApp in its own record (`FAULT_RECORD`), read by `wall_fault_mod`
(a Flower ClientApp mod that fl-geo's ClientApp installs); the server books the job as lost
whatever the node answers, so a ClientApp without the mod (a plain Flower one) is failed too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message

from fl_geo.timing.cost import CostModel
from fl_geo.timing.failures import FailureTimeline
from fl_geo.timing.scenario import Scenario

__all__ = ["FAULT_RECORD", "WALL_FAULT_CODE", "Fault", "WallFaults", "wall_fault_mod"]

FAULT_RECORD = "fl-geo-fault"
WALL_FAULT_CODE = 4_180  # the error code of a job failed by a wall fault (not one of Flower's)


@dataclass(frozen=True)
class Fault:
    """A job that its node's failure ends: when (wall seconds into the job) and for how long the
    node is then down (wall seconds; inf: for good), with the modelled times they come from."""

    fail_after_s: float
    down_s: float
    virtual_start: float
    virtual_down: float
    virtual_up: float


class WallFaults:
    """The failure trace of a scenario, replayed on the jobs a wall-clock run sends."""

    def __init__(self, scenario: Scenario, scale: float, num_params: int,
                 time_fn: Callable[[], float] = time.monotonic) -> None:
        timeline = FailureTimeline.from_scenario(scenario)
        if timeline is None:
            raise ValueError(f"scenario '{scenario.name}' models no failure (failures / failure_process)")
        self.scenario = scenario
        self.timeline = timeline
        self.scale = float(scale)
        self.num_params = num_params
        self.cost = CostModel(num_params, scenario)  # what a job's transfers and steps take
        self._time = time_fn
        self.cursor: dict[int, float] = {}  # slot -> modelled start of its next job
        self.down_until: dict[int, float] = {}  # grid node -> wall time it is back
        self.faults: list[tuple[int, Fault]] = []  # (slot, fault), in the order they were planned
        self._announced: set[int] = set()  # repaired nodes already reported by `take_repaired`

    def plan(self, slot: int, request: dict[str, Any]) -> Fault | None:
        """Lay the next job of scenario node ``slot`` on its time line; the fault that ends it, if any.

        ``request``: the job's fl-geo request fields (``inner_steps``, ``wire_down``, ``wire_up``;
        a plain Flower request has none: the scenario's step count is then 1, the payloads fp32).
        """
        if not 0 <= slot < self.scenario.num_nodes:
            return None
        steps = int(request.get("inner_steps", 1) or 1)
        t0 = self.cursor.get(slot, 0.0)
        if math.isinf(t0):  # down for good
            fault = Fault(0.0, math.inf, t0, t0, math.inf)
        else:
            wire = str(request.get("wire_down", "fp32")), str(request.get("wire_up", "fp32"))
            cost, deltas = self.cost, None
            from dataclasses import replace

            from fl_geo.runtime.wire_settings import uplink_from_json

            if request.get("wire_compress"):  # wire.compress: the update is charged compressed
                cost = replace(cost, uplink=uplink_from_json(str(request["wire_compress"])))
            if request.get("wire_compress_down"):  # wire.compress_down: the deltas the job carries
                cost = replace(cost, downlink=uplink_from_json(str(request["wire_compress_down"]), "wire_compress_down"))
                if request.get("down_from") is not None:
                    deltas = int(request["down_version"]) - int(request["down_from"])
            total = cost.job_time(slot, steps, *wire, start=t0, deltas=deltas).total
            # a node down when its job would start fails it at once (and stays down until its repair)
            failed = self.timeline.first_down(slot, t0, t0 + total)
            if failed is None:
                self.cursor[slot] = t0 + total
                return None
            back = self.timeline.up_at(slot, failed)
            fault = Fault((failed - t0) * self.scale, (back - failed) * self.scale if math.isfinite(back) else math.inf,
                          t0, failed, back)
        self.cursor[slot] = fault.virtual_up
        self.faults.append((slot, fault))
        return fault


    def failed(self, node: int, fault: Fault) -> None:
        """The server saw ``node``'s job fail now: it is down for the fault's repair time."""
        self.down_until[node] = self._time() + fault.down_s
        self._announced.discard(node)

    def is_down(self, node: int) -> bool:
        return self.down_until.get(node, -math.inf) > self._time()

    def next_up(self, nodes: list[int]) -> float | None:
        """Wall time (this clock's) when the first of ``nodes`` that is down now is back; None if none is."""
        times = [self.down_until[n] for n in nodes if self.is_down(n) and math.isfinite(self.down_until[n])]
        return min(times) if times else None

    def take_repaired(self) -> bool:
        """True once for each node whose repair time has passed since it failed."""
        now = self._time()
        back = [n for n, t in self.down_until.items() if t <= now and n not in self._announced]
        self._announced.update(back)
        return bool(back)


def fault_record(fault: Fault) -> ConfigRecord:
    """What the ClientApp is told (wall seconds; the down time only for its log line)."""
    return ConfigRecord({"fail_after_s": float(fault.fail_after_s),
                         "down_s": float(fault.down_s) if math.isfinite(fault.down_s) else -1.0})


def wall_fault_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: a message that carries `FAULT_RECORD` is a job its node will not finish.

    The node works on it for ``fail_after_s`` wall seconds (it is in flight), then fails: the
    reply is an error (`WALL_FAULT_CODE`), never an update. Other messages pass through."""
    rec = msg.content.config_records.get(FAULT_RECORD)
    if rec is None:
        return call_next(msg, context)
    time.sleep(max(0.0, float(rec.get("fail_after_s", 0.0))))
    down = float(rec.get("down_s", -1.0))
    reason = f"node down (wall fault from the failure trace; back in {down:.3g} s)" if down >= 0 else \
        "node down (wall fault from the failure trace; for good)"
    return Message(Error(code=WALL_FAULT_CODE, reason=reason), reply_to=msg)
