"""A site's compressed uplink: its pseudo-gradient as a `fl_geo.core.compress` payload, with the
site's error-feedback residual kept between jobs (``wire.compress``; docs/compression.md).

The residual is per site and per run, in ``context.state`` next to the inner optimizer's state
(and with it in the node's on-disk inner state). A site with none (its first compressed job, or
one that restarted without its inner state) starts from zero, by rule. A server that resends a
round (a resumed run) gets the same result because the residual this round started from is kept
beside it (`keep_prev_residual`), as the optimizer state is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fl_geo.clients.persist import EF_RESIDUAL_KEY, PREV_EF_RESIDUAL_KEY
from fl_geo.core.compress import CompressSettings
from fl_geo.runtime import protocol
from fl_geo.runtime.compressed import compress_record
from fl_geo.runtime.wire_settings import uplink_from_json

if TYPE_CHECKING:
    from fl_geo.core.compress import CompressSettings

__all__ = ["compress_uplink", "keep_prev_residual", "kept_residual", "store_residual"]

log = logging.getLogger("fl_geo")


def compress_uplink(state: RecordDict, req: protocol.TrainRequest, update: torch.Tensor) -> ArrayRecord:
    """The pseudo-gradient Δ as the request's compressed payload (``wire_compress``), with this site's
    error-feedback residual: Δ + e is compressed and e' = Δ + e − Δ̂ replaces e in ``context.state``
    (`EF_RESIDUAL_KEY`, fp32 on the CPU). No residual (a site's first compressed job, or one that
    restarted without its inner state) is a zero one; one of another size (another model) is
    dropped with a warning. A non-finite Δ is refused (ValueError: an error reply) and leaves the
    residual as it was."""
    from fl_geo.core.compress import Compressor  # imported when compression is on

    settings = uplink_from_json(req.wire_compress)
    assert settings is not None
    compressor = Compressor(settings)
    payload, new_residual = compressor.compress(update, kept_residual(state, settings, update))
    store_residual(state, new_residual)
    return compress_record(payload)


def kept_residual(state: RecordDict, settings: CompressSettings, update: torch.Tensor) -> torch.Tensor | None:
    """This site's kept residual on ``update``'s device, or None (a zero one): EF off, none kept,
    or one of another size (another model; dropped with a warning)."""
    kept = state.array_records.get(EF_RESIDUAL_KEY)
    if not settings.error_feedback or kept is None:
        return None
    residual = torch.from_numpy(kept["residual"].numpy()).to(update.device)
    if residual.dtype != torch.float32 or residual.shape != update.shape:
        log.warning("the kept uplink residual (%s %s) does not fit this model's update (%d): starting from zero",
                    residual.dtype, tuple(residual.shape), update.numel())
        return None
    return residual


def store_residual(state: RecordDict, residual: torch.Tensor | None) -> None:
    """Keep ``residual`` (fp32, on the CPU) as this site's; None (EF off) removes any kept one."""
    if residual is not None:
        state[EF_RESIDUAL_KEY] = ArrayRecord({"residual": Array(residual.detach().cpu().numpy())})
    elif EF_RESIDUAL_KEY in state.array_records:
        del state[EF_RESIDUAL_KEY]


def keep_prev_residual(state: RecordDict, start_residual: ArrayRecord | None) -> None:
    """Keep the residual this round started from beside the new one (a node's first round after
    a server checkpoint): a resumed server that sends the round again rewinds to it
    (`fl_geo.clients.persist`)."""
    if start_residual is not None:
        state[PREV_EF_RESIDUAL_KEY] = start_residual
    elif PREV_EF_RESIDUAL_KEY in state.array_records:
        del state[PREV_EF_RESIDUAL_KEY]
