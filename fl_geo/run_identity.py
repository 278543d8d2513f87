"""A run's identity: the config values that make a checkpoint this run's and not another's.

A checkpoint carries the resolved config minus what a resumed run may change (`RESUME_MAY_CHANGE`);
its sha256 is the run id (`fl_geo.core.checkpoint`). `fl-geo run ... run.resume=true` refuses a
checkpoint whose identity differs and names the values that do (`fl_geo.server_app`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fl_geo.config_files import to_dict

if TYPE_CHECKING:
    from fl_geo.config_schema import FlGeoConfig

__all__ = ["ADAMW_IDLE", "RESUME_MAY_CHANGE", "UNCOMPRESSED_IDLE", "run_identity"]

# Keys a resumed run may change without becoming another run (`run_identity` leaves them out):
# extending the budget (run.rounds, run.max_tokens; with client.total_steps=0 the inner LR
# schedule's length follows the new budget, so an extended run is not bit-identical to one
# started with the longer budget), where files go and how the run is watched (directories, run
# name, loggers, progress), how often checkpoints are written and kept, and the process and
# waiting settings of this machine (backend, threads, CPUs, node waits, the client device:
# a restart may land on another host), and the derived reply deadlines (a run whose slow site was
# taken for a hung one is resumed with a higher floor or factor). Everything else - strategy, optimizers, penalty, model,
# data, inner loop, wire precision, seeds, evaluation - shapes the model or its metrics history,
# so a checkpoint written under other values is another run's.
RESUME_MAY_CHANGE = frozenset({
    "run.resume", "run.rounds", "run.max_tokens", "run.name", "run.out_dir", "run.progress",
    "run.tensorboard", "run.loggers", "run.checkpoint_every", "run.checkpoint_keep", "run.checkpoint_dir",
    "run.client_state_dir", "run.backend", "run.sim_cpus", "run.server_threads", "run.threads_per_client",
    "run.ray_address", "run.client_cpus", "run.client_gpus",
    "run.min_nodes", "run.wait_nodes_timeout_s", "run.min_live_nodes", "run.min_live_wait_s",
    "strategy.reply_deadline_factor", "strategy.reply_deadline_floor_s", "strategy.reply_deadline_first_s",
    "client.device", "data.data_dir", "ps.workdir", "ps.retry_s", "ps.heartbeat_s", "ps.host",
    "ps.tls_certs_dir", "ps.allow_insecure_remote",
})


def run_identity(cfg: FlGeoConfig) -> dict[str, Any]:
    """The run identity a checkpoint carries (`fl_geo.core.checkpoint`): every resolved config
    value as ``{"section.key": value}`` except `RESUME_MAY_CHANGE`. Two configs with the same
    identity train the same model (strategy, model layout, data, seeds), so a resume may use
    the other's checkpoints; any difference makes them different runs."""
    flat: dict[str, Any] = {}
    for section, values in to_dict(cfg).items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in RESUME_MAY_CHANGE and not _idle(name, cfg):
                flat[name] = value
    return flat


# With wire.compress=none these keys change nothing a run does: left out of its identity, so the run
# id of an uncompressed run is the one it had before the uplink could be compressed (its checkpoints
# stay its own).
UNCOMPRESSED_IDLE = frozenset({"wire.compress", "wire.compress_ratio", "wire.compress_chunk", "wire.compress_values",
                               "wire.compress_block", "wire.error_feedback", "wire.error_feedback_decay"})
# Likewise the downlink's keys with wire.compress_down=none.
DOWN_UNCOMPRESSED_IDLE = frozenset({"wire.compress_down", "wire.compress_down_ratio", "wire.compress_down_chunk",
                                    "wire.compress_down_values", "wire.compress_down_block"})
# Likewise the compression of HALoS's local-server -> global-server updates with halos.compress=none.
GLOBAL_UNCOMPRESSED_IDLE = frozenset({"halos.compress", "halos.compress_ratio", "halos.compress_chunk",
                                      "halos.compress_values", "halos.compress_block", "halos.error_feedback",
                                      "halos.error_feedback_decay"})
# Error feedback's decay at 1 (plain EF) is what every compressed run did before decay existed: left
# out, so those runs keep their run ids.
DECAY_KEYS = frozenset({"wire.error_feedback_decay", "halos.error_feedback_decay"})

# With client.optimizer=adamw (the default) the inner optimizer's choice and Muon's settings change
# nothing either: left out, so an AdamW run keeps the run id it had before Muon was a choice.
ADAMW_IDLE = frozenset({"client.optimizer", "client.muon_lr", "client.muon_momentum", "client.muon_nesterov",
                        "client.muon_ns_steps", "client.muon_weight_decay", "client.muon_adjust_lr"})


def _idle(name: str, cfg: FlGeoConfig) -> bool:
    """Whether ``name`` is a setting the run's other values leave unused (`UNCOMPRESSED_IDLE`,
    `DOWN_UNCOMPRESSED_IDLE`, `GLOBAL_UNCOMPRESSED_IDLE`, `ADAMW_IDLE`, `DECAY_KEYS` at 1)."""
    return ((name in UNCOMPRESSED_IDLE and cfg.wire.compress == "none")
            or (name in DOWN_UNCOMPRESSED_IDLE and cfg.wire.compress_down == "none")
            or (name in GLOBAL_UNCOMPRESSED_IDLE and cfg.halos.compress == "none")
            or (name in ADAMW_IDLE and cfg.client.optimizer == "adamw")
            or (name in DECAY_KEYS and getattr(cfg.wire if name.startswith("wire.") else cfg.halos,
                                               name.split(".")[1]) == 1))
