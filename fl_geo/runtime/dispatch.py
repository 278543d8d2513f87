"""Push/pull of jobs on a Flower ``Grid``, with the bookkeeping every strategy needs.

Flower's ``send_and_receive`` polls every 3 s in deployment and hands back all replies at once, so
fl-geo drives ``grid.push_messages``/``grid.pull_messages`` itself (docs/flower.md). The jobs and
events it trades in and the clock protocol are ``fl_geo.runtime.jobs``'s (importable from here
too). One :class:`Dispatcher` serves every strategy:

- at most one message in flight per node (two messages to one node race on ``context.state``);
- error replies and nodes that vanish from ``grid.get_node_ids()`` become events the strategy sees
  once, so their work is never counted twice; replies to abandoned jobs are discarded when they come;
- a clock decides the order in which replies are handed over: arrival order with a wall clock, the
  jobs' modelled finish times with a virtual clock (``fl_geo.timing.clock``), so a seeded simulation gives
  the same event order, and the same model, however the real processes happen to finish;
- asynchronous strategies consume :meth:`Dispatcher.next_event` one event at a time; a synchronous
  round is the special case :meth:`Dispatcher.run_jobs`: "hand everything over once every job of
  the round is resolved" (``fl_geo.runtime.rounds``);
- under a scenario's failure trace (``fl_geo.timing.failures``, virtual clock only; the dispatcher's
  side of it is ``fl_geo.runtime.outages``) a node that is down is not live, a job whose node
  fails before it finishes is handed over at the failure time as a failed job (error `NODE_DOWN`;
  the real ClientApp's reply, when it comes, is discarded), and a node that is repaired is live
  again and free, so its next job carries the latest model;
- every train job's modelled time is booked for goodput (``fl_geo.runtime.goodput``, virtual clock);
- with a wall clock and ``run.wall_faults`` (``fl_geo.runtime.wall_faults``) the same trace makes
  real faults: a train job its node's failure ends is sent with a fault record (its ClientApp
  answers it with an error at the failure), is handed over as a failed job (`NODE_DOWN`) whatever
  the node answers, and the node is not live until its repair.
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from fl_geo.core.deadline import LateLog, ReplyDeadline
from fl_geo.runtime import interrupt, profiling
from fl_geo.runtime.goodput import GoodputMeter, JobCost
from fl_geo.runtime.jobs import NODE_DOWN, TIMED_OUT, Clock, Event, Job, JobTiming
from fl_geo.runtime.membership import Membership, NodeProfile
from fl_geo.runtime.outages import OutagesMixin
from fl_geo.runtime.protocol import REQUEST_RECORD, is_profile_probe
from fl_geo.runtime.rounds import RoundOutcome, run_round
from fl_geo.runtime.wall_faults import FAULT_RECORD, Fault, WallFaults, fault_record

__all__ = [
    "NODE_DOWN", "POLL_IN_PROCESS_S", "POLL_OVER_NETWORK_S", "TIMED_OUT", "Clock", "Dispatcher", "Event",
    "Job", "JobTiming", "NodeProfile", "RoundOutcome", "default_poll_interval", "late_report",
]

log = logging.getLogger("fl_geo")

_VANISHED = object()


POLL_IN_PROCESS_S = 0.02
POLL_OVER_NETWORK_S = 0.25


def default_poll_interval(grid: Grid) -> float:
    """The longest wait between two pulls while nothing arrives, by transport.

    An in-process grid (simulation, the inline grid) answers a pull from memory, so 20 ms costs
    nothing. A deployment grid sends every pull to the SuperLink as an RPC: at 20 ms the SuperLink
    and the ServerApp spend seconds of CPU per minute answering empty pulls, while a SuperNode
    takes seconds per message anyway (it polls every 3 s when idle and starts a ClientApp process
    per message). 250 ms adds at most a quarter of a second to a reply there; right after a reply
    the dispatcher polls fast again (1 ms, doubling), so a burst of replies is pulled at once.
    """
    # Looked up, not imported: importing Flower's deployment grid costs ~1.1 s of CPU, and a grid
    # can only be one if its module is loaded already.
    module = sys.modules.get("flwr.superlink.grid.http_grid")
    http_grid = getattr(module, "HttpGrid", None)
    return POLL_OVER_NETWORK_S if http_grid is not None and isinstance(grid, http_grid) else POLL_IN_PROCESS_S


def late_report(late: LateLog, profiles: Mapping[int, NodeProfile]) -> list[dict[str, Any]]:
    """Who was late, first-late first: each node whose jobs were given up at their reply
    deadline, with its partition, the site it reported, how many of its jobs were given up, the
    longest deadline it was given and how many late replies it sent (discarded). What every
    run's summary.json reports as ``late_nodes``."""
    out = []
    for rec in late.nodes():
        profile = profiles.get(rec.node)
        out.append({
            "node": rec.node,
            "partition": profile.partition_id if profile is not None else -1,
            "site": profile.site if profile is not None else "",
            "late_jobs": rec.late_jobs,
            "deadline_s": round(max(rec.waited_s), 3) if rec.waited_s else None,
            "late_replies": rec.late_replies,
        })
    return out


