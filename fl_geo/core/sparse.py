"""Chunked top-k and chunked DCT top-k: the sparse codecs of `fl_geo.core.compress`.

A flat vector of ``numel`` elements is cut into chunks of ``chunk`` (the last one may be short:
``r = numel − (rows − 1)·chunk`` elements). Per chunk, ``k`` entries are kept:

* ``topk``: the ``k`` entries of largest |x| (the short last chunk keeps ``min(k, r)``);
* ``dct_topk`` (DeMo / SparseLoCo style): the chunk, zero-padded to ``chunk``, is turned into
  its orthonormal DCT-II coefficients X = D x (D a ``chunk`` x ``chunk`` matrix built once per size
  in float64, then cast to fp32), and the ``k`` coefficients of largest |X| are kept (every chunk
  keeps ``k``: a padded chunk still has ``chunk`` coefficients). Decoding is x̂ = Dᵀ X̂. Pseudo-
  gradients are smooth along a row of a weight matrix, so a few low frequencies carry much of a
  chunk's energy; the transform is orthonormal, so ||x − x̂|| = ||X − X̂||.

Ties in |x| are broken by the lower index, so the selection is a function of the input alone;
the kept indices are sent in increasing order within each chunk. The payload holds the in-chunk
indices in the smallest unsigned type that fits ``chunk − 1`` (``uint8`` up to 256, ``uint16`` up
to 65,536, else ``uint32``) and the kept values, in chunk order, as a `fl_geo.core.codecs` value
payload (fp32, bf16 or int codes). Bytes for m kept entries: m·(index bytes) + the value bytes.

`decode_sparse` refuses (`PayloadError`, one line) a payload whose header or arrays do not fit the
receiver's settings: another codec, chunk or k (k outside [1, chunk] said so), a wrong index dtype or
count, an index outside its chunk (the short last chunk included), an index repeated or out of
order within a chunk, and whatever `fl_geo.core.codecs.decode_values` refuses in the values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from fl_geo.core.codecs import Values, decode_values, encode_values, values_nbytes
from fl_geo.errors import PayloadError

__all__ = ["MAX_DCT_CHUNK", "SPARSE_CODECS", "SparsePayload", "dct_basis", "decode_sparse", "encode_sparse",
           "index_dtype", "kept_count", "sparse_nbytes", "topk_indices"]

SPARSE_CODECS = ("topk", "dct_topk")
# the basis is chunk² fp32 and the transform costs 2·chunk flops per element: 4096 is 64 MiB and
# already ~8k flops per element, past which the DCT is slower than the link it is meant to spare
MAX_DCT_CHUNK = 4096


@dataclass(frozen=True)
class SparsePayload:
    """``k`` kept entries per chunk of ``chunk``: in-chunk ``indices`` and their ``values``."""

    codec: str
    numel: int
    chunk: int
    k: int
    indices: np.ndarray
    values: Values

    @property
    def nbytes(self) -> int:
        """Bytes that travel: the indices and the value arrays (no container overhead)."""
        return int(self.indices.nbytes) + self.values.nbytes

    def arrays(self) -> dict[str, np.ndarray]:
        return {"indices": self.indices, **self.values.arrays()}


def index_dtype(chunk: int) -> np.dtype:
    """The smallest unsigned dtype that holds an index in [0, chunk)."""
    for dtype in ("u1", "<u2", "<u4"):
        if chunk - 1 <= np.iinfo(np.dtype(dtype)).max:
            return np.dtype(dtype)
    raise ValueError(f"chunk {chunk} does not fit a uint32 index")


def kept_count(codec: str, numel: int, chunk: int, k: int) -> int:
    """Entries a payload keeps: ``rows·k`` for dct_topk, one ``min(k, r)`` last chunk for topk."""
    rows = math.ceil(numel / chunk)
    if codec == "dct_topk":
        return rows * k
    return (rows - 1) * k + min(k, numel - (rows - 1) * chunk)


def sparse_nbytes(codec: str, numel: int, chunk: int, k: int, values: str, block: int) -> int:
    """Payload bytes: kept entries x index bytes, plus the kept values in ``values``."""
    m = kept_count(codec, numel, chunk, k)
    return m * index_dtype(chunk).itemsize + values_nbytes(values, m, block)


@functools.lru_cache(maxsize=16)
def dct_basis(chunk: int, device: str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix D (row f is frequency f): X = D x, x = Dᵀ X.

    D[f, i] = sqrt(2/c) · cos(π (2i + 1) f / (2c)), row 0 scaled by 1/√2; built in float64 so the
    fp32 matrix is orthonormal to fp32 rounding, once per (chunk, device).
    """
    i = torch.arange(chunk, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * chunk)) * math.sqrt(2 / chunk)
    basis[0] /= math.sqrt(2)
    return basis.to(device=device, dtype=torch.float32)


