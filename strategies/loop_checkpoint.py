"""A loop's checkpoint: what a server needs to continue where it stopped, and its restore.

The loop holds its state (model, outer optimizer, penalty statistics, claim bound, counters,
history, clock); this module decides which of it goes into a checkpoint and how a checkpoint is
checked against the run before anything is restored: a checkpoint of another strategy, model
layout or format raises ValueError and leaves the loop exactly as it was. Loops add their own
part through `OuterLoop.extra_state` / `load_extra_state`, and the sharded parameter server,
whose model lives in its followers, through `model_state` / `prepare_model_state`. Jobs in
flight are not part of a checkpoint: a resumed server sends fresh work. The files themselves
are written by `fl_geo.core.checkpoint.CheckpointStore`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from fl_geo.core.claims import ClaimBound
from fl_geo.strategies.penalised_fold import penalty_from_config

if TYPE_CHECKING:
    from fl_geo.strategies.base import OuterLoop

CHECKPOINT_FORMAT = 1
# The run counters a checkpoint carries; the last two are missing from checkpoints written before
# 2026-11 (restored as 0).
COUNTERS = ("version", "total_tokens", "total_bytes_up", "total_bytes_down", "total_rejected", "total_accepted",
            "total_failed")
_OPTIONAL_COUNTERS = ("total_accepted", "total_failed")
_REQUIRED_KEYS = ("format", "strategy", "param_spec", "params", "optimizer", "counters", "history", "clock", "loop")


def capture(loop: OuterLoop) -> dict[str, Any]:
    """The checkpoint of ``loop`` as it is now (a dict of tensors and JSON-able values)."""
    clock = loop.dispatcher.clock.state_dict()
    if "jobs" in clock:
        clock["jobs"] = []  # in-flight work is re-sent by the resumed server
    return {
        "format": CHECKPOINT_FORMAT,
        "strategy": loop.cfg.strategy.name,
        "param_spec": loop.spec.to_json(),
        **loop.model_state(),
        "penalty": loop.penalty.state_dict() if loop.penalty is not None else None,
        "counters": {name: getattr(loop, name) for name in COUNTERS},
        "history": [json.dumps(h) for h in loop.history],
        "claims": loop.claims.bound.state_dict(),
        "clock": clock,
        "torch_rng": torch.get_rng_state(),
        # goodput's buckets (virtual clock with a scenario): a resumed run's ratio covers the whole run
        "goodput": (meter.state_dict(loop.dispatcher.in_flight_s())
                    if (meter := loop.dispatcher.goodput) is not None else None),
        "loop": loop.extra_state(),
        # wire.compress_down: x̂ and its version are kept (not reset), so a resumed run trains from
        # the very x̂ an uninterrupted one would; what each node holds is not (every node is sent
        # x̂ whole first: node ids change, and a site may hold a later x̂ than the checkpoint's)
        **({"downlink": loop.downlink.state_dict()} if loop.downlink is not None else {}),
    }


def restore(loop: OuterLoop, state: dict[str, Any]) -> None:
    """Restore a `capture` into ``loop``: everything is validated against this run (format,
    strategy, model layout, the loop's own part) before anything changes."""
    missing = [k for k in _REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint lacks keys {missing}")
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {state['format']} is not {CHECKPOINT_FORMAT}")
    if state["strategy"] != loop.cfg.strategy.name:
        raise ValueError(f"checkpoint was written by strategy '{state['strategy']}', this run is '{loop.cfg.strategy.name}'")
    if state["param_spec"] != loop.spec.to_json():
        raise ValueError("checkpoint holds a model with a different parameter layout (model section changed?)")
    # The pieces that validate themselves: load into scratch copies first, then swap in.
    install_model = loop.prepare_model_state(state)
    penalty = None
    if loop.penalty is not None:
        if state.get("penalty") is None:
            raise ValueError("checkpoint has no penalty statistics but this run uses the penalty")
        penalty = penalty_from_config(loop.cfg, loop.spec)
        assert penalty is not None
        penalty.load_state_dict(state["penalty"])
    claims = ClaimBound()
    if "claims" in state:  # checkpoints before 2026-11-28 lack them: the bound starts empty
        claims.load_state_dict(dict(state["claims"]))
    counters = {name: int(state["counters"][name]) if name not in _OPTIONAL_COUNTERS
                else int(state["counters"].get(name, 0)) for name in COUNTERS}
    history = [json.loads(h) for h in state["history"]]
    install_downlink = None
    if loop.downlink is not None:
        if "downlink" not in state:
            raise ValueError("checkpoint has no downlink public model but this run compresses the downlink")
        install_downlink = loop.downlink.prepare_load(dict(state["downlink"]))
    install_goodput = None
    if loop.dispatcher.goodput is not None and state.get("goodput") is not None:
        # checkpoints before 2026-12 lack it: the resumed run's ratio then covers its own work only
        install_goodput = loop.dispatcher.goodput.prepare_load(state["goodput"])
    loop.load_extra_state(dict(state["loop"]))  # validates before it sets anything
    if install_downlink is not None:
        install_downlink()
    loop.dispatcher.clock.load_state_dict(dict(state["clock"]))
    if install_goodput is not None:
        install_goodput()
    install_model()
    loop.penalty = penalty
    loop.claims.bound = claims
    for name, value in counters.items():
        setattr(loop, name, value)
    loop.history = history
    loop._client_cfg["resumed"] = True  # nodes may reload their inner state from disk
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
    loop.resumed = True
