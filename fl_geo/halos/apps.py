"""HALoS in Flower's deployment runtime: regional ServerApps (LPS) and a global ServerApp (GPS).

The two-tier layout (docs/flower.md "Two tiers (HALoS) on Flower", docs/deploy.md "HALoS across regions"):

- per region, a SuperLink with the region's worker SuperNodes (the datacenter ClientApp) and a
  long-running **regional ServerApp** (`regional_app`): the local parameter server. It trains its
  workers asynchronously with exactly the rules of the simulation (`RegionalLoop` is
  `fl_geo.strategies.halos.HalosLoop` with one LPS; the LPS object is
  `fl_geo.core.halos.LocalParameterServer`), and hosts `LpsService`, a Unix-socket service in a
  background thread, through which its update U_k leaves and the global model θ_g comes back;
- one global SuperLink with the **global ServerApp** (`global_app`, `GlobalParameterServer`)
  and one bridge SuperNode per region (`fl_geo.halos.bridge`), which carries θ_g down and U_k up.

The GPS keeps one ``train`` message in flight per bridge. The first carries no model; each later
one carries θ_g right after the GPS applied that region's U_k. The bridge hands θ_g to the LPS,
which merges it (θ_k ← (1 − α)·θ_k + α·θ_g) and answers with its next U_k once K more worker
updates were applied; the LPS keeps serving its workers while an exchange is in flight. The run
ends after ``run.rounds`` global updates, split evenly: a region is sent ``stop`` (with θ_g for
its last merge) once it has contributed ``ceil(rounds / regions)`` updates, so every region is
represented and a fast region cannot starve a slow one of the budget.

Each role is a separate Flower app (``apps/halos-regional``, ``apps/halos-global``: a FAB has one
ServerApp and one ClientApp), whose ``[tool.flwr.app.config]`` adds the deployment knobs to the
usual ``config``/``overrides``: ``lps-address`` (regional), ``regions`` (global) and the IPC
timeouts. Both tiers write a normal run directory (``metrics.jsonl``, ``summary.json``) with the
counters that show updates crossed both tiers.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import shlex
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fl_geo.config import FlGeoConfig, load_config
from fl_geo.core.compress import Compressor
from fl_geo.core.halos import GlobalParameterServer, check_count
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.errors import ConfigError
from fl_geo.halos.lps_service import LpsService
from fl_geo.paths import PROJECT_ROOT
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.compressed import compress_record, read_update_record
from fl_geo.runtime.dispatch import TIMED_OUT, Dispatcher, Event, NodeProfile, late_report
from fl_geo.runtime.evaluation import GlobalEvaluator
from fl_geo.runtime.progress import Progress
from fl_geo.runtime.protocol import REQUEST_RECORD, BridgeRequest
from fl_geo.runtime.session import RunSession
from fl_geo.runtime.wire import PayloadError, encode, payload_nbytes
from fl_geo.strategies.halos import HalosLoop
from fl_geo.strategies.replies import Tally
from fl_geo.strategies.strategy import reply_deadline
from fl_geo.timing.clock import WallClock

log = logging.getLogger("fl_geo")

__all__ = ["LpsService", "RegionalLoop", "global_app", "regional_app", "run_global", "run_regional"]

DEFAULT_IPC_TIMEOUT_S = 600.0


def _config(run_config: dict[str, Any], tier: str) -> FlGeoConfig:
    """The fl-geo config of a run (``config`` + ``overrides``), as `fl_geo.server_app` does; the
    strategy must be ``halos`` (the two tiers need its ``halos.*`` and ``strategy.*`` settings).

    ``tier`` is ``global`` or the region's name. Both tiers read one config, so a fixed
    ``run.checkpoint_dir`` gets a folder per tier under it (``<dir>/global``, ``<dir>/<region>``):
    each tier's checkpoints are its own run's (another run identity), and a store refuses
    another run's files."""
    name = str(run_config.get("config", "")).strip() or "configs/halos.yaml"
    path = Path(name)
    if not path.is_absolute() and not path.exists():
        path = PROJECT_ROOT / name
    cfg = load_config(path, shlex.split(str(run_config.get("overrides", ""))))
    if cfg.strategy.name != "halos":
        raise ValueError(f"the HALoS deployment apps need strategy.name=halos, got {cfg.strategy.name!r}")
    if cfg.run.clock != "wall":
        raise ValueError("a deployment runs on the wall clock: set run.clock=wall (no virtual time)")
    if cfg.run.checkpoint_dir:
        if not tier:
            raise ValueError("a regional ServerApp with run.checkpoint_dir needs run config 'region' (its folder there)")
        cfg.run.checkpoint_dir = str(Path(cfg.run.checkpoint_dir) / tier)
    return cfg


