"""HALoS in one ServerApp: a global parameter server and one local server per region (or group).

docs/algorithms.md §6. Workers are Flower nodes; each belongs to a local parameter server (LPS): by
default one per region of the scenario (a node's region is its scenario entry's, or its ``site``
without a scenario), or ``halos.group_size`` workers per LPS inside a region ("consistent
grouping", HALoS §5.3). The server objects are `fl_geo.core.halos` (framework-free, shared with a
deployment, where only the transport differs: docs/flower.md "Two tiers (HALoS) on Flower").

Events, in clock order:

- a **worker reply** (the dispatcher): its pseudo-gradient Δ_i (against the LPS model it was
  sent) is one delayed-Nesterov step of its LPS; the worker gets the new LPS model at once. When
  the LPS has applied K updates since its last merge it sends U_k = θ_k^merged − θ_k upwards.
- **U_k reaches the global server** after the modelled transfer over the inter-region link: one
  delayed-Nesterov step of θ_g; θ_g is sent back (a snapshot: later global steps do not leak in).
  With ``halos.compress`` U_k travels as a compressed payload with the local server's error
  feedback (`LocalParameterServer.make_compressed_update`), in the ArrayRecord a deployment sends,
  charged at its compressed size; the global server decodes and validates it
  (`read_update_record`). A payload it refuses is logged and counted (``outer/rejected``) and
  leaves θ_g as it was; θ_g still goes back, so the local server merges and carries on.
- **θ_g reaches the LPS**: θ_k ← (1 − α)·θ_k + α·θ_g.

The two server-side transfers are this loop's own small event queue (at most two per LPS), merged
with the dispatcher's worker events by passing the earliest one's time as the dispatcher's
deadline; a worker reply due at exactly that time is handled first. With a wall clock (no
scenario) the global exchange happens at once. ``outer/step`` counts global updates; every metric
record is written at a global update, and the global model is what is evaluated and saved.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, RecordDict

from fl_geo.config import FlGeoConfig
from fl_geo.core.claims import MIN_PEERS
from fl_geo.core.compress import Compressor
from fl_geo.core.halos import GlobalParameterServer, LocalParameterServer
from fl_geo.runtime.compressed import compress_record, read_update_record
from fl_geo.runtime.dispatch import Event, JobTiming
from fl_geo.runtime.protocol import TrainRequest
from fl_geo.runtime.wire import PayloadError, encode, payload_nbytes
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.downlink import Downlink
from fl_geo.strategies.replies import ReplyError, Tally, TrainReply, read_reply
from fl_geo.strategies.server_model import ServerModel

log = logging.getLogger("fl_geo")



def _lps_key(lps: LocalParameterServer) -> tuple[int, int]:
    """What changes whenever a local server's model does: an applied update (``version``) or a
    merge of θ_g (one per send, once the send is no longer outstanding)."""
    return lps.version, lps.sends - int(lps.outstanding)


@dataclass(order=True)
class _Transfer:
    """A modelled server-side transfer: ``up`` (U_k to the global server) or ``down`` (θ_g back)."""

    finish: float
    seq: int
    kind: str = field(compare=False)
    group: int = field(compare=False)
    payload: torch.Tensor | ArrayRecord = field(compare=False)  # U_k compressed (halos.compress): its record


def _transfer_state(tr: _Transfer) -> list[Any]:
    """A transfer as plain data: a tensor, or a compressed U_k's arrays as their raw fields."""
    if isinstance(tr.payload, ArrayRecord):
        payload: Any = {k: [a.dtype, list(a.shape), a.stype, a.data] for k, a in tr.payload.items()}
    else:
        payload = tr.payload
    return [tr.finish, tr.seq, tr.kind, tr.group, payload]


