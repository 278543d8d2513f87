"""A small thread-safe LRU of finished, validated objects that hands out deep copies.

Loading a config or a scenario validates its inputs through omegaconf (tens of milliseconds) and
reads nothing but those inputs, so equal inputs give equal results; sweeps, seed groups, runs and
tests load the same few again. Each hit is a deep copy, so a caller changing what it got changes
no later load, and what is stored is a copy too.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["CopyCache"]

T = TypeVar("T")


class CopyCache(Generic[T]):
    """At most ``maxsize`` values by key, least recently used dropped first."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> T | None:
        """A copy of the value kept under ``key``, or None."""
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
        return copy.deepcopy(hit)

    def put(self, key: Hashable, value: T) -> None:
        """Keep a copy of ``value`` under ``key``."""
        kept = copy.deepcopy(value)
        with self._lock:
            self._items[key] = kept
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
