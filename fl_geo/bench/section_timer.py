"""A tiny instrumenting profiler: inclusive/exclusive wall time of chosen callables on one
thread, patched in place and restored after (`fl-geo bench dispatch`'s full-path timers).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["SectionTimer"]


class SectionTimer:
    """Inclusive/exclusive wall time of wrapped callables, on one thread only.

    A tiny instrumenting profiler over chosen entry points: cProfile would slow every Python call
    of the loop and blur the figure it explains; here only ~30 calls per update pay a few µs.
    A call nested in a call of the same label counts once (``super().step()`` in an optimizer).
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [label, time spent in timed children]
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != timer.thread or (timer._stack and timer._stack[-1][0] == label):
                return fn(*args, **kwargs)
            frame = [label, 0.0]
            timer._stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                timer._stack.pop()
                timer.exclusive[label] += dt - frame[1]
                timer.calls[label] += 1
                if timer._stack:
                    timer._stack[-1][1] += dt

        return timed

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` (class, module or instance attribute) until :meth:`restore`."""
        self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def patch(self, owner: Any, name: str, label: str) -> None:
        """Replace ``owner.name`` by its timed wrapper."""
        self.replace(owner, name, self.wrap(label, getattr(owner, name)))

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def snapshot(self) -> tuple[float, dict[str, float], dict[str, int]]:
        return time.perf_counter(), dict(self.exclusive), dict(self.calls)


_MISSING = object()
