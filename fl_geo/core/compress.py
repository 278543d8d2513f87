"""Compressed outer updates: one compressor interface, with error feedback, over every codec.

A site sends its pseudo-gradient Δ as a small typed payload instead of fp32:

    payload, new_residual = compressor.compress(delta, residual)
    delta_hat = compressor.decompress(payload)

**Error feedback** (EF; the memory of 1-bit SGD, Seide et al. 2014, "EF14", and of Karimireddy et
al. 2019, as DeMo and SparseLoCo use it): the encoder compresses x = Δ + e and keeps e' = x − decompress(payload) (fp32, same
numel), the part of every earlier update that has not been sent yet. Summed over steps, what the
receiver applies is Σ Δ_t − e_T: the cumulative update tracks the cumulative true one to within the
last residual, where without EF the errors of a biased codec (top-k drops the same small
coordinates every step; a 2-bit grid rounds them to 0) add up. ``residual=None`` is a zero residual
(a site that joins or rejoins starts from zero). With EF off nothing is kept and ``new_residual``
is ``None``. **Decay** β (``feedback_decay``, default 1): the encoder compresses x = Δ + β·e, so
an entry the codec keeps deferring fades by β per step instead of waiting at full size (SparseLoCo's
error feedback with decay); β = 1 is EF as above.

**Codecs** (`CompressSettings.codec`): ``fp32``, ``bf16``, blockwise ``int8`` / ``int4`` /
``int2`` and 1-bit ``sign`` send every element (`fl_geo.core.codecs`); ``topk`` and ``dct_topk`` send ``k`` entries per
chunk, their values in any of those kinds (`fl_geo.core.sparse`). Everything is whole-tensor
torch on the delta's device, deterministic (ties to the lower index), and the payload's arrays are
numpy on the CPU with an exact ``nbytes``; `payload_nbytes` gives the same count from the settings
alone, for a cost model that must not build a payload.

**Validation**: `Compressor.decompress` checks a payload against the receiver's own settings and
raises `PayloadError` (one line) rather than return a wrong tensor. `Compressor.compress` refuses
a non-finite delta or residual (ValueError): shipped, it would be refused by the receiver anyway,
and under EF it would enter the residual and spoil every later step.

Wired for the uplink of fl-geo's ClientApp (wire.compress): see docs/compression.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from fl_geo.core import codecs, sparse
from fl_geo.core.codecs import VALUE_KINDS, CodedValues, DenseValues
from fl_geo.core.sparse import MAX_DCT_CHUNK, SPARSE_CODECS, SparsePayload, kept_count
from fl_geo.errors import ConfigError, PayloadError, require

__all__ = ["CODECS", "DEFAULT_CHUNK", "SETTINGS_JSON_KEYS", "CompressSettings", "Compressor", "Payload",
           "build_compressor", "settings_from_json", "settings_to_json",
           "compress_shards", "expected_keys", "payload_from_arrays", "payload_nbytes"]

CODECS = (*VALUE_KINDS, *SPARSE_CODECS)
# topk: 4096 keeps uint16 indices, and k = 41 at 1 %, close to the ratio; every 4096 elements send
# their share, so a tensor of small entries is not starved by one of large entries. dct_topk: 256
# keeps uint8 indices and the transform at 512 flops per element (a 4096 basis costs 8192 and 64 MiB)
DEFAULT_CHUNK = {"topk": 4096, "dct_topk": 256}
Payload = DenseValues | CodedValues | SparsePayload


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CompressSettings:
    """What a site sends instead of its fp32 Δ; both ends hold the same settings.

    The defaults have the shape of SparseLoCo's recipe (chunked top-k of about 1 %, 2-bit values,
    error feedback); the chunk and k are this module's choice. Per chunk of 4096: 41 kept entries
    of 2 index bytes and 2 bits, one fp32 scale per 128 kept values, 93.5 bytes against 16,384 in
    fp32 (~175x fewer). Error feedback is on because neither top-k nor a 2-bit grid is unbiased.

    codec : fp32 | bf16 | int8 | int4 | int2 | sign (dense) | topk | dct_topk (sparse)
    ratio : the fraction of each chunk a sparse codec keeps, k = max(1, round(ratio · chunk))
    k : entries kept per chunk (overrides ``ratio``), 1 <= k <= chunk
    chunk : elements per chunk (None: `DEFAULT_CHUNK`); dct_topk at most `MAX_DCT_CHUNK`
    values : the kind of the kept values of a sparse codec (a dense codec is its own kind)
    block : elements per fp32 scale of the int and sign codes (128: an outlier flattens at most 127 others)
    error_feedback : keep the residual (see the module docstring); with fp32 it stays 0
    feedback_decay : β in (0, 1], the residual's weight in the next step (1: plain EF; only with EF)
    """

    codec: str = "topk"
    ratio: float = 0.01
    k: int | None = None
    chunk: int | None = None
    values: str = "int2"
    block: int = 128
    error_feedback: bool = True
    feedback_decay: float = 1.0

    @property
    def sparse(self) -> bool:
        return self.codec in SPARSE_CODECS

    @property
    def chunk_size(self) -> int:
        """The chunk in use (sparse codecs)."""
        return self.chunk if self.chunk is not None else DEFAULT_CHUNK.get(self.codec, 4096)

    @property
    def k_per_chunk(self) -> int:
        """Entries kept per chunk (sparse codecs)."""
        if self.k is not None:
            return self.k
        return min(self.chunk_size, max(1, round(self.ratio * self.chunk_size)))

    def check(self) -> None:
        """Raise `ConfigError` (one line) for a value out of its range."""
        require(self.codec in CODECS, f"compress.codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        require(self.values in VALUE_KINDS,
                f"compress.values must be one of {', '.join(VALUE_KINDS)}, got {self.values!r}")
        require(_is_int(self.block) and self.block >= 1, f"compress.block must be an int >= 1, got {self.block!r}")
        require(isinstance(self.error_feedback, bool),
                f"compress.error_feedback must be true or false, got {self.error_feedback!r}")
        beta = self.feedback_decay
        require(isinstance(beta, int | float) and not isinstance(beta, bool) and 0 < beta <= 1,
                f"compress.feedback_decay must be in (0, 1], got {beta!r}")
        require(beta == 1 or self.error_feedback,
                f"compress.feedback_decay={beta} decays the error-feedback residual, but error feedback is off")
        require(isinstance(self.ratio, int | float) and not isinstance(self.ratio, bool) and 0 < self.ratio <= 1,
                f"compress.ratio must be in (0, 1], got {self.ratio!r}")
        chunk = self.chunk_size
        top = MAX_DCT_CHUNK if self.codec == "dct_topk" else 2**32
        require(_is_int(chunk) and 1 <= chunk <= top,
                f"compress.chunk must be an int in [1, {top}] for {self.codec}, got {chunk!r}")
        require(self.k is None or (_is_int(self.k) and 1 <= self.k <= chunk),
                f"compress.k must be an int in [1, chunk={chunk}], got {self.k!r}")

    def describe(self) -> str:
        """A short label: ``int8``, ``topk 41/4096 int2``, with ``+EF`` when error feedback is on."""
        name = f"{self.codec} {self.k_per_chunk}/{self.chunk_size} {self.values}" if self.sparse else self.codec
        if not self.error_feedback:
            return name
        return name + (" +EF" if self.feedback_decay == 1 else f" +EF(decay {self.feedback_decay:g})")


def payload_nbytes(settings: CompressSettings, numel: int) -> int:
    """Bytes of the payload of ``numel`` elements, from the settings alone (equal to
    ``payload.nbytes``): the formulas of `fl_geo.core.codecs` and `fl_geo.core.sparse`."""
    if settings.sparse:
        return sparse.sparse_nbytes(settings.codec, numel, settings.chunk_size, settings.k_per_chunk,
                                    settings.values, settings.block)
    return codecs.values_nbytes(settings.codec, numel, settings.block)


def _flat_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_floating_point() or t.numel() == 0:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a non-empty 1-D floating tensor, got {got}")
    return t.detach().to(torch.float32)


class Compressor:
    """`compress` / `decompress` for one `CompressSettings` (checked when built)."""

    def __init__(self, settings: CompressSettings) -> None:
        settings.check()
        self.settings = settings

    def nbytes(self, numel: int) -> int:
        """`payload_nbytes` of these settings."""
        return payload_nbytes(self.settings, numel)

    def compress(self, delta: torch.Tensor, residual: torch.Tensor | None = None
                 ) -> tuple[Payload, torch.Tensor | None]:
        """Encode ``delta`` (+ β · ``residual`` under EF); returns the payload and the new residual.

        ``delta``: 1-D floating, any device (computed in fp32 there). ``residual``: None (zero) or
        the fp32 residual this compressor returned last time, same numel and device; passing one
        with EF off is a ValueError (the caller keeps state it should not). The new residual is
        x − decompress(payload) on delta's device, bit for bit what a receiver decoding on the same
        kind of device reconstructs.
        """
        x = _flat_fp32(delta, "delta")
        if residual is not None:
            if not self.settings.error_feedback:
                raise ValueError("a residual was passed but error feedback is off")
            r = _flat_fp32(residual, "residual")
            if r.shape != x.shape or r.device != x.device:
                raise ValueError(f"residual must match delta: {tuple(r.shape)} on {r.device} vs "
                                 f"{tuple(x.shape)} on {x.device}")
            x = x + self.settings.feedback_decay * r  # β = 1.0: exactly x + r
        if not bool(torch.isfinite(x).all()):
            raise ValueError("delta (+ residual) is not finite; nothing is encoded and the residual is unchanged")
        payload = self._encode(x)
        if not self.settings.error_feedback:
            return payload, None
        return payload, x - self.decompress(payload, numel=x.numel(), device=x.device)

    def _encode(self, x: torch.Tensor) -> Payload:
        s = self.settings
        if s.sparse:
            return sparse.encode_sparse(x, s.codec, s.chunk_size, s.k_per_chunk, s.values, s.block)
        return codecs.encode_values(x, s.codec, s.block)

    def decompress(self, payload: object, *, numel: int | None = None,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """The fp32 Δ̂ (1-D, on ``device``, default CPU) a payload stands for; `PayloadError` for
        anything that does not fit these settings (and ``numel`` when given)."""
        s = self.settings
        if s.sparse:
            return sparse.decode_sparse(payload, s.codec, s.chunk_size, s.k_per_chunk, s.values, s.block,
                                        numel=numel, device=device)
        n = numel if numel is not None else getattr(payload, "numel", None)
        if not _is_int(n) or n < 1:
            raise PayloadError(f"payload numel must be an int >= 1, got {n!r}")
        return codecs.decode_values(payload, s.codec, n, s.block, device)


def build_compressor(settings: CompressSettings | None = None, **overrides: object) -> Compressor:
    """A `Compressor` for ``settings`` (default `CompressSettings()`), with keyword overrides:
    ``build_compressor(codec="int8", error_feedback=False)``; raises `ConfigError` for a bad value
    or an unknown keyword."""
    base = settings if settings is not None else CompressSettings()
    known = {f.name for f in fields(CompressSettings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown compress setting(s) {unknown}; valid: {', '.join(sorted(known))}")
    return Compressor(replace(base, **overrides))


def _value_keys(kind: str) -> tuple[str, ...]:
    return ("values",) if kind in ("fp32", "bf16") else ("codes", "scales")


def expected_keys(settings: CompressSettings) -> tuple[str, ...]:
    """The array names a payload of these settings holds, in the order they travel."""
    if settings.sparse:
        return ("indices", *_value_keys(settings.values))
    return _value_keys(settings.codec)


def _values(kind: str, m: int, block: int, arrays: dict[str, np.ndarray]) -> codecs.Values:
    if kind in ("fp32", "bf16"):
        return DenseValues(kind, m, arrays["values"])
    return CodedValues(kind, m, block, arrays["codes"], arrays["scales"])


def payload_from_arrays(settings: CompressSettings, numel: int, arrays: dict[str, np.ndarray]) -> Payload:
    """The payload of ``numel`` elements that received ``arrays`` stand for, its header taken from
    the receiver's own ``settings`` (the header never travels). `PayloadError` for another key set;
    dtypes, lengths, indices, codes and scales are `Compressor.decompress`'s to check."""
    want = set(expected_keys(settings))
    if set(arrays) != want:
        raise PayloadError(f"a {settings.describe()} payload holds exactly {sorted(want)}, got {sorted(arrays)[:8]}")
    if settings.sparse:
        m = kept_count(settings.codec, numel, settings.chunk_size, settings.k_per_chunk)
        return SparsePayload(settings.codec, numel, settings.chunk_size, settings.k_per_chunk, arrays["indices"],
                             _values(settings.values, m, settings.block, arrays))
    return _values(settings.codec, numel, settings.block, arrays)


