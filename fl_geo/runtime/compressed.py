"""Compressed payloads on the wire (the uplink's update, the downlink's deltas): a `fl_geo.core.compress` payload's arrays in a Flower
``ArrayRecord``.

The record holds exactly the payload's named arrays (``payload.arrays()``: ``values``;
``codes`` + ``scales``; ``indices`` plus either), each a standard ``.npy`` byte string; the header
ints (codec, element count, chunk, k, block) do not travel: both ends know them from the run's
``wire`` section (the request's ``wire_compress``) and the model's `ParamSpec`. Reading one checks
the key set and that every array decodes, rebuilds the payload from the receiver's own settings and
lets `Compressor.decompress` check dtypes, lengths, index ranges and order, codes and scales;
anything wrong raises `PayloadError`, so a malformed or hostile reply is rejected like any other
bad payload (docs/compression.md).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fl_geo.core.compress import Compressor, Payload, payload_from_arrays
from fl_geo.core.compress import expected_keys as _keys_of
from fl_geo.core.state import ParamSpec
from fl_geo.errors import PayloadError
from fl_geo.runtime.wire import decode_into

__all__ = ["chain_record", "compress_record", "decompress_record", "expected_keys", "read_chain",
           "read_update_record"]


def compress_record(payload: Payload) -> ArrayRecord:
    """The payload's arrays as an ArrayRecord (one ``.npy`` Array each)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in payload.arrays().items()})


def expected_keys(compressor: Compressor) -> tuple[str, ...]:
    """The array names a payload of these settings holds."""
    return _keys_of(compressor.settings)


def decompress_record(record: ArrayRecord, compressor: Compressor, numel: int) -> torch.Tensor:
    """The fp32 Δ̂ of ``numel`` elements (CPU) a `compress_record` payload stands for; `PayloadError`
    for other keys, an unreadable array or anything `Compressor.decompress` refuses."""
    s = compressor.settings
    want = set(expected_keys(compressor))
    keys = set(record.keys())
    if keys != want:
        raise PayloadError(f"a {s.describe()} payload holds exactly {sorted(want)}, got {sorted(keys)[:8]}")
    arrays: dict[str, np.ndarray] = {}
    for key in sorted(want):
        try:
            arrays[key] = record[key].numpy()
        except Exception as exc:  # noqa: BLE001 - a corrupt .npy is bad input, whatever numpy raises
            raise PayloadError(f"unreadable {s.codec} payload array {key!r}: {exc}"[:300]) from None
    return compressor.decompress(payload_from_arrays(s, numel, arrays), numel=numel)


def chain_record(steps: list[tuple[int, Payload]]) -> ArrayRecord:
    """Downlink deltas in one ArrayRecord: payload ``v``'s arrays under ``d<v>.<name>`` (``v``: the
    public-model version the delta leads to), in order (`fl_geo.core.downlink`)."""
    return ArrayRecord({f"d{v}.{name}": Array(np.ascontiguousarray(a))
                        for v, payload in steps for name, a in payload.arrays().items()})


def read_chain(record: ArrayRecord, compressor: Compressor, numel: int, first: int, last: int) -> list[torch.Tensor]:
    """The decoded deltas of a `chain_record` leading from version ``first`` to ``last`` (one per
    version, in order); `PayloadError` for any other key set or a payload `decompress_record` refuses."""
    names = expected_keys(compressor)
    want = {f"d{v}.{n}" for v in range(first + 1, last + 1) for n in names}
    keys = set(record.keys())
    if keys != want:
        extra, missing = sorted(keys - want)[:4], sorted(want - keys)[:4]
        raise PayloadError(f"a downlink chain {first}->{last} holds {len(want)} arrays; unexpected {extra}, "
                           f"missing {missing}")
    return [decompress_record(ArrayRecord({n: record[f"d{v}.{n}"] for n in names}), compressor, numel)
            for v in range(first + 1, last + 1)]


def read_update_record(record: ArrayRecord, spec: ParamSpec, precision: str, compressor: Compressor | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One model-sized update from a record, as fp32 (1-D, ``spec.numel``): ``compressor``'s
    payload (`decompress_record`) or, without one, the model's arrays at ``precision``
    (`fl_geo.runtime.wire.decode_into`, into ``out`` when given). HALoS's global server reads a
    local server's U_k this way, in the simulation and the deployment alike. `PayloadError` for
    anything malformed; finiteness is the caller's to check (the server's ``apply`` does)."""
    if compressor is not None:
        return decompress_record(record, compressor, spec.numel)
    return decode_into(record, spec, precision, out=out)
