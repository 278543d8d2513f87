"""What runs on a node, fl-geo's ClientApp or a plain Flower ClientApp, found out without making
either one raise.

A strategy built with ``clients="auto"`` (the default in a Flower user's own ServerApp) does not
know what its nodes run. A ``query`` message works for fl-geo's ClientApp, but a plain Flower
ClientApp has no query handler: Flower raises on the node and logs a traceback for each node
(``No query function registered with name 'default'``). So under ``"auto"`` the question travels
as a ``train`` message, which every ClientApp that trains handles: the *profile probe*.

- It carries what a plain node's first train job carries: the model in fp32 under ``"arrays"``
  and the user's Flower train config under ``"config"``, and the `ProfileQuery` under
  ``"fl-geo"`` (`probe_message`).
- fl-geo's ClientApp answers with its profile and trains nothing: a reply declared with payload
  ``none`` and a ``"profile"`` record (``fl_geo.clients.profile``).
- A plain ClientApp trains and replies the trained model, undeclared. That reply is kept
  (`HeldReplies`) and handed over as the reply to the node's first train job when that job
  carries the same model and config: it is exactly what the node would compute for it. A first
  job with another model (the node was not sampled in the first round, a resumed run, a node
  that joins mid-run and waits while the model moves on) drops it: the node then trained once
  for nothing.

A declared reply is a claim and is checked like any profile: another protocol version, a
malformed declaration, a payload other than ``none``, a missing or malformed profile record is
refused with its reason in one WARNING line (`Membership.refuse`) and the node gets no job. An
error reply is logged in one WARNING line and the node is taken for a plain ClientApp (as a
node that could not answer the query was); its later jobs are benched if they keep failing. A
node whose probe times out stays unprofiled and is probed again once it is free.

The cost for fl-geo's ClientApp under ``"auto"``: the model travels to each node once more, at
start (not counted in ``comm/bytes_down_total``); ``clients="fl-geo"`` sends the bare ``query``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fl_geo.runtime.membership import NodeProfile, ProfileError, profile_from_record
from fl_geo.runtime.protocol import (
    PROFILE_KEY,
    REQUEST_RECORD,
    USER_CONFIG_RECORD,
    ProfileQuery,
    ProtocolError,
    declaration_of,
    is_profile_probe,
    user_config,
)

if TYPE_CHECKING:
    from fl_geo.runtime.dispatch import Dispatcher

log = logging.getLogger("fl_geo")


def default_profiles(nodes: list[int], known: Mapping[int, NodeProfile]) -> dict[int, NodeProfile]:
    """Profiles for nodes that run a plain Flower ClientApp (no fl-geo profile).

    Each gets the next partition id not used by a known node, in node-id order, and is marked
    ``fl_geo_client=False``: it is sent the fp32 model and its reply is read as a trained model.
    """
    used = {p.partition_id for p in known.values()}
    free = (pid for pid in range(len(known) + len(nodes) + len(used)) if pid not in used)
    total = len(known) + len(nodes)
    return {nid: NodeProfile(node_id=nid, partition_id=next(free), num_partitions=total, device="unknown",
                             fl_geo_client=False)
            for nid in sorted(nodes)}


def query_profiles(dispatcher: Dispatcher, node_ids: Iterable[int], timeout_s: float = 60.0,
                   known: Mapping[int, NodeProfile] | None = None) -> dict[int, NodeProfile]:
    """Ask each node for its partition and device with a ``query`` message (``NodeInfo`` has no
    ``node_config``): for nodes that run fl-geo's ClientApp (where one may run a plain Flower
    ClientApp, which has no query handler, `probe_profiles` asks instead).

    Each answer is checked (fl_geo.runtime.membership): a malformed or out-of-range profile, a
    partition count the run's nodes do not share, or a partition already held by a live node in
    ``known`` is refused and logged, and the node is left out of the result (``membership``
    remembers it: a bad profile is not asked again, a duplicate claim after a while). A node that
    does not answer is logged and left out; refused, waiting and busy nodes are not asked."""
    membership = dispatcher.membership
    busy = dispatcher.busy_nodes()
    msgs = [Message(RecordDict({REQUEST_RECORD: ProfileQuery(ask=PROFILE_KEY).to_record()}), dst_node_id=nid,
                    message_type=MessageType.QUERY)
            for nid in node_ids if not membership.waiting(nid) and nid not in busy]
    if not msgs:
        return {}
    claims: dict[int, NodeProfile] = {}

    def keep(batch: Sequence[tuple[int, Message]]) -> None:
        for nid, reply in batch:
            rec = reply.content.config_records.get(PROFILE_KEY)
            try:
                if rec is None:
                    raise ProfileError(f"the reply to the profile query has no '{PROFILE_KEY}' record")
                claims[nid] = profile_from_record(nid, rec)
            except ProfileError as exc:
                membership.refuse(nid, str(exc))

    outcome = dispatcher.run_jobs(msgs, on_replies=keep, order=None, timeout_s=timeout_s, keep_foreign=True)
    for nid, err in outcome.errors.items():
        log.warning("node %s did not answer the profile query: %s", nid, err)
    return membership.admit(claims, known or {}, dispatcher.live_nodes())


def probe_timeout_s(round_timeout_s: float, wait_nodes_timeout_s: float) -> float:
    """How long a probe waits for its replies: a plain node trains a whole job to answer, so as
    long as a round may take, and at least the start-up wait; 0 (wait for every reply or error)
    when rounds wait for every node."""
    return max(round_timeout_s, wait_nodes_timeout_s) if round_timeout_s > 0 else 0.0


def probe_message(node: int, model: ArrayRecord, user: ConfigRecord | None) -> Message:
    """The profile probe for ``node``: a ``train`` message with the model (fp32), the user's
    train config and the `ProfileQuery`."""
    content = RecordDict({"arrays": model, REQUEST_RECORD: ProfileQuery(ask=PROFILE_KEY).to_record(),
                          USER_CONFIG_RECORD: user_config(user)})
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)


def read_probe_reply(node: int, reply: Message) -> NodeProfile | None:
    """The profile a declared (fl-geo) probe reply gives, or None for an undeclared one (a plain
    Flower ClientApp's trained model). A `ProfileError` says what is wrong with a declared one."""
    try:
        decl = declaration_of(reply)
    except ProtocolError as exc:
        raise ProfileError(f"its reply to the profile probe: {exc}") from None
    if decl is None:
        return None
    if decl.payload != "none":
        raise ProfileError(f"its reply to the profile probe declares a {decl.payload!r} payload; a profile "
                           "reply declares 'none'")
    record = reply.content.config_records.get(PROFILE_KEY)
    if record is None:
        raise ProfileError(f"its reply to the profile probe is declared but has no '{PROFILE_KEY}' record")
    return profile_from_record(node, record)


@dataclass
class ProbeOutcome:
    """Who answered the probe: admitted fl-geo ``profiles``, and the ``plain`` nodes (an
    undeclared reply, or an error reply)."""

    profiles: dict[int, NodeProfile] = field(default_factory=dict)
    plain: list[int] = field(default_factory=list)


def probe_profiles(dispatcher: Dispatcher, nodes: Iterable[int], model: ArrayRecord, user: ConfigRecord | None,
                   timeout_s: float, known: Mapping[int, NodeProfile] | None = None) -> ProbeOutcome:
    """Probe ``nodes`` (those refused, waiting or busy are skipped) with ``model`` (fp32) and the
    user's train config; blocks until each replied, failed or ``timeout_s`` passed (0: no limit).

    fl-geo profiles are admitted as `query_profiles` admits them (against ``known``);
    a plain node's reply is held by the dispatcher for the node's first train job. Events of
    other jobs that resolve meanwhile are kept for the loop (`Dispatcher.run_jobs`)."""
    membership = dispatcher.membership
    busy = dispatcher.busy_nodes()
    msgs = [probe_message(n, model, user) for n in nodes if not membership.waiting(n) and n not in busy]
    if not msgs:
        return ProbeOutcome()
    sent = {m.metadata.dst_node_id: m for m in msgs}
    claims: dict[int, NodeProfile] = {}
    plain: list[int] = []

    def keep(batch: Sequence[tuple[int, Message]]) -> None:
        for nid, reply in batch:
            try:
                profile = read_probe_reply(nid, reply)
            except ProfileError as exc:
                membership.refuse(nid, str(exc))
                continue
            if profile is None:
                plain.append(nid)
                dispatcher.held.hold(nid, reply, sent[nid])
            else:
                claims[nid] = profile

    outcome = dispatcher.run_jobs(msgs, on_replies=keep, order=None, timeout_s=timeout_s,
                                  meta=[{"quiet_errors": True} for _ in msgs], keep_foreign=True)
    for nid, err in sorted(outcome.errors.items()):
        log.warning("node %s failed the profile probe (its first train job), taken for a plain Flower ClientApp: %s",
                    nid, err.splitlines()[0] if err else err)
        plain.append(nid)
    return ProbeOutcome(membership.admit(claims, known or {}, dispatcher.live_nodes()), sorted(plain))


def profile_nodes(dispatcher: Dispatcher, nodes: list[int], clients: str, model: Callable[[], ArrayRecord],
                  user: ConfigRecord | None, timeout_s: float,
                  known: Mapping[int, NodeProfile] | None = None) -> dict[int, NodeProfile]:
    """Profiles of ``nodes`` by what the strategy's ``clients`` says runs on them (``known``:
    the nodes already admitted). ``"flower"``: plain Flower ClientApps, asked nothing.
    ``"fl-geo"``: fl-geo's ClientApp, asked with a ``query`` message (one that does not answer is
    left out). ``"auto"``: `probe_profiles` with ``model()`` (built only then) and the user's
    train config. Plain nodes get `default_profiles`; refused or unanswered ones are left out."""
    known = known or {}
    if clients == "flower":
        return default_profiles(nodes, known)
    if clients == "fl-geo":
        return query_profiles(dispatcher, nodes, timeout_s, known)
    probe = probe_profiles(dispatcher, nodes, model(), user, timeout_s, known=known)
    if probe.plain:
        log.info("fl-geo: %d node(s) run a plain Flower ClientApp (no fl-geo profile): they get the fp32 "
                 "model and reply the trained model", len(probe.plain))
        probe.profiles.update(default_profiles(probe.plain, {**known, **probe.profiles}))
    return probe.profiles


@dataclass
class _Held:
    reply: Message
    sent: Message


class HeldReplies:
    """Plain nodes' replies to the profile probe, each kept for the node's first train job."""

    def __init__(self) -> None:
        self._by_node: dict[int, _Held] = {}

    def __len__(self) -> int:
        return len(self._by_node)

    def hold(self, node: int, reply: Message, sent: Message) -> None:
        """Keep ``reply``, the answer to the probe ``sent`` to ``node``."""
        self._by_node[node] = _Held(reply, sent)

    def take(self, msg: Message) -> Message | None:
        """The held reply that answers ``msg``, or None (``msg`` must then be sent).

        Only a train job (not a probe) to a node with a held reply takes it, and only when it
        carries the probe's model and user config; a train job with anything else drops it (the
        node trained from a model the server has moved on from). Other messages leave it held."""
        if msg.metadata.message_type != MessageType.TRAIN or is_profile_probe(msg):
            return None
        node = msg.metadata.dst_node_id
        held = self._by_node.pop(node, None)
        if held is None:
            return None
        if _same_job(held.sent, msg):
            return held.reply
        log.info("node %s: its reply to the profile probe was trained from another model than its first job "
                 "carries; dropped", node)
        return None


def _same_job(probe: Message, job: Message) -> bool:
    """Whether ``job`` carries the model (bit for bit) and user config ``probe`` carried."""
    a, b = probe.content.array_records.get("arrays"), job.content.array_records.get("arrays")
    if a is None or b is None or list(a.keys()) != list(b.keys()):
        return False
    if a is not b and not all(x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape) and x.data == y.data
                              for x, y in zip(a.values(), b.values(), strict=True)):
        return False
    mine, theirs = probe.content.config_records.get(USER_CONFIG_RECORD), job.content.config_records.get(USER_CONFIG_RECORD)
    return dict(mine or {}) == dict(theirs or {})
