"""Push/pull of jobs on a Flower ``Grid``, with the bookkeeping every strategy needs.

Flower's ``send_and_receive`` polls every 3 s in deployment and hands back all replies at once, so
fl-geo drives ``grid.push_messages``/``grid.pull_messages`` itself (FLOWER_NOTES.md). This module owns
that loop: at most one message in flight per node (two messages to one node race on
``context.state``), error replies and nodes that vanish from ``grid.get_node_ids()`` are dropped and
logged, late replies of an abandoned job are discarded, and replies are handed to the strategy in a
deterministic order so that a seeded simulation folds floating-point sums in the same order every time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

log = logging.getLogger("fl_geo")

PROFILE_KEY = "profile"


@dataclass
class NodeProfile:
    """What a node told the server about itself (its ``node_config`` and hardware)."""

    node_id: int
    partition_id: int
    num_partitions: int
    device: str = "cpu"
    site: str = ""

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key that does not depend on Flower's random node ids."""
        return (self.partition_id, self.node_id)


@dataclass
class RoundOutcome:
    """What happened to the jobs of one round."""

    replied: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    vanished: list[int] = field(default_factory=list)
    timed_out: list[int] = field(default_factory=list)


class Dispatcher:
    """Sends jobs to nodes and hands their replies over in a chosen order."""

    def __init__(self, grid: Grid, poll_interval_s: float = 0.02, liveness_every_s: float = 2.0):
        self.grid = grid
        self.poll_interval_s = poll_interval_s
        self.liveness_every_s = liveness_every_s
        # message id -> node id of every job whose reply has not been pulled yet (this run's jobs,
        # including abandoned ones: their node stays busy until the reply, or an error, arrives).
        self._inflight: dict[str, int] = {}
        self.late_replies = 0

    # ---- membership -------------------------------------------------------------------------
    def live_nodes(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def busy_nodes(self) -> set[int]:
        return set(self._inflight.values())

    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]:
        """Block until ``minimum`` nodes are connected; a clear error if they never come."""
        deadline = time.monotonic() + timeout_s
        nodes = self.live_nodes()
        while len(nodes) < minimum:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(nodes)} of the {minimum} required nodes connected within {timeout_s:.0f} s "
                    "(run.min_nodes / run.wait_nodes_timeout_s)"
                )
            time.sleep(0.2)
            nodes = self.live_nodes()
        return nodes

    def query_profiles(self, node_ids: Iterable[int], timeout_s: float = 60.0) -> dict[int, NodeProfile]:
        """Ask each node for its partition and device (``NodeInfo`` has no ``node_config``)."""
        msgs = []
        for nid in node_ids:
            content = RecordDict({"config": ConfigRecord({"ask": PROFILE_KEY})})
            msgs.append(Message(content, dst_node_id=nid, message_type=MessageType.QUERY))
        profiles: dict[int, NodeProfile] = {}

        def keep(batch: Sequence[tuple[int, Message]]) -> None:
            for nid, reply in batch:
                rec = reply.content.config_records.get(PROFILE_KEY)
                if rec is None or "partition_id" not in rec or "num_partitions" not in rec:
                    log.warning("node %s answered the profile query without partition_id/num_partitions; ignored", nid)
                    continue
                profiles[nid] = NodeProfile(
                    node_id=nid,
                    partition_id=int(rec["partition_id"]),
                    num_partitions=int(rec["num_partitions"]),
                    device=str(rec.get("device", "cpu")),
                    site=str(rec.get("site", "")),
                )

        outcome = self.run_jobs(msgs, on_replies=keep, order=None, timeout_s=timeout_s)
        for nid, err in outcome.errors.items():
            log.warning("node %s did not answer the profile query: %s", nid, err)
        return profiles

    # ---- jobs ---------------------------------------------------------------------------------
    def run_jobs(
        self,
        messages: list[Message],
        on_replies: Callable[[Sequence[tuple[int, Message]]], None],
        order: list[int] | None,
        timeout_s: float = 0.0,
    ) -> RoundOutcome:
        """Push one message per node, then hand the good replies to ``on_replies`` in groups.

        A group is every reply that can be handed over at one pull: the strategy folds a group in
        one pass over its buffers, which is several times cheaper than one pass per reply when
        replies arrive together. ``order`` lists the destination nodes in hand-over order: a reply
        that arrives early waits until every node before it has replied or failed (deterministic
        folding). ``None`` hands replies over as they arrive. ``timeout_s`` > 0 abandons the jobs still running after that
        long; their node stays busy until its late reply is pulled and discarded.
        """
        dst = [m.metadata.dst_node_id for m in messages]
        if len(set(dst)) != len(dst):
            raise ValueError("at most one message per node per call (they would race on context.state)")
        busy = self.busy_nodes() & set(dst)
        if busy:
            raise ValueError(f"nodes {sorted(busy)} still have a job in flight")
        msg_ids = list(self.grid.push_messages(messages))
        pending: dict[str, int] = {}
        outcome = RoundOutcome()
        for mid, nid in zip(msg_ids, dst, strict=True):
            if not mid:  # Flower returns an empty id when the node is unknown
                outcome.vanished.append(nid)
                continue
            pending[mid] = nid
            self._inflight[mid] = nid
        queue = [n for n in (order if order is not None else dst) if n not in outcome.vanished]
        ready: dict[int, Message | None] = {}  # node -> reply, or None when it failed
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        next_liveness = time.monotonic() + self.liveness_every_s

        def hand_over() -> None:
            group: list[tuple[int, Message]] = []
            while queue and queue[0] in ready:
                nid = queue.pop(0)
                reply = ready.pop(nid)
                if reply is not None:
                    group.append((nid, reply))
                    outcome.replied.append(nid)
            if group:
                on_replies(group)

        while pending:
            got = False
            for reply in self.grid.pull_messages(list(self._inflight)):
                got = True
                mid = reply.metadata.reply_to_message_id
                nid = self._inflight.pop(mid, None)
                if mid not in pending:
                    self.late_replies += 1  # a reply to a job abandoned in an earlier round
                    continue
                pending.pop(mid)
                if reply.has_error():
                    err = f"{reply.error.code}: {reply.error.reason}"
                    log.warning("node %s replied with an error, dropped: %s", nid, err)
                    outcome.errors[nid] = err
                    ready[nid] = None
                else:
                    ready[nid] = reply
            if got:
                if order is None:
                    queue.sort(key=lambda n: n not in ready)  # arrival order (stable sort)
                hand_over()
            if not pending:
                break
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + self.liveness_every_s
                live = set(self.grid.get_node_ids())
                for mid, nid in list(pending.items()):
                    if nid not in live:
                        log.warning("node %s vanished with a job in flight; dropped", nid)
                        pending.pop(mid)
                        self._inflight.pop(mid, None)
                        outcome.vanished.append(nid)
                        ready[nid] = None
                hand_over()
            if deadline is not None and now > deadline:
                for _mid, nid in list(pending.items()):
                    log.warning("node %s exceeded the round timeout; its job is abandoned", nid)
                    outcome.timed_out.append(nid)
                    ready[nid] = None
                pending.clear()
                hand_over()
                break
            if not got:
                time.sleep(self.poll_interval_s)
        hand_over()
        return outcome