def compress_shards(compressor: Compressor, delta: torch.Tensor, bounds: list[tuple[int, int]],
                    residual: torch.Tensor | None = None) -> tuple[list[Payload], torch.Tensor | None]:
    """Compress each contiguous shard ``delta[b:e]`` on its own (chunks and blocks restart at every
    shard start, so each receiver decodes its shard alone), with one model-sized error-feedback
    ``residual`` sliced by shard. Returns one payload per shard and the new residual (None with
    EF off). All or nothing: a non-finite shard raises ValueError before any residual is built.

    Per shard s this is exactly ``compressor.compress(delta[b:e], residual[b:e])``: with one shard
    covering the model it is the unsharded compressor's output, bit for bit."""
    starts = [0] + [e for _, e in bounds[:-1]]
    if not bounds or bounds[-1][1] != delta.numel() or any(
            b != s or b >= e for (b, e), s in zip(bounds, starts, strict=True)):
        raise ValueError(f"shard bounds {bounds[:4]}... do not cover the {delta.numel()} elements contiguously")
    payloads: list[Payload] = []
    pieces: list[torch.Tensor] = []
    for b, e in bounds:
        payload, r = compressor.compress(delta[b:e], None if residual is None else residual[b:e])
        payloads.append(payload)
        if r is not None:
            pieces.append(r)
    return payloads, (torch.cat(pieces) if pieces else None)


