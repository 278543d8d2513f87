"""Measuring the host a benchmark runs on: peak memory of a block (VmHWM after resetting it),
how busy the CPUs already are, glibc's allocator set to return freed memory (so RSS tracks live
memory), best-of-N timings and the copy bandwidth every throughput figure is compared with.
Linux ``/proc`` files; where one cannot be read the figure is None, never a guess.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PeakMemory", "cpu_busy", "measure_copy_bandwidth", "proc_status_kib", "reset_peak_rss",
           "return_freed_memory_to_os", "timed"]


def proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Peak RSS growth over a block: VmHWM after − VmRSS before (after resetting VmHWM)."""

    def __enter__(self) -> PeakMemory:
        self.ok = reset_peak_rss()
        self.rss0 = proc_status_kib("VmRSS")
        self.extra_bytes: int | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        hwm = proc_status_kib("VmHWM")
        if self.ok and hwm is not None and self.rss0 is not None:
            self.extra_bytes = max(0, hwm - self.rss0) * 1024


def cpu_busy(interval: float = 1.0) -> float | None:
    """Fraction of all CPUs busy over ``interval`` seconds (from /proc/stat), before we start.

    Other processes on a shared machine make every timing here pessimistic; this says how much.
    """
    def snapshot() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                values = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return idle, sum(values)

    first = snapshot()
    time.sleep(interval)
    second = snapshot()
    if first is None or second is None or second[1] == first[1]:
        return None
    return 1.0 - (second[0] - first[0]) / (second[1] - first[1])


def return_freed_memory_to_os() -> None:
    """glibc: serve allocations >= 64 KiB by mmap and trim the heap promptly (memory runs only).

    By default glibc keeps freed heap blocks (up to 32 MiB each) resident and reuses them, so a
    buffer freed while the replies were being built silently absorbs a later allocation and
    hides it from VmHWM. With these settings RSS tracks live memory. Timing runs keep the
    default allocator: fresh mmaps fault their pages in, which would slow Flower's path down.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 128 * 1024)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_copy_bandwidth(numel: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` ``dst.copy_(src)`` on fp32 tensors of ``numel`` elements.

    ``copy_gbps`` = bytes copied per second (size of src / time); ``rw_gbps`` = bytes read +
    written per second (2× that; a write-allocate read of dst, if the CPU does one, is not
    counted).
    """
    src = torch.empty(numel, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = min(timed(lambda: dst.copy_(src), repeats))
    nbytes = numel * 4
    return {"copy_bytes": nbytes, "copy_s": best, "copy_gbps": nbytes / best / 1e9,
            "rw_gbps": 2 * nbytes / best / 1e9}