class Dispatcher(OutagesMixin):
    """Sends jobs to nodes and hands their outcomes over in clock order. What it knows of the
    failure trace (`is_down`, `wait_for_repair`, `take_rejoined`) is `OutagesMixin`'s."""

    def __init__(
        self,
        grid: Grid,
        clock: Clock | None = None,
        poll_interval_s: float | None = None,
        liveness_every_s: float = 2.0,
    ) -> None:
        self.grid = grid
        if clock is None:
            from fl_geo.timing.clock import WallClock

            clock = WallClock()
        self.clock: Clock = clock
        self.poll_interval_s = default_poll_interval(grid) if poll_interval_s is None else poll_interval_s
        self.liveness_every_s = liveness_every_s
        self._jobs: dict[str, Job] = {}  # in flight, not yet handed over
        self._arrived: dict[str, Any] = {}  # job id -> reply (or _VANISHED), in arrival order
        self._abandoned: dict[str, int] = {}  # timed-out jobs: node stays busy until the reply comes
        self._seq = itertools.count()
        self._next_liveness = 0.0
        self._poll = 0.001  # adaptive: 1 ms right after activity, backing off to poll_interval_s
        self.late_replies = 0
        self.membership = Membership()  # who was admitted or refused (fl_geo.runtime.membership)
        # Failure traces (virtual clock): the loop tells which scenario slot a node holds; an
        # asynchronous loop asks to be woken when a repaired node is back (`take_rejoined`).
        self.slot_of: Callable[[int], int] | None = None
        self.wake_on_rejoin = False
        self._rejoined = False
        self.lost_jobs = 0  # jobs lost to the failure trace
        self.wall_faults: WallFaults | None = None  # the trace as real faults (wall clock, run.wall_faults)
        self.goodput: GoodputMeter | None = self._goodput_meter()
        self.held = profiling.HeldReplies()  # plain nodes' replies to the profile probe (fl_geo.runtime.profiling)
        self._kept: list[Event] = []  # events of other jobs that resolved during a profile probe or query
        # How long a job may go without a reply (fl_geo.core.deadline); None: as long as it takes.
        # The strategy sets it from strategy.round_timeout_s / reply_deadline_*.
        self.reply_deadline: ReplyDeadline | None = None
        self.late = LateLog()  # nodes whose jobs were given up at their deadline

    def _goodput_meter(self) -> GoodputMeter | None:
        """A meter on a virtual clock with a scenario: provisioned = each node's up time."""
        scenario = getattr(self.clock, "scenario", None)
        if not self.clock.is_virtual or scenario is None:
            return None
        failures = getattr(self.clock, "failures", None)
        slots = range(scenario.num_nodes)
        if failures is None:
            return GoodputMeter(lambda t: len(slots) * t)
        return GoodputMeter(lambda t: sum(failures.uptime(n, 0.0, t) for n in slots))

    def in_flight_s(self) -> float:
        """Modelled time so far of the train jobs in flight (goodput's ``in_flight`` bucket)."""
        now = self.clock.now()
        return sum(now - j.submitted_at for j in self._jobs.values() if j.kind == MessageType.TRAIN)

    def _book(self, job: Job, t: float, ok: bool) -> None:
        """Book a resolved train job's modelled time for goodput."""
        if self.goodput is None or job.kind != MessageType.TRAIN:
            return
        total = max(0.0, t - job.submitted_at)
        self.goodput.resolved(job.node, JobCost(total, min(job.compute_s, total)), ok)

    # ---- membership -------------------------------------------------------------------------
    def live_nodes(self) -> list[int]:
        """The grid's nodes, less those down now under a failure trace (virtual clock)."""
        nodes = sorted(self.grid.get_node_ids())
        if self._trace() or self.wall_faults is not None:
            nodes = [n for n in nodes if not self.is_down(n)]
        return nodes

    def busy_nodes(self) -> set[int]:
        """Nodes with a job in flight, abandoned, or whose event is not handed over yet."""
        return {j.node for j in self._jobs.values()} | set(self._abandoned.values()) | {e.job.node for e in self._kept}

    def in_flight(self) -> list[Job]:
        """Jobs whose event `next_event` has not handed over yet."""
        return list(self._jobs.values()) + [e.job for e in self._kept]

    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]:
        """Block until ``minimum`` nodes are connected; a clear error if they never come."""
        deadline = time.monotonic() + timeout_s
        nodes = self.live_nodes()
        while len(nodes) < minimum:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of the {minimum} required nodes connected within {timeout_s:.0f} s. "
                    f"Start {minimum} SuperNodes (with `flwr run`: --federation-config 'num-supernodes={minimum}'; "
                    "`fl-geo flwr-run` sizes its local federation from run.num_clients), or ask for fewer "
                    "(run.num_clients, run.min_nodes); run.wait_nodes_timeout_s sets the wait"
                )
            interrupt.check()
            time.sleep(0.2)
            nodes = self.live_nodes()
        return nodes

    def query_profiles(self, node_ids: Iterable[int], timeout_s: float = 60.0,
                       known: Mapping[int, NodeProfile] | None = None) -> dict[int, NodeProfile]:
        """Ask ``node_ids`` for their profiles with a ``query`` message (`profiling.query_profiles`)."""
        return profiling.query_profiles(self, node_ids, timeout_s, known)

    # ---- jobs ---------------------------------------------------------------------------------
    def submit(self, messages: Sequence[Message], timings: Sequence[JobTiming] | None = None,
               meta: Sequence[dict[str, Any]] | None = None, timeout_s: float = 0.0) -> list[Job]:
        """Push one message per node; with a virtual clock each job's finish time is fixed now.

        A node that already has a job in flight is refused (ValueError): the caller must wait for
        its event first. A node unknown to the grid yields an immediate "vanished" event. A plain
        node's first train job that its reply to the profile probe answers (`HeldReplies`) is not
        sent: that reply is its outcome. A profile probe is a ``query`` job for the clock and
        goodput (control, not modelled work), whatever message type it travels as.
        """
        dst = [m.metadata.dst_node_id for m in messages]
        if len(set(dst)) != len(dst):
            raise ValueError("at most one message per node (they would race on context.state)")
        busy = self.busy_nodes() & set(dst)
        if busy:
            raise ValueError(f"nodes {sorted(busy)} still have a job in flight")
        if timings is not None and len(timings) != len(messages):
            raise ValueError("one JobTiming per message")
        kinds = [MessageType.QUERY if is_profile_probe(m) else m.metadata.message_type for m in messages]
        faults = [self._plan_fault(m) if k == MessageType.TRAIN else None for m, k in zip(messages, kinds, strict=True)]
        held = [None if f is not None else h for h, f in zip(map(self.held.take, messages), faults, strict=True)]
        send = [m for m, h in zip(messages, held, strict=True) if h is None]
        pushed = iter(list(self.grid.push_messages(send)) if send else [])
        ids = [next(pushed) if h is None else f"held-{next(self._seq)}" for h in held]
        jobs = []
        now = self.clock.now()
        sent_wall = time.monotonic()
        for i, (mid, nid) in enumerate(zip(ids, dst, strict=True)):
            job_id = mid or f"unsent-{nid}-{next(self._seq)}"
            job = Job(job_id, nid, kinds[i], next(self._seq), now, dict(meta[i]) if meta else {})
            timing = timings[i] if timings is not None else JobTiming(slot=0)
            job.slot = timing.slot
            job.fault = faults[i]
            job.steps, job.sent_wall = timing.steps, sent_wall
            job.timeout_s = timeout_s if timeout_s > 0 else None
            if timing.free and self.clock.is_virtual:
                self.clock.schedule_at(job_id, now, node=timing.slot)
            else:
                if self.goodput is not None:
                    job.compute_s = self.clock.scenario.compute_time(timing.slot, timing.steps)  # type: ignore[attr-defined]
                # only train work is lost to the failure trace (control queries are not modelled work)
                self.clock.schedule(job_id, timing.slot, steps=timing.steps, bytes_down=timing.bytes_down,
                                    bytes_up=timing.bytes_up, peer_region=timing.peer_region,
                                    traced=job.kind == MessageType.TRAIN)
            self._jobs[job_id] = job
            if held[i] is not None:
                self._arrived[job_id] = held[i]
            elif not mid:  # Flower returns an empty id for a node it does not know
                self._arrived[job_id] = _VANISHED
            jobs.append(job)
        return jobs

    def _plan_fault(self, msg: Message) -> Fault | None:
        """Under ``run.wall_faults``: whether the failure trace ends this train job, and if so tell
        its ClientApp (a record it acts on; see fl_geo.runtime.wall_faults). Train jobs only."""
        if self.wall_faults is None:
            return None
        slot = self._slot(msg.metadata.dst_node_id)
        rec = msg.content.config_records.get(REQUEST_RECORD)
        fault = self.wall_faults.plan(slot, dict(rec) if rec is not None else {})
        if fault is not None:
            msg.content.config_records[FAULT_RECORD] = fault_record(fault)
        return fault

    def abandon(self, job: Job) -> None:
        """Give up on a job (round timeout): its node stays busy until its late reply is pulled."""
        if self._jobs.pop(job.id, None) is None:
            return
        self._book(job, self.clock.now(), ok=False)
        self.clock.cancel(job.id)
        if self._arrived.pop(job.id, None) is None:
            self._abandoned[job.id] = job.node

    def _wait(self) -> None:
        """Sleep before the next pull; short right after a reply, longer while nothing comes."""
        time.sleep(self._poll)
        self._poll = min(self._poll * 2, self.poll_interval_s)

    def pause(self) -> None:
        """Nothing can be handed over yet: notice nodes that vanished, then sleep before the next
        pull (how a synchronous round waits, `fl_geo.runtime.rounds`)."""
        self._check_liveness()
        self._wait()

    def poll(self) -> bool:
        """Pull once without waiting (replies are held for their turn). A transport whose
        clients fetch the model themselves calls it right after `submit`, so an in-process grid
        runs them now, at the model version they were sent, as real nodes would start at once."""
        got = self._pull()
        self._check_liveness()
        return got

    def collect_late(self) -> None:
        """Pull the replies of given-up jobs only, so that a late node that has answered since is
        free again before the loop picks its next nodes. Nothing else is pulled: when and in
        which order other replies are handed over stays as it was."""
        if self._abandoned:
            self._pull(list(self._abandoned))

    def _pull(self, ids: list[str] | None = None) -> bool:
        interrupt.check()  # every wait of every loop passes here: Ctrl-C ends the run at its next poll
        if ids is None:
            ids = [j for j in self._jobs if j not in self._arrived] + list(self._abandoned)
        if not ids:
            return False
        got = False
        for reply in self.grid.pull_messages(ids):
            mid = reply.metadata.reply_to_message_id
            if mid in self._abandoned:
                node = self._abandoned.pop(mid)
                self.late_replies += 1
                if node in self.late:
                    self.late.replied_late(node)
                    log.warning("node %s (slot %s) replied after its job was given up; the reply is discarded and "
                                "the node gets work again", node, self._slot(node))
            elif mid in self._jobs and mid not in self._arrived:
                self._arrived[mid] = reply
                got = True
                job = self._jobs[mid]
                # a profile query or probe is not timed: a plain ClientApp trains a whole job to
                # answer the probe, an fl-geo one answers at once, so their median means nothing
                if self.reply_deadline is not None and job.kind != MessageType.QUERY and not reply.has_error():
                    self.reply_deadline.observe((job.kind, job.steps), time.monotonic() - job.sent_wall)
        if got:
            self._poll = 0.001
        return got

    def _check_liveness(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_liveness:
            return
        self._next_liveness = now + self.liveness_every_s
        live = set(self.grid.get_node_ids())
        for jid, job in self._jobs.items():
            if jid not in self._arrived and job.node not in live:
                log.warning("node %s vanished with a job in flight; dropped", job.node)
                self._arrived[jid] = _VANISHED
        for jid, node in list(self._abandoned.items()):
            if node not in live:
                self._abandoned.pop(jid)

    def deadline_s(self, job: Job) -> float:
        """The wall seconds ``job`` may go without a reply: its own ``timeout_s``, else the rule's
        current bound for its kind and steps (asked anew each time, so the first jobs' generous
        bound tightens as soon as comparable jobs have replied; profile queries and probes are
        never timed, so without their own bound they get the rule's first-jobs bound);
        ``math.inf`` for none."""
        if job.timeout_s is not None:
            return job.timeout_s
        if self.reply_deadline is None:
            return math.inf
        return self.reply_deadline.seconds((job.kind, job.steps))

    def _expire(self) -> Event | None:
        """Give up the oldest job still without a reply whose deadline has passed, if any.

        Called only right after a pull that brought nothing, so a reply that came while the
        server was busy elsewhere is never mistaken for a missing one. The job is abandoned (its
        node stays busy until its late reply is pulled, then that reply is discarded) and its
        node is recorded in `late`."""
        now = time.monotonic()
        for jid, job in self._jobs.items():  # in submission order
            if jid in self._arrived:
                continue
            limit = self.deadline_s(job)
            if now - job.sent_wall <= limit:
                continue
            self.abandon(job)
            self.late.gave_up(job.node, limit)
            log.warning("node %s (slot %s) sent no reply to its %s job within %.1f s; the job is given up and the node "
                        "gets no new work until it replies", job.node, job.slot, job.kind, limit)
            return Event(job, None, TIMED_OUT, self.clock.now())
        return None

    def _resolve(self, job_id: str) -> Event:
        job = self._jobs.pop(job_id)
        reply = self._arrived.pop(job_id)
        if reply is _VANISHED:
            self.clock.cancel(job_id)
            self._book(job, self.clock.now(), ok=False)
            return Event(job, None, "vanished", self.clock.now())
        lost = self.clock.lost(job_id)
        t = self.clock.complete(job_id)
        if job.fault is not None and self.wall_faults is not None:  # whatever it answered, its node failed
            self.wall_faults.failed(job.node, job.fault)
            self.lost_jobs += 1
            log.info("node %s (slot %s) failed (wall fault, modelled %.1f s); its job is lost, down for %.2f s",
                     job.node, self._slot(job.node), job.fault.virtual_down, job.fault.down_s)
            return Event(job, None, NODE_DOWN, t)
        self._book(job, t, ok=not lost and not reply.has_error())
        if lost:  # its node failed first: whatever the ClientApp replied is discarded
            self.lost_jobs += 1
            log.info("node %s (slot %s) failed at virtual %.1f s; its job is lost", job.node, job.slot, t)
            return Event(job, None, NODE_DOWN, t)
        if reply.has_error():
            err = f"{reply.error.code}: {reply.error.reason}"
            level = logging.DEBUG if job.meta.get("quiet_errors") else logging.WARNING
            log.log(level, "node %s replied with an error, dropped: %s", job.node, err)
            return Event(job, reply, err, t)
        return Event(job, reply, None, t)

    def _ready(self) -> str | None:
        """The job whose outcome may be handed over now, if any."""
        vanished = next((j for j, r in self._arrived.items() if r is _VANISHED), None)
        if vanished is not None:
            return vanished  # a dead node's job never finishes in any clock
        if self.clock.is_virtual:
            due = self.clock.due()
            return due if due is not None and due in self._arrived else None
        return next(iter(self._arrived), None)

    def next_event(self, deadline: float | None = None, block: bool = True) -> Event | None:
        """The next resolved job in clock order, or None.

        None means: nothing is in flight, or ``deadline`` (clock time) came first (a virtual clock
        then stands at the deadline), or ``block`` is False and nothing can be handed over yet, or
        (with ``wake_on_rejoin``) a node repaired under the failure trace is back: `take_rejoined`
        is then True. Without ``wake_on_rejoin`` a repair just moves virtual time on. Events kept
        back while a profile probe or query ran (``run_jobs(keep_foreign=True)``) come first. A job
        whose wall deadline (`deadline_s`) passed without a reply comes as a failed event (error
        `TIMED_OUT`), so no wait, the final drain of a run included, outlasts the deadline.
        """
        if self._kept:
            return self._kept.pop(0)
        virtual = self.clock.is_virtual
        while True:
            if self.wall_faults is not None and self.wake_on_rejoin and self.wall_faults.take_repaired():
                self._rejoined = True  # a node is back from a wall fault: the loop gives it work
                return None
            if virtual and self._rejoin_first(deadline):
                if self.wake_on_rejoin:
                    self._rejoined = True
                    return None
                continue
            jid = self._ready()
            if jid is not None and (
                self._arrived[jid] is _VANISHED or not virtual or deadline is None
                or self.clock.finish_time(jid) <= deadline
            ):
                return self._resolve(jid)
            if virtual and deadline is not None:
                due = self.clock.due()
                if due is None or self.clock.finish_time(due) > deadline:
                    self.clock.advance_to(deadline)  # the window closes before the next event
                    return None
            if not self._jobs:
                if self._abandoned:
                    self._pull()  # collect late replies so their nodes become free again
                    self._check_liveness()
                return None
            if not virtual and deadline is not None and self.clock.now() >= deadline:
                return None
            got = self._pull()
            self._check_liveness()
            if not got:
                late = self._expire()
                if late is not None:
                    return late
                if not block:
                    return None
                self._wait()

    def hand_over_next(self, events: list[Event]) -> None:
        """Hand ``events`` over, in order and before any other, by the next `next_event` calls
        (a synchronous round's events of other jobs, ``run_jobs(keep_foreign=True)``)."""
        self._kept[:0] = events

    # A synchronous round (`fl_geo.runtime.rounds.run_round`): push one message per node, hand
    # good replies over in groups, and return what happened to every job.
    run_jobs = run_round
