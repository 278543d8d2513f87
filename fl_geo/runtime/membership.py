"""Who may train: a node's profile is checked before the node is admitted to a run.

A node tells the server its partition (``partition-id`` of ``num-partitions``), its device and,
for a data-parallel site, how many devices train (fl_geo.clients answers the ``query`` message).
A profile is the node's own claim, so the server checks it before anything is indexed by it:

- every field has its type and range (a whole ``partition_id`` in [0, ``num_partitions``), a
  ``num_partitions`` in [1, `MAX_PARTITIONS`], ``devices`` in [1, `MAX_DEVICES`], short strings);
- every admitted node agrees on ``num_partitions`` (the first admission fixes it for the run:
  the value most of those nodes give, the smallest on a tie), and a partition id is below the
  number of node slots of the run's scenario when there is one;
- a partition id is held by one live node at a time: a second live node claiming it is refused,
  so one site's data cannot count twice. The claim is asked again later (`RETRY_DUPLICATE_S`):
  a SuperNode restarted with the same partition gets a new Flower node id while the dead one may
  still look live until its heartbeat lapses, and it must be admitted once that happens.

A refused node gets no job; the reason is logged once at WARNING. A malformed or out-of-range
profile is refused for good (its node config cannot change without a restart, which gives a new
node id).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("fl_geo")

MAX_PARTITIONS = 100_000  # more sites than any federation; bounds what a claim can make the server build
MAX_DEVICES = 4096  # accelerators one site trains on in one data-parallel job
MAX_TEXT = 200  # characters of a device or site name
RETRY_DUPLICATE_S = 5.0


class ProfileError(ValueError):
    """A profile that cannot be admitted; the message names the field and its bound."""


@dataclass
class NodeProfile:
    """What a node told the server about itself (its ``node_config`` and hardware)."""

    node_id: int
    partition_id: int
    num_partitions: int
    device: str = "cpu"
    site: str = ""
    # False for a plain Flower ClientApp (it did not answer the profile query): it is sent the
    # fp32 model and replies the trained model, from which the server computes Δ.
    fl_geo_client: bool = True
    devices: int | None = None  # data-parallel processes the site declared (None: the run's client.devices)

    @property
    def rank(self) -> tuple[int, int]:
        """Sort key that does not depend on Flower's random node ids."""
        return (self.partition_id, self.node_id)


def _whole(record: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value != int(value) or not low <= value <= high:
        raise ProfileError(f"profile field '{key}'={value!r:.60} must be a whole number in [{low}, {high}]")
    return int(value)


def _text(record: Mapping[str, Any], key: str, default: str) -> str:
    value = record.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ProfileError(f"profile field '{key}' must be a string of at most {MAX_TEXT} characters")
    return value


def profile_from_record(node_id: int, record: Mapping[str, Any]) -> NodeProfile:
    """A `NodeProfile` from a node's answer to the profile query, every field checked.

    Raises `ProfileError` naming the field for anything missing, of the wrong type or out of range.
    """
    for key in ("partition_id", "num_partitions"):
        if key not in record:
            raise ProfileError(f"profile lacks '{key}'")
    num_partitions = _whole(record, "num_partitions", 1, MAX_PARTITIONS)
    partition_id = _whole(record, "partition_id", 0, num_partitions - 1)
    devices = _whole(record, "devices", 1, MAX_DEVICES) if "devices" in record else None
    return NodeProfile(node_id=node_id, partition_id=partition_id, num_partitions=num_partitions,
                       device=_text(record, "device", "cpu"), site=_text(record, "site", ""), devices=devices)


@dataclass
class Membership:
    """Admission of profiled nodes: agreement on the partition count, one live node per partition.

    ``slots``: the scenario's node count when the run has one (partition id = scenario slot).
    """

    slots: int | None = None
    num_partitions: int | None = None
    refused: dict[int, str] = field(default_factory=dict)  # node id -> reason (for good)
    _retry_at: dict[int, float] = field(default_factory=dict)  # node id -> when to ask again (duplicates)
    _warned: set[tuple[int, str]] = field(default_factory=set)

    def waiting(self, node: int) -> bool:
        """True for a node that must not be asked again now (refused, or a duplicate asked recently)."""
        return node in self.refused or self._retry_at.get(node, 0.0) > time.monotonic()

    def refuse(self, node: int, reason: str, *, retry: bool = False) -> None:
        """Refuse ``node``; ``retry`` asks again after `RETRY_DUPLICATE_S` instead of never."""
        if retry:
            self._retry_at[node] = time.monotonic() + RETRY_DUPLICATE_S
        else:
            self.refused[node] = reason
        if (node, reason) not in self._warned:
            self._warned.add((node, reason))
            log.warning("refused node %s: %s", node, reason)

    def admit(self, candidates: Mapping[int, NodeProfile], admitted: Mapping[int, NodeProfile],
              live: Iterable[int]) -> dict[int, NodeProfile]:
        """The ``candidates`` that may join next to the ``admitted`` profiles; the rest are refused.

        Deterministic for a given set of claims: the partition count is fixed by the majority of
        the first admission, and between candidates claiming one free partition the lowest node id
        wins (Flower's ids are random, so no claimant is favoured by the order it answered in).
        """
        if self.num_partitions is None:
            pool = [p.num_partitions for p in admitted.values() if p.fl_geo_client] or \
                   [p.num_partitions for p in candidates.values()]
            if pool:
                counts = Counter(pool)
                self.num_partitions = min(counts, key=lambda n: (-counts[n], n))
        live_set = set(live)
        holders = {p.partition_id: n for n, p in admitted.items() if n in live_set}
        out: dict[int, NodeProfile] = {}
        for node in sorted(candidates):
            prof = candidates[node]
            if prof.num_partitions != self.num_partitions:
                self.refuse(node, f"claims num-partitions={prof.num_partitions}, the run's nodes have "
                                  f"{self.num_partitions}")
            elif self.slots is not None and prof.partition_id >= self.slots:
                self.refuse(node, f"claims partition-id {prof.partition_id}, the scenario has {self.slots} node slots")
            elif prof.partition_id in holders:
                self.refuse(node, f"claims partition-id {prof.partition_id}, held by live node "
                                  f"{holders[prof.partition_id]}", retry=True)
            else:
                holders[prof.partition_id] = node
                self._retry_at.pop(node, None)
                out[node] = prof
        return out