def _rows(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x`` zero-padded to whole chunks, as (rows, chunk)."""
    pad = (-x.numel()) % chunk
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, chunk)


def _first_largest(mag: torch.Tensor, kth: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th largest value is tied beyond the count: everything above it, then the
    lowest indices equal to it; (rows, k) in-row indices, ascending, padded with the row length."""
    above = mag > kth[:, None]
    tied = mag == kth[:, None]
    room = counts - above.sum(dim=1)
    keep = above | (tied & (tied.cumsum(dim=1) <= room[:, None]))
    order = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
    pos = torch.arange(k, device=mag.device)
    return torch.where(pos < counts[:, None], order.sort(dim=1).values, mag.shape[1])


def topk_indices(mag: torch.Tensor, k: int, k_last: int) -> torch.Tensor:
    """Per row of ``mag`` (rows, chunk): the in-row indices of the ``k`` (the last row: ``k_last``)
    largest values, ties to the lower index, ascending; (rows, k), the last row padded with
    ``chunk`` beyond ``k_last``.

    One `torch.topk`; `torch.topk` picks among equal values in no documented order, so the rows
    where an unpicked entry equals the k-th value (all-zero chunks, repeated values) are picked
    again by index (`_first_largest`).
    """
    rows, chunk = mag.shape
    counts = torch.full((rows,), k, dtype=torch.long, device=mag.device)
    counts[-1] = k_last
    vals, idx = torch.topk(mag, k, dim=1)
    kth = vals.gather(1, (counts - 1)[:, None]).squeeze(1)
    pos = torch.arange(k, device=mag.device)
    picked_ties = ((vals == kth[:, None]) & (pos < counts[:, None])).sum(dim=1)
    redo = ((mag == kth[:, None]).sum(dim=1) > picked_ties).nonzero().squeeze(1)
    idx = torch.where(pos < counts[:, None], idx, chunk).sort(dim=1).values
    if redo.numel():
        idx[redo] = _first_largest(mag[redo], kth[redo], counts[redo], k)
    return idx


def encode_sparse(x: torch.Tensor, codec: str, chunk: int, k: int, values: str, block: int) -> SparsePayload:
    """``x`` (1-D fp32, any device) as a `SparsePayload`; arrays on the CPU."""
    numel = x.numel()
    rows = _rows(x, chunk)
    if codec == "dct_topk":
        rows = rows @ dct_basis(chunk, str(x.device)).T
    mag = rows.abs()
    k_last = k
    if codec == "topk":
        short = numel - (rows.shape[0] - 1) * chunk
        mag[-1, short:] = -1.0  # padding: below every |x|, never picked while k_last <= short
        k_last = min(k, short)
    idx = topk_indices(mag, k, k_last)
    keep = idx < chunk
    kept = rows.gather(1, idx.clamp(max=chunk - 1))[keep]
    indices = idx[keep].to("cpu").numpy().astype(index_dtype(chunk))
    return SparsePayload(codec, numel, chunk, k, indices, encode_values(kept, values, block))


def _check_header(p: object, codec: str, chunk: int, k: int, numel: int | None) -> SparsePayload:
    if not isinstance(p, SparsePayload):
        raise PayloadError(f"a {codec} payload must be a SparsePayload, got {type(p).__name__}")
    if p.codec != codec:
        raise PayloadError(f"payload codec is {p.codec!r}, this decoder expects {codec!r}")
    if isinstance(p.numel, bool) or not isinstance(p.numel, int) or p.numel < 1:
        raise PayloadError(f"payload numel must be an int >= 1, got {p.numel!r}")
    if numel is not None and p.numel != numel:
        raise PayloadError(f"payload holds {p.numel} elements, this decoder expects {numel}")
    if p.chunk != chunk:
        raise PayloadError(f"payload chunk is {p.chunk!r}, this decoder expects {chunk}")
    if isinstance(p.k, bool) or not isinstance(p.k, int) or not 1 <= p.k <= chunk:
        raise PayloadError(f"payload k must be an int in [1, {chunk}], got {p.k!r}")
    if p.k != k:
        raise PayloadError(f"payload keeps k={p.k} per chunk, this decoder expects {k}")
    return p


def _check_indices(p: SparsePayload, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk of each entry, in-chunk index), both int64, after the range and order checks."""
    want = index_dtype(p.chunk)
    if not isinstance(p.indices, np.ndarray) or p.indices.dtype != want or p.indices.shape != (m,):
        got = f"{p.indices.dtype} {p.indices.shape}" if isinstance(p.indices, np.ndarray) else type(p.indices).__name__
        raise PayloadError(f"indices must be {want} of shape ({m},), got {got}")
    idx = torch.from_numpy(p.indices.astype(np.int64))
    row = torch.arange(m) // p.k
    rows = math.ceil(p.numel / p.chunk)
    limit = torch.full((m,), p.chunk, dtype=torch.long)
    if p.codec == "topk":
        limit[row == rows - 1] = p.numel - (rows - 1) * p.chunk
    over = (idx >= limit).nonzero()
    if len(over):
        j = int(over[0])
        raise PayloadError(f"index {int(idx[j])} is outside chunk {int(row[j])} of {int(limit[j])} elements")
    bad = ((row[1:] == row[:-1]) & (idx[1:] <= idx[:-1])).nonzero()
    if len(bad):
        j = int(bad[0]) + 1
        what = "repeats" if int(idx[j]) == int(idx[j - 1]) else "is out of order (indices increase within a chunk)"
        raise PayloadError(f"index {int(idx[j])} {what} in chunk {int(row[j])}")
    return row, idx


def decode_sparse(p: object, codec: str, chunk: int, k: int, values: str, block: int, *,
                  numel: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 vector a `SparsePayload` stands for, after every check of the module docstring;
    ``codec``, ``chunk``, ``k``, ``values``, ``block`` (and ``numel`` when given) are what the
    receiver expects. Entries not kept are 0 (in the DCT domain for dct_topk)."""
    p = _check_header(p, codec, chunk, k, numel)
    m = kept_count(codec, p.numel, chunk, k)
    row, idx = _check_indices(p, m)
    vals = decode_values(p.values, values, m, block)
    device = torch.device("cpu") if device is None else torch.device(device)
    rows = math.ceil(p.numel / chunk)
    dense = torch.zeros(rows * chunk, dtype=torch.float32, device=device)
    dense[(row * chunk + idx).to(device)] = vals.to(device)
    if codec == "dct_topk":
        dense = (dense.view(rows, chunk) @ dct_basis(chunk, str(device))).reshape(-1)
    return dense[:p.numel].contiguous()
