"""What every fl-geo ClientApp is told about the run, in each request it receives.

The server is the single source of truth: clients never read config files, so a deployment
across sites cannot drift out of sync with the experiment definition. The typed requests of
`fl_geo.runtime.protocol` carry these fields next to the per-job ones (round, base version).
"""

from __future__ import annotations

import json
from typing import Any

from fl_geo.config import (
    FlGeoConfig,
    schedule_length,
    section_to_json,
    to_dict,
    uplink_wire,
    warmup_length,
)
from fl_geo.runtime.wire_settings import uplink_json


def client_config_record(cfg: FlGeoConfig) -> dict[str, Any]:
    """The part of the run config every ClientApp needs, as ConfigRecord scalars (``wire_compress``
    only when the uplink is compressed: a run without it sends the same requests as before)."""
    compress = uplink_json(uplink_wire(cfg))  # wire.compress, or streaming.quantize (its alias)
    return {
        **({"wire_compress": compress} if compress is not None else {}),
        "run_name": cfg.run.name,  # names the node's on-disk inner state (node config state-dir)
        "state_dir": cfg.run.client_state_dir,
        "inner_steps": cfg.strategy.inner_steps,
        "schedule_total": schedule_length(cfg),
        "wire_up": cfg.wire.up,
        "wire_down": cfg.wire.down,
        # inline clients run one at a time in this process and may use every core
        "threads": cfg.run.sim_cpus if cfg.run.backend == "inline" else cfg.run.threads_per_client,
        "seed": cfg.run.seed,
        "client": json.dumps({**to_dict(cfg.client), "warmup_steps": warmup_length(cfg)}, sort_keys=True),
        "model": section_to_json(cfg.model),
        "data": data_section_json(cfg),
    }


def data_section_json(cfg: FlGeoConfig) -> str:
    """The ``data`` section for the ClientApps; with a tokenizer other than bytes it also carries
    ``tokenizer_sha256``, the server's tokenizer identity, which every ClientApp compares with the
    tokenizer it built (a node with another tokenizer.json or cache would train on other ids)."""
    if cfg.data.tokenizer == "byte":
        return section_to_json(cfg.data)
    from fl_geo.runtime.builders import tokenizer

    return json.dumps({**to_dict(cfg.data), "tokenizer_sha256": tokenizer(cfg.data).sha256}, sort_keys=True)