def _transfer_of(row: Any, groups: int, numel: int) -> _Transfer:
    """`_transfer_state` output back as a transfer; ValueError when it does not fit the run (a
    compressed payload is validated like any other when it lands: `read_update_record`)."""
    try:
        finish, seq, kind, group, payload = row
        finish, seq, group = float(finish), int(seq), int(group)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"HALoS loop state has a malformed transfer: {exc}") from None
    if kind not in ("up", "down") or not 0 <= group < groups or not torch.isfinite(torch.tensor(finish)):
        raise ValueError(f"HALoS loop state has a malformed transfer ({kind!r} for local server {group})")
    if isinstance(payload, dict):
        if kind != "up":
            raise ValueError("HALoS loop state has a compressed θ_g reply (only U_k is compressed)")
        try:
            record = ArrayRecord({str(k): Array(dtype=str(d), shape=tuple(int(x) for x in shape), stype=str(st), data=bytes(b))
                                  for k, (d, shape, st, b) in payload.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"HALoS loop state has a malformed compressed transfer: {exc}") from None
        return _Transfer(finish, seq, kind, group, record)
    if not torch.is_tensor(payload) or payload.dtype != torch.float32 or payload.shape != (numel,) or \
            not bool(torch.isfinite(payload).all()):
        raise ValueError(f"HALoS loop state has a transfer that is not a finite fp32 model of {numel} values")
    return _Transfer(finish, seq, kind, group, payload)


class HalosLoop(OuterLoop):
    """Runs until ``run.rounds`` global updates or ``run.max_tokens`` tokens."""

    def server_model(self, cfg: FlGeoConfig, global_params: torch.Tensor) -> ServerModel:
        """The global parameter server (`fl_geo.core.halos`) steps θ with its own delayed-Nesterov
        state, and each local server keeps its own sum."""
        return ServerModel.held_elsewhere(cfg, global_params)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s, h = self.cfg.strategy, self.cfg.halos
        self.gps = GlobalParameterServer(
            self.global_params, lr=s.outer_lr, momentum=s.outer_momentum,
            buffer_size=s.delay_buffer, activation=s.delay_activation,
        )
        self.lps: list[LocalParameterServer] = []
        self.group_region: list[str] = []
        self.node_group: dict[int, int] = {}
        self.lps_down: list[Downlink | None] = []  # wire.compress_down: x̂ of each local server's model
        self._h = h
        self._transfers: list[_Transfer] = []
        self._seq = itertools.count()
        self._scratch = torch.empty(self.spec.numel, dtype=torch.float32)
        # halos.compress: what a local server sends the global one (None: U_k at wire.up, a tensor)
        tier2 = h.global_uplink()
        self.global_uplink: Compressor | None = Compressor(tier2) if tier2 is not None else None
        self.bytes_to_global = 0  # what the local servers sent the global one (also in total_bytes_up)
        self.global_rejected = 0  # local-server updates the global server refused
        # Plain replies that arrived before any plain claim was accepted, held (not applied, their
        # workers not sent new jobs) until MIN_PEERS of them can be judged together
        # (`_judge_first_claims`).
        self._unjudged: list[tuple[Event, TrainReply]] = []
        self.dispatched_samples = 0
        self.tally = Tally()
        self.local_updates = 0
        self._region_of_partition = (
            {i: self.scenario.node_region(i) for i in range(self.scenario.num_nodes)} if self.scenario is not None else {}
        )
        # after a resume: each partition's local server at the checkpoint (node ids do not survive a
        # restart), and the local servers whose θ_g reply was still to be sent (`begin`)
        self._restored_groups: dict[int, int] = {}
        self._replies_owed: list[int] = []

    def global_downlink(self, cfg: FlGeoConfig, spec: Any, global_params: torch.Tensor) -> None:
        """Workers train from their local server's model: one `Downlink` per local server (`lps_down`)."""
        return None

    def downlink_metrics(self) -> dict[str, float]:
        """The path counts summed over the local servers' downlinks."""
        downs = [d for d in self.lps_down if d is not None]
        if not downs:
            return {}
        return {k: sum(d.metrics()[k] for d in downs) for k in downs[0].metrics()}

    # ---- membership -----------------------------------------------------------------------------
    def _region(self, node: int) -> str:
        prof = self.profiles[node]
        if self.scenario is not None:
            return str(self._region_of_partition[prof.partition_id])
        return str(prof.site)

    def _assign(self, nodes: list[int]) -> None:
        """Give new nodes a local server: their region's (joining its newest group while it has
        room under ``halos.group_size``), created on first use from the global model."""
        for node in nodes:
            if node in self.node_group:
                continue
            restored = self._restored_groups.get(self.partition_of(node))
            if restored is not None:  # a resumed run: the local server it had at the checkpoint
                self.node_group[node] = restored
                continue
            region = self._region(node)
            size = self._h.group_size
            members = {g: sum(1 for n, gg in self.node_group.items() if gg == g) for g, r in enumerate(self.group_region) if r == region}
            open_groups = [g for g, m in members.items() if not size or m < size]
            if open_groups:
                g = open_groups[-1]
            else:
                g = len(self.lps)
                lps, down = self._new_lps()
                self.lps.append(lps)
                self.lps_down.append(down)
                self.group_region.append(region)
                log.info("HALoS: local server %d in region %s", g, region)
            self.node_group[node] = g

    def _new_lps(self) -> tuple[LocalParameterServer, Downlink | None]:
        """A local server started from θ_g, and its public model (``wire.compress_down``)."""
        lps = LocalParameterServer(
            self.gps.params, lr=self._h.local_lr, momentum=self._h.local_momentum,
            buffer_size=self._h.local_buffer, activation=self._h.local_activation,
            accumulate=self._h.accumulate, alpha=self._h.alpha,
        )
        settings = self.cfg.wire.downlink()  # wire.compress_down: one public model per local server
        down = None if settings is None else Downlink(settings, self.spec, self.cfg.wire.down, self.gps.params,
                                                      _lps_key(lps))
        return lps, down

    def idle_nodes(self) -> list[int]:
        nodes = self.free_nodes(self.benched | {ev.job.node for ev, _ in self._unjudged})
        self._assign(nodes)
        return nodes

    # ---- dispatch -------------------------------------------------------------------------------
    def dispatch(self, nodes: list[int]) -> None:
        """Send each node its local server's current model (snapshotted now, in the wire format)."""
        if not nodes:
            return
        msgs, timings, meta = [], [], []
        batch = self.cfg.client.batch_size
        encoded: dict[int, Any] = {}
        for node in nodes:
            g = self.node_group[node]
            sent = self.down_message(self.lps_down[g], node, self.lps[g].params, _lps_key(self.lps[g]))
            if sent is None and g not in encoded:
                encoded[g] = encode(self.lps[g].params, self.spec, self.cfg.wire.down)
            steps = self.job_steps(node)
            config = dict(self._client_cfg, round=self.gps.version, base_version=self.lps[g].version,
                          inner_steps=steps, send="pseudo_grad", **(sent[1] if sent is not None else {}))
            if self.cfg.strategy.schedule_clock == "global":
                config["start_step"] = self.dispatched_samples // batch
            self.dispatched_samples += steps * batch
            arrays = self.arrays_for(node, encoded[g], self.lps[g].params) if sent is None else sent[0]
            content = RecordDict({"arrays": arrays, **self.request_records(TrainRequest(**config), self.user_train_config)})
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
            # worker <-> local server: the intra-region link (the LPS sits in the node's region)
            timings.append(JobTiming(self.profiles[node].partition_id, steps, *self.cost.job_bytes(self.cfg.wire.down, self.cfg.wire.up,
                                                                                     None if sent is None else sent[3]),
                                     peer_region=self.group_region[g]))
            meta.append({"group": g, "version": self.lps[g].version})
            base = self.base_snapshot(node, self.lps[g].params)
            if base is not None:
                meta[-1]["base"] = base
            self.total_bytes_down += payload_nbytes(encoded[g]) if sent is None else sent[2]
        self.dispatcher.submit(msgs, timings, meta)

    # ---- events ---------------------------------------------------------------------------------
    def handle(self, ev: Event) -> None:
        node = ev.job.node
        if self.job_failed(self.tally, node, ev.ok, ev.error):
            down = self.lps_down[self.node_group[node]] if node in self.node_group else None
            if down is not None:  # it may not hold what it was sent: x̂ whole next time
                down.forget(node)
            return
        try:
            # an undeclared (Flower-convention) reply: Δ against the model its job was sent with
            # the job's local-server version: a replayed reply, or one claiming a version this
            # node was never sent, is refused (its staleness would be a lie)
            r = read_reply(ev.reply, self.spec, self.cfg.wire.up, expected_version=int(ev.job.meta["version"]),
                           base=ev.job.meta.get("base"), max_steps=self.job_steps(node),
                           step_tokens=self.step_tokens(node), compressor=self.uplink)
        except ReplyError as exc:
            self._reject(self.tally, node, str(exc))
            return
        if self.claims.holds_first(r):
            self._unjudged.append((ev, r))
            if len(self._unjudged) >= MIN_PEERS or not self.others_training():
                self._judge_first_claims()
            return
        if r.plain and not self.claims.judge(self.tally, [(node, r)]):
            return
        self._apply(ev, r)

    def _judge_first_claims(self) -> None:
        """Judge the held first plain claims together (`PlainClaims.judge_first`), as the
        asynchronous loop's first step does; the kept ones are applied in arrival order."""
        held, self._unjudged = self._unjudged, []
        kept = self.claims.judge_first(self.tally, [(ev.job.node, r) for ev, r in held])
        for (ev, r), keep in zip(held, kept, strict=True):
            if keep:
                self._apply(ev, r)

    def _apply(self, ev: Event, r: TrainReply) -> None:
        """Apply a valid reply's Δ to its local server (which may then send up to the global one)."""
        node = ev.job.node
        g = int(ev.job.meta["group"])
        lps = self.lps[g]
        try:
            delta = self._scratch
            for offset, piece in r.pieces:
                delta[offset : offset + piece.numel()].copy_(piece)
            lps.apply(delta)  # validates finiteness before anything changes
        except ValueError as exc:
            self._reject(self.tally, node, str(exc))
            return
        staleness = lps.version - 1 - int(ev.job.meta["version"])
        self.tally.accept(r, float(torch.linalg.vector_norm(delta)), staleness)
        self.local_updates += 1
        if lps.ready_to_send():
            self._send_up(g)

    def _send_up(self, g: int) -> None:
        comp = self.global_uplink
        if comp is None:
            update: torch.Tensor | ArrayRecord = self.lps[g].make_global_update()
            nbytes = self.cost.sent_bytes(self.cfg.wire.up)  # what was sent, as every loop counts
        else:
            update = compress_record(self.lps[g].make_compressed_update(comp))
            nbytes = payload_nbytes(update)
        self.bytes_to_global += nbytes
        self.total_bytes_up += nbytes
        if self.scenario is None:
            self._global_step(g, update)
            return
        region, server = self.group_region[g], self.scenario.server_region
        now = self.dispatcher.clock.now()
        t = now + self.cost.transfer_s(region, server, self.cfg.wire.up, start=now,
                                       compress=comp.settings if comp is not None else None)
        heapq.heappush(self._transfers, _Transfer(t, next(self._seq), "up", g, update))

    def _global_step(self, g: int, update: torch.Tensor | ArrayRecord) -> None:
        """U_k reached the global server: step (or refuse a malformed compressed U_k, θ_g as it
        was), log, and send θ_g back to local server g."""
        if isinstance(update, ArrayRecord):
            try:
                update = read_update_record(update, self.spec, self.cfg.wire.up, self.global_uplink)
                self.gps.apply(update)  # validates finiteness before anything changes
            except (PayloadError, ValueError) as exc:
                self.global_rejected += 1
                self.tally.rejected += 1
                log.warning("HALoS: the global server refused local server %d's update: %s", g, exc)
                self._reply_global(g)
                return
        else:
            self.gps.apply(update)
        self.version = self.gps.version
        self.global_params.copy_(self.gps.params)
        self._log_step(g)
        self._reply_global(g)

    def _reply_global(self, g: int) -> None:
        """θ_g goes back to local server g (at once without a scenario)."""
        if self.scenario is None:
            self.lps[g].merge(self.gps.params)
            return
        region, server = self.group_region[g], self.scenario.server_region
        now = self.dispatcher.clock.now()
        t = now + self.cost.transfer_s(server, region, self.cfg.wire.down, start=now)
        heapq.heappush(self._transfers, _Transfer(t, next(self._seq), "down", g, self.gps.params.clone()))
        self.total_bytes_down += self.cost.sent_bytes(self.cfg.wire.down)

    def _transfer_done(self, tr: _Transfer) -> None:
        self.dispatcher.clock.advance_to(tr.finish)
        if tr.kind == "up":
            self._global_step(tr.group, tr.payload)
        else:
            self.lps[tr.group].merge(tr.payload)

    # ---- checkpoint (strategies/loop_checkpoint.py) -----------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """The two tiers at a global update: θ_g with its optimizer, every local server (model,
        optimizer, merge point, error-feedback residual, public model), which partition trains
        for which, and the transfers between the tiers still on the wire (U_k, compressed or not,
        and θ_g replies). Worker jobs in flight are not kept: a resumed run sends fresh work from
        each local server's model, as an asynchronous resume does, so it is not bit-identical."""
        groups = {self.partition_of(n): g for n, g in self.node_group.items()}
        groups.update({p: g for p, g in self._restored_groups.items() if p not in groups})
        return {
            "gps": self.gps.snapshot(),
            "lps": [lps.snapshot() for lps in self.lps],
            "lps_down": [None if d is None else d.state_dict() for d in self.lps_down],
            "group_region": list(self.group_region),
            "partition_group": sorted([p, g] for p, g in groups.items()),
            "transfers": [_transfer_state(tr) for tr in sorted(self._transfers)],
            "bytes_to_global": self.bytes_to_global,
            "global_rejected": self.global_rejected,
            "local_updates": self.local_updates,
            "dispatched_samples": self.dispatched_samples,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore `extra_state` output; ValueError (and nothing changed) if it does not fit."""
        keys = ("gps", "lps", "lps_down", "group_region", "partition_group", "transfers", "bytes_to_global",
                "global_rejected", "local_updates", "dispatched_samples")
        if missing := [k for k in keys if k not in state]:
            raise ValueError(f"HALoS loop state lacks keys {missing}")
        n = len(state["lps"])
        if len(state["lps_down"]) != n or len(state["group_region"]) != n:
            raise ValueError(f"HALoS loop state has {n} local servers but {len(state['lps_down'])} public models "
                             f"and {len(state['group_region'])} regions")
        gps = GlobalParameterServer(self.global_params, lr=self.cfg.strategy.outer_lr,
                                    momentum=self.cfg.strategy.outer_momentum, buffer_size=self.cfg.strategy.delay_buffer,
                                    activation=self.cfg.strategy.delay_activation)
        gps.restore(state["gps"])
        lps_list: list[LocalParameterServer] = []
        downs: list[Downlink | None] = []
        for snap, down_state in zip(state["lps"], state["lps_down"], strict=True):
            lps, down = self._new_lps()
            lps.restore(snap)
            if (down is None) != (down_state is None):
                raise ValueError("checkpoint's compressed downlink is not this run's (wire.compress_down changed?)")
            if down is not None:
                down.prepare_load(dict(down_state))()
            lps_list.append(lps)
            downs.append(down)
        groups: dict[int, int] = {}
        for pair in state["partition_group"]:
            p, g = (int(x) for x in pair)
            if not 0 <= g < n or p in groups:
                raise ValueError(f"HALoS loop state maps a partition to a local server that does not exist: {pair!r}")
            groups[p] = g
        transfers = [_transfer_of(row, n, self.spec.numel) for row in state["transfers"]]
        counters = {k: int(state[k]) for k in ("bytes_to_global", "global_rejected", "local_updates",
                                                "dispatched_samples")}
        if any(v < 0 for v in counters.values()):
            raise ValueError(f"HALoS loop state has negative counters {counters}")
        in_transit = {tr.group for tr in transfers}
        self.gps, self.lps, self.lps_down = gps, lps_list, downs
        self.group_region = [str(r) for r in state["group_region"]]
        self.node_group, self._restored_groups = {}, groups
        self._transfers = transfers
        heapq.heapify(self._transfers)
        self._seq = itertools.count(max((tr.seq for tr in transfers), default=-1) + 1)
        self.bytes_to_global, self.global_rejected = counters["bytes_to_global"], counters["global_rejected"]
        self.local_updates, self.dispatched_samples = counters["local_updates"], counters["dispatched_samples"]
        self._replies_owed = [g for g, lps in enumerate(lps_list) if lps.outstanding and g not in in_transit]

    # ---- policy hooks of the kernel (`OuterLoop.run`) ----------------------------------------------
    def done(self) -> bool:
        r = self.cfg.run
        return self.version >= r.rounds or (r.max_tokens > 0 and self.total_tokens + self.tally.tokens >= r.max_tokens)

    def begin(self) -> None:
        # failure traces (virtual clock): a worker repaired while others train, or while only
        # server-side transfers are pending, is woken at its repair time and sent its local
        # server's current model; with nothing at all pending the clock moves to the next repair
        self.dispatcher.wake_on_rejoin = True
        # a resumed run: the checkpoint was written at a global update, before θ_g went back to
        # the local server that sent it; it goes now, at the same virtual time
        owed, self._replies_owed = self._replies_owed, []
        for g in owed:
            self._reply_global(g)
        self.dispatch(self.idle_nodes())

    def advance(self) -> bool:
        """One event: held first claims judged, a worker's reply applied to its local server, a
        modelled transfer between the tiers landed, or idle workers given jobs. False once no
        worker is left to train on."""
        if self._unjudged and not self.others_training():
            # the other workers failed or were benched: no peer will join the held first
            # claims, so judge them now (and give their workers new jobs)
            self._judge_first_claims()
            self.dispatch(self.idle_nodes())
            return True
        deadline = self._transfers[0].finish if self._transfers else None
        busy = self.dispatcher.in_flight() or deadline is not None
        ev = self.dispatcher.next_event(deadline=deadline) if busy else None
        if ev is None and self.dispatcher.take_rejoined():
            self.dispatch(self.idle_nodes())  # the repaired worker starts from its LPS's latest model
        elif ev is not None:
            self.handle(ev)
            self.dispatch(self.idle_nodes())
        elif self._transfers:
            self._transfer_done(heapq.heappop(self._transfers))
        elif idle := self.idle_nodes():
            self.dispatch(idle)
        elif not self.dispatcher.in_flight() and self.dispatcher.wait_for_repair():
            pass  # every worker is down: on to the next repair
        else:
            self.stop("no live node to train on (all vanished or benched after repeated errors)")
            return False
        return True

    def finish(self) -> None:
        """The local updates since the last global update, logged and evaluated; then the drain
        (nothing more is applied)."""
        self.dispatcher.wake_on_rejoin = False
        if self.tally.accepted or self.tally.rejected or self.tally.errors:
            self._log_step(None)
        self.drain()

    def _log_step(self, group: int | None) -> None:
        """A global update from local server ``group`` (None: the closing record, which shares
        the last global update's step number and is always evaluated)."""
        t = self.tally
        metrics: dict[str, Any] = {
            **self.tally_metrics(t),
            "outer/local_updates": self.local_updates,
            "outer/staleness": t.mean(t.staleness_sum),
            "outer/staleness_max": t.staleness_max,
            "outer/group": -1 if group is None else group,
            # local server -> global server: bytes so far (compressed with halos.compress), refusals
            "halos/bytes_to_global_total": self.bytes_to_global,
            "halos/global_rejected_total": self.global_rejected,
        }
        self.tally = Tally()
        self.record_step(self.version, metrics, self.done() or group is None, client_eval=False,
                         shown=min(self.version, self.cfg.run.rounds))
