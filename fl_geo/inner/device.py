"""Device and mixed-precision selection shared by clients, server evaluation and tests.

Datacenter clients may run on CUDA GPUs, Ascend NPUs (``torch_npu``), Apple MPS or plain CPUs; one
helper keeps the choice (and its error messages) identical everywhere.
"""

from __future__ import annotations

import functools
import importlib

import torch

from fl_geo.inner.choices import DEVICE_KINDS, PRECISIONS

__all__ = ["autocast_dtype", "pick_device", "PRECISIONS"]



@functools.cache
def _npu_plugin_imports() -> bool:
    """Whether the Ascend plugin ``torch_npu`` imports (it registers ``torch.npu`` on import).

    Asked once per process: a failed import is not remembered by Python, so each try searched
    every ``sys.path`` entry again (~1 % of the CPU of the in-process tests, which pick a device
    for every trainer they build)."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return True


def _npu_available() -> bool:
    """True if the Ascend plugin imports and sees a device."""
    if not _npu_plugin_imports():
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "npu":
        return _npu_available()
    if kind == "mps":
        return _mps_available()
    return kind == "cpu"


def pick_device(requested: str = "auto") -> torch.device:
    """Resolve ``requested`` ("auto", "cuda", "cuda:1", "npu", "mps", "cpu") to a usable device.

    "auto" prefers cuda, then npu, then mps, then cpu. An explicit accelerator that is not present
    raises instead of silently falling back: a benchmark that thinks it ran on a GPU but used the CPU
    would report meaningless timings.
    """
    text = str(requested).strip().lower()
    kind = text.split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device {requested!r}; expected one of {', '.join(DEVICE_KINDS)}")
    if kind == "auto":
        if ":" in text:
            raise ValueError(f"device 'auto' takes no index, got {requested!r}")
        for candidate in ("cuda", "npu", "mps"):
            if _available(candidate):
                return torch.device(candidate)
        return torch.device("cpu")
    if not _available(kind):
        hint = {
            "cuda": "torch.cuda.is_available() is False (CPU-only torch build or no GPU visible)",
            "npu": "the torch_npu package is not importable or sees no Ascend device",
            "mps": "torch.backends.mps.is_available() is False (needs Apple silicon and macOS 12.3+)",
        }[kind]
        raise RuntimeError(
            f"device {requested!r} requested but unavailable: {hint}; use 'auto' or 'cpu'"
        )
    return torch.device(text)


def autocast_dtype(device: torch.device | str, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype for ``device`` under ``precision``, or ``None`` for plain fp32.

    bf16 needs no loss scaling, so it is the only reduced precision offered. "auto" uses it on
    accelerators (where it is faster) and keeps fp32 on CPU, where bf16 matmuls are often slower
    and change numerics that CPU tests pin; "bf16" forces it everywhere.
    """
    mode = str(precision).strip().lower()
    if mode not in PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}"
        )
    kind = torch.device(device).type
    if mode == "fp32":
        return None
    if mode == "bf16":
        return torch.bfloat16
    if kind == "cpu":
        return None
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        return None
    return torch.bfloat16