def _model(cfg: FlGeoConfig) -> tuple[ParamSpec, torch.Tensor]:
    """θ_0: the same seeded initial model on every tier (LPSs and GPS start from one point)."""
    model = make_model(cfg.model, cfg.run.seed)
    spec = ParamSpec.from_state_dict(model.state_dict())
    return spec, flatten(model.state_dict())


# ---------------------------------------------------------------------------------------------
# Regional ServerApp: the simulation's HalosLoop with one LPS; only the transport differs
# ---------------------------------------------------------------------------------------------


class RegionalLoop(HalosLoop):
    """One region's LPS serving its workers; global exchanges go through an `LpsService`.

    Worker replies are applied exactly as in `HalosLoop.handle` (reply validation, delayed
    Nesterov, the worker gets the new θ_k at once). When K updates are due the update U_k is
    encoded and queued for the bridge; θ_g is merged as soon as it arrives. ``outer/step`` counts
    merges here; every merge writes a metrics record with the LPS model's validation loss.
    """

    def __init__(self, *args: Any, service: LpsService, region: str, ipc_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service = service
        self.region = region
        self.ipc_timeout_s = ipc_timeout_s
        self.merges = 0
        self.resyncs = 0  # resumed global servers' first θ_g, merged with `LocalParameterServer.resync`
        self.stopped = False
        self._last_global_version = 0

    def _region(self, node: int) -> str:
        return self.region  # every worker of this SuperLink belongs to this region's LPS

    def _counters(self) -> dict[str, int]:
        lps = self.lps[0] if self.lps else None
        return {"lps_version": lps.version if lps else 0, "sends": lps.sends if lps else 0,
                "merges": self.merges, "local_updates": self.local_updates,
                "tokens": self.total_tokens + self.tally.tokens}

    def _send_up(self, g: int) -> None:
        if self.global_uplink is None:
            record = encode(self.lps[g].make_global_update(), self.spec, self.cfg.wire.up)
        else:  # halos.compress: U_k + this LPS's residual, compressed (the residual stays here)
            record = compress_record(self.lps[g].make_compressed_update(self.global_uplink))
        self.total_bytes_up += payload_nbytes(record)
        self.bytes_to_global += payload_nbytes(record)
        self.service.outbox.put((record, self._counters(), self.resyncs))  # its epoch: `LpsService`
        log.info("HALoS LPS %s: update %d queued for the GPS (version %d)", self.region, self.lps[g].sends,
                 self.lps[g].version)

    # ---- policy hooks of the kernel (`OuterLoop.run`) ----------------------------------------------
    def done(self) -> bool:
        """The GPS said stop (the global budget is spent)."""
        return self.stopped

    def eval_due(self, step: int, last: bool) -> bool:
        return True  # every merge is logged with the LPS model's validation loss

    def _drain_inbox(self) -> None:
        while True:
            try:
                theta, stop, global_version, resync = self.service.inbox.get_nowait()
            except queue.Empty:
                return
            if theta is not None:
                if not self.lps:
                    raise RuntimeError("global model arrived before this LPS had any worker")
                if resync:  # either tier restarted: merge whatever was outstanding
                    outstanding = self.lps[0].outstanding
                    adopt = not self.resumed and self.merges == 0  # this region started afresh mid-run
                    self.lps[0].resync(theta, adopt=adopt)
                    self.resyncs += 1
                    log.warning("HALoS LPS %s: resync with the global model (version %d) after a restart; %s it "
                                "and started a new send window%s", self.region, global_version,
                                "adopted" if adopt else "merged",
                                " (the update it had not applied is given up)" if outstanding else "")
                else:
                    self.lps[0].merge(theta)  # RuntimeError if nothing was outstanding: a protocol bug
                self.merges += 1
                self._last_global_version = global_version
                self.total_bytes_down += self.cost.sent_bytes(self.cfg.wire.down)
                self._log_step(0)
            if stop:
                self.stopped = True
            self.service.counters = self._counters()

    def begin(self) -> None:
        self.dispatch(self.idle_nodes())

    def advance(self) -> bool:
        """The GPS's replies merged, then one worker event (or idle workers given jobs). Raises
        when the GPS has been silent for ``ipc_timeout_s`` or no live worker is left."""
        self._drain_inbox()
        if self.stopped:
            return True
        if time.monotonic() - self.service.last_contact > self.ipc_timeout_s:
            raise TimeoutError(f"no exchange with the global server for {self.ipc_timeout_s:.0f} s "
                               f"(bridge at {self.service.address}); giving up")
        if self.dispatcher.in_flight():
            ev: Event | None = self.dispatcher.next_event(deadline=self.dispatcher.clock.now() + 0.2)
            if ev is not None:
                self.handle(ev)
                self.dispatch(self.idle_nodes())
        elif idle := self.idle_nodes():
            self.dispatch(idle)
        elif not self.dispatcher.live_nodes():
            raise RuntimeError("no live worker left in this region")
        else:
            time.sleep(0.2)  # every live worker is benched; the GPS may still stop us
        return True

    def finish(self) -> None:
        """The local updates since the last merge, logged. Unlike the simulation, no drain: a
        worker job takes seconds of deployment overhead and its result would not be applied
        anyway; its late reply is dropped with the run."""
        if self.tally.accepted or self.tally.rejected or self.tally.errors:
            self._log_step(None)
        for job in self.dispatcher.in_flight():
            self.dispatcher.abandon(job)

    def _log_step(self, group: int | None) -> None:
        """A merge of θ_g (or the closing record): the LPS model's counters and validation loss."""
        self.version = self.merges
        if self.lps:
            self.global_params.copy_(self.lps[0].params)  # what `evaluate` scores: the LPS model
        t = self.tally
        metrics: dict[str, Any] = {
            **self.tally_metrics(t),
            "outer/local_updates": self.local_updates,
            "outer/staleness": t.mean(t.staleness_sum),
            "outer/staleness_max": t.staleness_max,
            "halos/lps_version": self.lps[0].version if self.lps else 0,
            "halos/sends": self.lps[0].sends if self.lps else 0,
            "halos/merges": self.merges,
            "halos/resyncs": self.resyncs,
            "halos/global_version": self._last_global_version,
        }
        self.tally = Tally()
        self.record_step(self.version, metrics, False, client_eval=False)


def run_regional(grid: Grid, cfg: FlGeoConfig, address: str, region: str = "",
                 ipc_timeout_s: float = DEFAULT_IPC_TIMEOUT_S, run_dir: str | Path | None = None) -> dict[str, Any]:
    """One region's LPS until the GPS sends ``stop``; writes and returns the run summary.

    With ``run.checkpoint_every`` k the loop writes a checkpoint (`HalosLoop.extra_state`: the
    LPS, its optimizer, merge point and residual) at every k-th merge of θ_g; with ``run.resume``
    it continues from the newest one. The global server sends a region whose exchange failed its
    model again as a resync for a while (`run_global`), so a regional ServerApp restarted within
    that time merges it whatever its checkpoint had outstanding and goes on."""
    from fl_geo.server_app import open_checkpoints  # the ServerApp's rules for stores and resume

    session = RunSession(cfg, run_dir)
    session.lock()  # before the checkpoints are read: a second run into this directory stops here
    try:
        store, checkpoint = open_checkpoints(cfg, session.run_dir)
        session.open(history=checkpoint.state["history"] if checkpoint is not None else None)
    except BaseException:
        session.close()
        raise
    with session:
        logger = session.logger
        assert logger is not None
        t0 = time.perf_counter()
        spec, params = _model(cfg)
        service = LpsService(address, spec, cfg.wire.down, reply_timeout_s=ipc_timeout_s)
        service.start()  # first: the bridge may already be knocking
        try:
            dispatcher = Dispatcher(grid, WallClock())
            dispatcher.reply_deadline = reply_deadline(cfg)  # a silent worker is benched, not waited for
            nodes = dispatcher.wait_for_nodes(cfg.run.min_nodes or cfg.run.num_clients, cfg.run.wait_nodes_timeout_s)
            profiles: dict[int, NodeProfile] = dispatcher.query_profiles(nodes, timeout_s=cfg.run.wait_nodes_timeout_s)
            if not profiles:
                raise RuntimeError("no worker answered the profile query")
            region = region or next(iter(profiles.values())).site
            evaluator = GlobalEvaluator(cfg, max(p.num_partitions for p in profiles.values()))
            loop = RegionalLoop(cfg, spec, params, dispatcher, profiles, logger, evaluator, None,
                                service=service, region=region, ipc_timeout_s=ipc_timeout_s)
            loop.checkpoints = store
            if checkpoint is not None:
                try:
                    loop.load_state_dict(checkpoint.state)
                except ValueError as exc:
                    raise ConfigError(f"cannot resume from {checkpoint.path}: {exc}") from None
                loop.resumed = True
                loop.merges = loop.version  # a checkpoint is written at a merge, which is its step
                log.info("HALoS regional server %s: resumed at merge %d from %s", region, loop.merges, checkpoint.path)
            log.info("HALoS regional server %s: %d workers, K=%d, alpha=%s, IPC %s", region, len(profiles),
                     cfg.halos.accumulate, cfg.halos.alpha, address)
            last = loop.run(Progress(cfg.run.name, cfg.run.rounds, enabled=cfg.run.progress, max_tokens=cfg.run.max_tokens))
            lps = loop.lps[0] if loop.lps else None
            first = loop.history[0] if loop.history else {}
            summary = {
                "name": cfg.run.name, "strategy": "halos", "role": "regional", "region": region,
                "workers": len(profiles), "accumulate": cfg.halos.accumulate, "alpha": cfg.halos.alpha,
                "local_updates": loop.local_updates, "lps_version": lps.version if lps else 0,
                "sends": lps.sends if lps else 0, "merges": loop.merges, "exchanges": service.exchanges,
                "resyncs": loop.resyncs, "dropped_updates": service.dropped,
                "ipc_rejected": service.rejected, "rejected": loop.total_rejected,
                "initial_val_loss": first.get("val/loss"), "final_val_loss": last.get("val/loss"), "final_val_bpb": last.get("val/bpb"),
                # bytes of updates dropped before a resync never left this process
                "tokens": loop.total_tokens, "bytes_up": loop.total_bytes_up - service.dropped_bytes,
                "bytes_down": loop.total_bytes_down, "bytes_to_global": loop.bytes_to_global - service.dropped_bytes,
                "late_replies": dispatcher.late_replies, "late_nodes": loop.late_nodes(),
                "wall_s": round(logger.wall_offset_s + time.perf_counter() - t0, 3), "num_params": spec.numel, "lps_address": address,
            }
            session.save_model(params, spec)
            return session.finish(summary)
        finally:
            service.close()


regional_app = ServerApp()


@regional_app.main()
def _regional_main(grid: Grid, context: Context) -> None:
    """``flwr run apps/halos-regional`` with run config ``lps-address``, ``region``, ``ipc-timeout-s``."""
    rc = dict(context.run_config)
    address = str(rc.get("lps-address", "")).strip()
    if not address:
        raise ValueError("the regional ServerApp needs run config 'lps-address' (unix:///path/region.sock)")
    run_regional(grid, _config(rc, str(rc.get("region", "")).strip()), address, str(rc.get("region", "")),
                 float(rc.get("ipc-timeout-s", DEFAULT_IPC_TIMEOUT_S)))


# ---------------------------------------------------------------------------------------------
# Global ServerApp: the GPS
# ---------------------------------------------------------------------------------------------


def _global_server(cfg: FlGeoConfig, params: torch.Tensor) -> GlobalParameterServer:
    """The GPS on θ_0, stepping with the strategy's delayed Nesterov settings."""
    s = cfg.strategy
    return GlobalParameterServer(params, lr=s.outer_lr, momentum=s.outer_momentum,
                                 buffer_size=s.delay_buffer, activation=s.delay_activation)


def _bridges(dispatcher: Dispatcher, cfg: FlGeoConfig, regions: int) -> dict[int, NodeProfile]:
    """Wait for one bridge SuperNode per region; the profile each answers names its region."""
    # A bridge that stays connected but never answers (its LPS hung, its SuperNode wedged) is
    # given up at the derived deadline (k x the median exchange, with a floor; the first
    # exchange gets strategy.reply_deadline_first_s): its region leaves the run, the others
    # finish their quotas, and the summary names it. Any other bridge error ends the run.
    dispatcher.reply_deadline = reply_deadline(cfg)
    nodes = dispatcher.wait_for_nodes(regions, cfg.run.wait_nodes_timeout_s)
    profiles = dispatcher.query_profiles(nodes, timeout_s=cfg.run.wait_nodes_timeout_s)
    if len(profiles) < regions:
        raise RuntimeError(f"only {len(profiles)} of {regions} bridges answered the region query")
    return profiles


def _region_update(ev: Event, region: str) -> tuple[dict[str, int], ArrayRecord] | None:
    """What a bridge's reply brings: the LPS's counters when it sent U_k, and U_k. None when the
    region is done: its bridge missed its deadline (the region leaves the run, the others go on)
    or acknowledged ``stop`` (a ``stop`` that fails is logged: the region's updates are all in,
    and after a resume its run may have ended before the crash). Any other bridge error, or a
    reply without an update, ends the run."""
    node = ev.job.node
    if ev.error == TIMED_OUT:
        log.warning("HALoS GPS: the bridge of region %s (node %s) did not answer within its deadline; "
                    "the region leaves the run, the others go on", region, node)
        return None
    if ev.job.meta["stop"]:
        if not ev.ok:
            log.warning("HALoS GPS: region %s did not acknowledge its stop (%s); its quota was done", region,
                        str(ev.error)[:200])
        return None  # acknowledged: that region merged θ_g and ends its run
    if not ev.ok:
        raise RuntimeError(f"bridge of region {region} (node {node}) failed: {ev.error}")
    m = ev.reply.content.metric_records.get("metrics")
    counters = {k: int(v) for k, v in (m or {}).items()}  # the LPS when it sent U_k
    if "arrays" not in ev.reply.content.array_records:
        raise RuntimeError(f"bridge of region {region} replied without an update")
    return counters, ev.reply.content.array_records["arrays"]


def apply_region_update(gps: GlobalParameterServer, arrays: ArrayRecord, spec: ParamSpec, precision: str,
                        compressor: Compressor | None, scratch: torch.Tensor | None = None) -> str | None:
    """Apply a region's U_k (``arrays``: at ``precision``, or ``compressor``'s payload with
    ``halos.compress``) to the GPS; the reason, and θ_g untouched, when the payload is malformed or
    not finite (None when applied). A hostile region costs its own update, never the global model."""
    try:
        update = read_update_record(arrays, spec, precision, compressor, out=scratch)
        gps.apply(update)  # validates finiteness before anything changes
    except (PayloadError, ValueError) as exc:
        return str(exc)[:300]
    return None


def _update_metrics(version: int, loss: float, *, region: int, region_updates: int, lps: dict[str, int],
                    bytes_up: int, bytes_down: int) -> dict[str, Any]:
    """The metrics record of global update ``version`` (``loss`` NaN where it was not evaluated):
    which region sent it (its partition id), its how-manyth that was, the LPS counters it came
    with, and the bytes moved so far."""
    return {
        "outer/step": version, "val/loss": loss, "val/ppl": math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss,
        "halos/region": region, "halos/region_updates": region_updates,
        "halos/lps_version": lps.get("lps_version", -1),
        "halos/lps_sends": lps.get("sends", -1),
        "comm/bytes_up_total": bytes_up, "comm/bytes_down_total": bytes_down,
    }


GLOBAL_CHECKPOINT_FORMAT = "halos-global/1"
_GLOBAL_KEYS = frozenset({"format", "param_spec", "gps", "regions", "bytes_up", "bytes_down", "rejected", "initial",
                          "history"})


def _global_state(gps: GlobalParameterServer, spec: ParamSpec, sends: dict[str, int], counters: dict[str, dict[str, int]],
                  bytes_up: int, bytes_down: int, rejected: int, initial: float,
                  history: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPS's checkpoint: θ_g with its optimizer (`GlobalParameterServer.snapshot`), each
    region's count of exchanges and last LPS counters (by region name: bridge node ids do not
    survive a restart of the global SuperLink), the byte and refusal counters, and the metrics so
    far. The LPSs' state is theirs: they go on and resynchronise with the resumed θ_g."""
    return {
        "format": GLOBAL_CHECKPOINT_FORMAT, "param_spec": spec.to_json(), "gps": gps.snapshot(),
        "regions": {region: {"sends": n, "counters": dict(counters.get(region, {}))} for region, n in sends.items()},
        "bytes_up": bytes_up, "bytes_down": bytes_down, "rejected": rejected, "initial": initial,
        "history": [json.dumps(h) for h in history],
    }


def _read_global_state(state: Any, gps: GlobalParameterServer, spec: ParamSpec) -> dict[str, Any]:
    """Check a `_global_state` checkpoint whole, then restore θ_g and its optimizer into ``gps``;
    the rest as plain values. ValueError naming the first problem (nothing restored)."""
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint is a {type(state).__name__}, not a mapping")
    if missing := sorted(_GLOBAL_KEYS - set(state)):
        raise ValueError(f"the checkpoint lacks {missing}")
    if state["format"] != GLOBAL_CHECKPOINT_FORMAT:
        raise ValueError(f"format {state['format']!r:.60} is not {GLOBAL_CHECKPOINT_FORMAT!r} (a checkpoint of another "
                         "method's ServerApp?)")
    if state["param_spec"] != spec.to_json():
        raise ValueError("its model layout differs from this config's model")
    regions = state["regions"]
    if not isinstance(regions, dict) or not regions:
        raise ValueError("'regions' must map each region to its counters")
    sends, counters = {}, {}
    for region, entry in regions.items():
        if not isinstance(region, str) or not isinstance(entry, dict) or not isinstance(entry.get("counters"), dict):
            raise ValueError(f"region entry {region!r:.40} is malformed")
        sends[region] = check_count(f"regions.{region}.sends", entry.get("sends"))
        counters[region] = {str(k): check_count(f"regions.{region}.counters.{k}", v) for k, v in entry["counters"].items()}
    totals = {k: check_count(k, state[k]) for k in ("bytes_up", "bytes_down", "rejected")}
    if not isinstance(state["initial"], float):
        raise ValueError(f"'initial' must be a float, got {state['initial']!r:.60}")
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
        raise ValueError("'history' must be a list of JSON lines")
    try:
        records = [json.loads(h) for h in history]
    except ValueError as exc:
        raise ValueError(f"'history' holds a line that is not JSON ({exc})") from None
    if not all(isinstance(r, dict) for r in records):
        raise ValueError("'history' holds a line that is not a metrics record")
    version = state["gps"].get("version") if isinstance(state["gps"], dict) else None
    if isinstance(version, int) and sum(sends.values()) < version:  # each update took one exchange
        raise ValueError(f"the regions' {sum(sends.values())} exchanges cannot have made global version {version}")
    gps.restore(state["gps"])  # validated whole by the server; ValueError leaves it as it was
    return {"sends": sends, "counters": counters, **totals, "initial": state["initial"], "history": records}


def run_global(grid: Grid, cfg: FlGeoConfig, regions: int, exchange_timeout_s: float = DEFAULT_IPC_TIMEOUT_S,
               connect_timeout_s: float = 120.0, run_dir: str | Path | None = None) -> dict[str, Any]:
    """The GPS: one bridge message in flight per region until ``run.rounds`` global updates.

    With ``run.checkpoint_every`` k it writes a checkpoint (`_global_state`) after every k-th
    global update, before θ_g goes back to that region. With ``run.resume`` it continues from the
    newest one (`fl_geo.server_app.open_checkpoints`: same run identity, verified files): the
    regions, found by name, keep their counts of exchanges toward their quota, and each gets the
    restored θ_g at once with ``resync`` set, which its LPS merges whatever it had outstanding. An
    update that was on its way up at the crash is lost, as in every asynchronous resume. A
    checkpoint that does not fit this config or these regions is a one-line ConfigError."""
    from fl_geo.server_app import open_checkpoints  # the ServerApp's rules for stores and resume

    session = RunSession(cfg, run_dir)
    session.lock()  # before the checkpoints are read: a second run into this directory stops here
    try:
        spec, params = _model(cfg)
        gps = _global_server(cfg, params)
        store, checkpoint = open_checkpoints(cfg, session.run_dir)
        restored: dict[str, Any] | None = None
        if checkpoint is not None:
            try:
                restored = _read_global_state(checkpoint.state, gps, spec)
            except ValueError as exc:
                raise ConfigError(f"cannot resume from {checkpoint.path}: {exc}") from None
        logger = session.open(history=checkpoint.state["history"] if checkpoint is not None else None)
    except BaseException:
        session.close()
        raise
    with session:
        t0 = time.perf_counter()
        evaluator = GlobalEvaluator(cfg, cfg.run.num_clients)
        dispatcher = Dispatcher(grid, WallClock())
        profiles = _bridges(dispatcher, cfg, regions)
        quota = math.ceil(cfg.run.rounds / len(profiles))
        region_of = {n: p.site for n, p in profiles.items()}
        sends = dict.fromkeys(profiles, 0)
        counters: dict[str, dict[str, int]] = {}
        scratch = torch.empty(spec.numel, dtype=torch.float32)
        tier2 = cfg.halos.global_uplink()  # halos.compress: the regions' U_k arrive compressed
        compressor = Compressor(tier2) if tier2 is not None else None
        rejected = bytes_up = bytes_down = 0
        if restored is None:
            initial = evaluator.evaluate(gps.params)
            history = [logger.log(0, {"outer/step": 0, "val/loss": initial, "val/ppl": math.exp(min(initial, 50.0))})]
        else:
            if sorted(restored["sends"]) != sorted(region_of.values()):
                raise ConfigError(f"cannot resume from {checkpoint.path}: it is of regions {sorted(restored['sends'])}, "
                                  f"the bridges now serve {sorted(region_of.values())}")
            sends = {n: restored["sends"][region_of[n]] for n in profiles}
            counters = restored["counters"]
            rejected, bytes_up, bytes_down = restored["rejected"], restored["bytes_up"], restored["bytes_down"]
            initial, history = restored["initial"], restored["history"]
            log.info("HALoS GPS: resumed at global update %d from %s; exchanges so far %s", gps.version,
                     checkpoint.path, {region_of[n]: c for n, c in sends.items()})
        log.info("HALoS GPS: %d regions %s, %d global updates (%d per region)", len(profiles),
                 sorted(region_of.values()), quota * len(profiles), quota)

        def push(node: int, stop: bool, reply: bool = True, resync: bool = False) -> None:
            """The next exchange with a bridge; ``reply``: it carries θ_g (every one but the first),
            also after a refused update, so that region's LPS merges and sends again; ``resync``:
            the first exchange after a resume."""
            nonlocal bytes_down
            request = BridgeRequest(stop=stop, global_version=gps.version, exchange_timeout_s=float(exchange_timeout_s),
                                    connect_timeout_s=float(connect_timeout_s), resync=resync)
            content = RecordDict({REQUEST_RECORD: request.to_record()})
            if reply or stop:
                content["arrays"] = encode(gps.params, spec, cfg.wire.down)  # a snapshot, copied
                bytes_down += payload_nbytes(content["arrays"])
            dispatcher.submit([Message(content, dst_node_id=node, message_type=MessageType.TRAIN)],
                              meta=[{"stop": stop}])

        def maybe_checkpoint() -> None:
            if store is not None and cfg.run.checkpoint_every and gps.version % cfg.run.checkpoint_every == 0:
                store.save(gps.version, _global_state(
                    gps, spec, {region_of[n]: c for n, c in sends.items()}, counters, bytes_up, bytes_down,
                    rejected, initial, history))

        for node in sorted(profiles, key=lambda n: profiles[n].partition_id):
            if restored is None:
                push(node, stop=False, reply=False)
            else:  # every LPS merges the restored θ_g (a region at its quota only stops)
                push(node, stop=sends[node] >= quota, resync=True)
        # With checkpoints a region whose exchange fails (its regional ServerApp died) is sent θ_g
        # again as a resync for up to exchange_timeout_s: a regional run resumed meanwhile merges it
        retry_s = float(exchange_timeout_s) if cfg.run.checkpoint_every else 0.0
        failing_since: dict[int, float] = {}
        resend_at: dict[int, float] = {}  # a failed region's resync goes out 1 s after its failure
        retries = 0
        while dispatcher.in_flight() or resend_at:
            now = time.monotonic()
            for node in [n for n, t in resend_at.items() if t <= now]:
                del resend_at[node]
                push(node, stop=False, resync=True)
            if resend_at and not dispatcher.in_flight():
                time.sleep(max(0.0, min(resend_at.values()) - now))  # nothing else to wait on
                continue
            # the other regions' updates are handled while a failed region's resync waits
            wait = min(resend_at.values()) - now if resend_at else None
            ev = dispatcher.next_event(None if wait is None else dispatcher.clock.now() + max(0.0, wait))
            if ev is None:
                continue
            node, region = ev.job.node, region_of[ev.job.node]
            if not ev.ok and ev.error != TIMED_OUT and not ev.job.meta["stop"] and retry_s:
                since = failing_since.setdefault(node, time.monotonic())
                if time.monotonic() - since < retry_s:
                    retries += 1
                    log.warning("HALoS GPS: the exchange with region %s failed (%s); sending it θ_g again as a resync "
                                "(a resumed regional run merges it), for up to %.0f s more", region,
                                str(ev.error)[:200], retry_s - (time.monotonic() - since))
                    # not at once: an error that comes back at once must not spin
                    resend_at[node] = time.monotonic() + 1.0
                    continue
            failing_since.pop(node, None)
            got = _region_update(ev, region)
            if got is None:
                continue  # the region is done
            counters[region], arrays = got
            bytes_up += payload_nbytes(arrays)
            sends[node] += 1  # a refused update uses up one of the region's exchanges too
            if (why := apply_region_update(gps, arrays, spec, cfg.wire.up, compressor, scratch)) is not None:
                rejected += 1
                log.warning("HALoS GPS: update from region %s refused (θ_g unchanged): %s", region, why)
                push(node, stop=sends[node] >= quota)
                continue
            loss = evaluator.evaluate(gps.params) if (cfg.run.eval_every and gps.version % cfg.run.eval_every == 0) else float("nan")
            history.append(logger.log(gps.version, _update_metrics(
                gps.version, loss, region=profiles[node].partition_id, region_updates=sends[node],
                lps=counters[region], bytes_up=bytes_up, bytes_down=bytes_down)))
            log.info("HALoS GPS: update %d from region %s (its #%d)", gps.version, region, sends[node])
            maybe_checkpoint()  # before θ_g goes back: a resume sends it to every region anyway
            push(node, stop=sends[node] >= quota)
        final = evaluator.evaluate(gps.params)
        history.append(logger.log(gps.version, {"outer/step": gps.version, "val/loss": final,
                                                "val/ppl": math.exp(min(final, 50.0)), "val/bpb": evaluator.bpb(final)}))
        session.save_model(gps.params, spec)
        return session.finish({
            "name": cfg.run.name, "strategy": "halos", "role": "global", "rounds": cfg.run.rounds,
            "outer_steps": gps.version, "global_version": gps.version, "regions": len(profiles),
            "updates_per_region": {region_of[n]: c for n, c in sends.items()},
            "lps_counters": counters, "initial_val_loss": initial, "final_val_loss": final, "final_val_bpb": evaluator.bpb(final),
            "bytes_up": bytes_up, "bytes_down": bytes_down, "rejected": rejected,
            "compress": tier2.describe() if tier2 is not None else "none",
            "late_nodes": late_report(dispatcher.late, profiles),
            "resumed_from": checkpoint.step if checkpoint is not None else None, "exchange_retries": retries,
            "wall_s": round(logger.wall_offset_s + time.perf_counter() - t0, 3), "num_params": spec.numel,
        })


global_app = ServerApp()


@global_app.main()
def _global_main(grid: Grid, context: Context) -> None:
    """``flwr run apps/halos-global`` with run config ``regions``, ``exchange-timeout-s``."""
    rc = dict(context.run_config)
    cfg = _config(rc, "global")
    regions = int(rc.get("regions", 0) or 0)
    if regions < 1:
        raise ValueError("the global ServerApp needs run config 'regions' (number of bridge SuperNodes)")
    run_global(grid, cfg, regions, float(rc.get("exchange-timeout-s", DEFAULT_IPC_TIMEOUT_S)),
               float(rc.get("connect-timeout-s", 120.0)))
