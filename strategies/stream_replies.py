"""Reading a ``train.stream`` reply (Streaming DiLoCo, CoCoDC): the metrics every train reply
has (`fl_geo.strategies.replies`), the tick and version it must echo, and one decoded Δ_p per
fragment the tick synced (compressed ones decompressed, ``wire.compress``). Anything else is a
`ReplyError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from flwr.app import Message

from fl_geo.core.compress import Compressor
from fl_geo.core.state import ParamSpec
from fl_geo.core.streaming import fragment_record
from fl_geo.runtime.compressed import decompress_record
from fl_geo.runtime.wire import PayloadError, decode, payload_nbytes
from fl_geo.strategies.replies import (
    MAX_STEP_TIME_S,
    ReplyError,
    TrainReply,
    metric_number,
    metric_whole,
    read_reply_metrics,
    require_declaration,
)

__all__ = ["StreamReply", "read_stream_reply"]


@dataclass
class StreamReply:
    """A valid ``train.stream`` reply: its counts and one decoded Δ_p per synced fragment."""

    reply: TrainReply  # metrics (``pieces`` unused)
    deltas: dict[int, list[tuple[int, torch.Tensor]]]  # fragment -> zero-copy pieces (wire dtype)
    nbytes: dict[int, int]  # fragment -> payload bytes
    train_time_s: float = 0.0
    overlap_count: int = 0
    overlap_sum: int = 0
    overlap_max: int = -1


def read_stream_reply(reply: Message, frag_specs: Sequence[ParamSpec], syncs: Sequence[int],
                      steps: int, precision: str, compressor: Compressor | None = None,
                      step_tokens: int | None = None, stream_step: int | None = None,
                      version: int | None = None) -> StreamReply:
    """Validate metrics and the ``frag_<p>`` record of every fragment in ``syncs``; decode them
    (with ``compressor``, the run's ``wire.compress``: each a compressed payload of its fragment,
    decompressed into one fp32 piece, `fl_geo.runtime.compressed`).

    ``stream_step`` / ``version``: the tick's first step and the model version its message was
    sent at; the reply must echo both (None: not checked). A reply of another tick, replayed or
    duplicated into this one, fails here: the dispatcher matches a reply to its message by id,
    but what the reply *says* it answers is only in its content.

    Raises `ReplyError` naming what is wrong (missing record, keys, shapes, dtypes, metrics, a
    step count other than the one asked for, another tick or version, a negative
    ``train_time_s``; one longer than the steps at `MAX_STEP_TIME_S` each is capped there).
    Finiteness is checked when folding.
    """
    require_declaration(reply, ("fragments", "none"))
    content = reply.content
    if "metrics" not in content.metric_records:
        raise ReplyError("reply lacks the 'metrics' record")
    m = content.metric_records["metrics"]
    checked = read_reply_metrics(m, expected_version=version, max_steps=steps, step_tokens=step_tokens)
    done = checked.steps
    if done != steps:
        raise ReplyError(f"reply ran {done} inner steps, the message asked for {steps}")
    if stream_step is not None:
        if "stream_step" not in m:
            raise ReplyError("reply metrics lack 'stream_step' (the tick it answers)")
        echoed = metric_whole(m, "stream_step", -(2**63))
        if echoed != stream_step:
            raise ReplyError(f"reply answers the tick starting at step {echoed}, this message started at step "
                             f"{stream_step} (replayed or duplicated)")
    train_time = metric_number(m, "train_time_s") if "train_time_s" in m else 0.0
    if train_time < 0.0:
        raise ReplyError(f"implausible metrics (train_time_s={train_time}, must be >= 0)")
    # a time feeds only the schedule and the metrics: capped (here at what the steps may take,
    # then by the loop's per-site bound), not a reason to refuse the update it came with
    train_time = min(train_time, done * MAX_STEP_TIME_S)
    deltas: dict[int, list[tuple[int, torch.Tensor]]] = {}
    nbytes: dict[int, int] = {}
    for p in syncs:
        name = fragment_record(p)
        record = content.array_records.get(name)
        if record is None:
            raise ReplyError(f"reply lacks the fragment record {name!r}")
        try:
            if compressor is None:
                deltas[p] = decode(record, frag_specs[p], precision)
            else:
                deltas[p] = [(0, decompress_record(record, compressor, frag_specs[p].numel))]
        except PayloadError as exc:
            raise ReplyError(f"{name}: {exc}") from None
        nbytes[p] = payload_nbytes(record)
    r = TrainReply([], checked.tokens, checked.loss, checked.step_time_s, sum(nbytes.values()), done, checked.noisy_steps)
    return StreamReply(
        r, deltas, nbytes,
        train_time_s=train_time,
        overlap_count=metric_whole(m, "overlap_count", 0) if "overlap_count" in m else 0,
        overlap_sum=metric_whole(m, "overlap_sum", 0) if "overlap_sum" in m else 0,
        overlap_max=int(m.get("overlap_max", -1)),
    )