# The settings as the JSON a request or a follower's command line carries: both ends rebuild the
# same `CompressSettings` (``k`` is not sent: the wire settings never set it). ``feedback_decay``
# travels only when it is not 1, so the JSON of plain EF is what it was before decay existed (a peer
# of that version reads it unchanged).
SETTINGS_JSON_KEYS = ("codec", "ratio", "chunk", "values", "block", "error_feedback")
OPTIONAL_JSON_KEYS = ("feedback_decay",)


def settings_to_json(s: CompressSettings | None) -> str | None:
    """``s`` as its JSON (`SETTINGS_JSON_KEYS`, sorted), None when compression is off."""
    if s is None:
        return None
    values = {k: getattr(s, k) for k in SETTINGS_JSON_KEYS}
    if s.feedback_decay != 1:
        values["feedback_decay"] = s.feedback_decay
    return json.dumps(values, sort_keys=True)


def settings_from_json(text: str | None, field: str = "wire_compress") -> CompressSettings | None:
    """The `CompressSettings` of a `settings_to_json` text (None for None), checked: `ConfigError`
    naming ``field`` when it is not exactly those keys (and optionally ``feedback_decay``) or a value
    is out of range."""
    if text is None:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{field} is not JSON ({exc}): {text:.120}") from None
    if not isinstance(values, dict) or not set(SETTINGS_JSON_KEYS) <= set(values) <= {*SETTINGS_JSON_KEYS,
                                                                                     *OPTIONAL_JSON_KEYS}:
        raise ConfigError(f"{field} must hold {', '.join(SETTINGS_JSON_KEYS)}; got {text:.120}")
    settings = CompressSettings(**values)
    settings.check()
    return settings
