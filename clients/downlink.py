"""A site's end of the compressed downlink (``wire.compress_down``; docs/compression.md).

The server sends either its public model x̂ whole (in ``wire_down`` precision; no ``down_from``)
or the compressed deltas from the x̂ version this site holds to the current one
(`fl_geo.core.downlink`). The site keeps its copy of x̂ and its version in ``context.state``
(`PUBLIC_KEY`, `PUBLIC_VERSION_KEY`) and trains from it.

A delta whose base is not the version held here (or that arrives when nothing is held), a record
with other keys, a payload the codec refuses (an index out of range, a NaN scale, truncated codes)
or a result that is not finite raises (`PayloadError` / ValueError: the job's error reply), and
the kept x̂ is left exactly as it was; the server then sends x̂ whole. The copy is not written to
the node's disk with the inner state: a server that resumed, like any that does not know what a
node holds, sends x̂ whole first, so a copy read back from disk would never be used.
"""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_geo.core.compress import Compressor
from fl_geo.core.downlink import apply_delta
from fl_geo.core.state import ParamSpec
from fl_geo.errors import PayloadError
from fl_geo.runtime import protocol
from fl_geo.runtime.compressed import read_chain
from fl_geo.runtime.wire import decode_into
from fl_geo.runtime.wire_settings import uplink_from_json

__all__ = ["PUBLIC_KEY", "PUBLIC_VERSION_KEY", "held_version", "receive_public"]

PUBLIC_KEY = "downlink_public"  # ArrayRecord {"params": fp32 x̂}
PUBLIC_VERSION_KEY = "downlink_version"  # ConfigRecord {"version": int}


def held_version(state: RecordDict) -> int | None:
    """The x̂ version this site holds, None when it holds none."""
    rec = state.config_records.get(PUBLIC_VERSION_KEY)
    return int(rec["version"]) if rec is not None and PUBLIC_KEY in state.array_records else None


def receive_public(state: RecordDict, record: ArrayRecord | None, req: protocol.TrainRequest, spec: ParamSpec,
                   out: torch.Tensor) -> torch.Tensor:
    """x̂ at ``req.down_version`` into ``out`` (fp32, ``spec.numel``), from ``record``: x̂ whole, or
    the deltas from the version held here; the new copy replaces the kept one only once all of it
    has decoded and is finite (any failure raises and keeps the old one)."""
    if record is None:
        raise ValueError("the message carries no model ('arrays')")
    assert req.down_version is not None  # TrainRequest: it comes with wire_compress_down
    if req.down_from is None:
        decode_into(record, spec, req.wire_down, out=out)
        x = out
    else:
        held = held_version(state)
        if held != req.down_from:
            raise PayloadError(f"a downlink delta from version {req.down_from}, but this site holds "
                               f"{'no public model' if held is None else f'version {held}'}")
        settings = uplink_from_json(req.wire_compress_down, "wire_compress_down")
        assert settings is not None
        base = torch.from_numpy(state.array_records[PUBLIC_KEY]["params"].numpy())
        if base.dtype != torch.float32 or base.shape != (spec.numel,):
            raise PayloadError(f"the kept public model ({base.dtype} {tuple(base.shape)}) does not fit this model")
        x = base
        for delta in read_chain(record, Compressor(settings), spec.numel, req.down_from, req.down_version):
            x = apply_delta(x, delta, req.wire_down)
        if not bool(torch.isfinite(x).all()):
            raise PayloadError("the model after the downlink deltas is not finite")
        out.copy_(x)
    if not bool(torch.isfinite(out).all()):
        raise PayloadError("the received public model is not finite")
    state[PUBLIC_KEY] = ArrayRecord({"params": Array(out.detach().cpu().numpy().copy())})
    state[PUBLIC_VERSION_KEY] = ConfigRecord({"version": req.down_version})
    return out
