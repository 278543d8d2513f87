"""The rendezvous of a site that spans several nodes: one TCP key-value store, hosted by node 0.

A persistent site group (`fl_geo.clients.site_daemon`) whose ranks live on one node talks to them
over pipes and shares the model with them through files on ``/dev/shm``. A site of several nodes
(node config ``nodes`` > 1) cannot: the other nodes' ranks are not the daemon's children and do
not see its files. They meet in a ``torch.distributed.TCPStore`` that the daemon on node 0 hosts
at the node config ``site-rendezvous`` address for its whole life, the store ``torchrun
--rdzv-backend c10d`` uses. In it, per *generation* of the group (a fresh set of ranks after a
failure; the id is unique per daemon, so a restarted daemon never matches an old one):

- ``generation``: the current generation id, ``""`` when the group is down (the other nodes' agents,
  `fl_geo.clients.site_node`, start and end their ranks by it);
- ``<gen>/setup``: JSON ``{world, local, backend, timeout_s, threads}`` (every node runs ``local``
  ranks; node k's are global ranks ``k·local … k·local + local − 1``);
- ``<gen>/pg/...``: the process group's own rendezvous (``init_process_group(store=...)``);
- ``<gen>/job/<n>`` and ``<gen>/answer/<n>/<rank>``: the n-th job's pickled bytes (as the daemon
  forwards them unread over its pipes) and each remote rank's JSON answer (`StoreJobs`);
- ``node/<k>/heartbeat``: a counter node k's agent adds 1 to every `HEARTBEAT_S`; a node whose
  counter has not moved for `STALE_S` (by the daemon's clock: no clocks are compared across
  nodes) is reported as gone instead of being waited for;
- ``node/<k>/error``: why node k's agent cannot serve the current generation (its device count).

Nothing model-sized goes through the store: the ranks receive θ and the optimizer state from rank 0
by broadcast at the start of every job (`fl_geo.inner.site_rank`). Trust: the store has no
authentication, like torchrun's; bind it to the site's private network. Importable without Flower.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["HEARTBEAT_S", "STALE_S", "StoreJobs", "connect", "get_text", "host_store", "parse_rendezvous"]

HEARTBEAT_S = 1.0  # an agent refreshes node/<k>/heartbeat this often
STALE_S = 15.0  # a heartbeat older than this: the node is gone
_POLL_S = 0.02  # a remote rank polls for its next job this often (a key check is one round trip)


def parse_rendezvous(address: str) -> tuple[str, int]:
    """``host:port`` (``tcp://`` optional) as (host, port); ValueError naming the address otherwise."""
    text = address.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"site-rendezvous must be host:port (e.g. 10.0.0.5:29400), got {address!r}")
    return host.strip("[]"), int(port)


def host_store(address: str, timeout_s: float) -> dist.TCPStore:
    """The site's store, served by this process (node 0's daemon) at ``address``."""
    host, port = parse_rendezvous(address)
    return dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the site's store at ``address``; raises when nobody serves it within ``timeout_s``."""
    host, port = parse_rendezvous(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def get_text(store: dist.Store, key: str, default: str = "") -> str:
    """``store[key]`` as text, ``default`` when the key is absent (never blocks)."""
    return store.get(key).decode() if store.check([key]) else default


class StoreJobs:
    """A remote rank's job channel, with the pipe's interface `fl_geo.inner.site_rank.rank_loop` reads.

    ``recv_bytes`` waits for ``<gen>/job/<n>`` (the daemon sets it for every remote rank at once)
    and returns it; ``send_bytes`` posts this rank's answer to that job. Jobs are numbered from 0
    within a generation, so a rank started for a generation reads exactly that generation's jobs.
    """

    def __init__(self, store: dist.Store, generation: str, rank: int) -> None:
        self.store, self.generation, self.rank = store, generation, rank
        self.job = -1

    def recv_bytes(self) -> bytes:
        self.job += 1
        key = f"{self.generation}/job/{self.job}"
        while not self.store.check([key]):
            if get_text(self.store, "generation") != self.generation:
                return b""  # the group was ended: leave the loop
            time.sleep(_POLL_S)
        return self.store.get(key)

    def send_bytes(self, data: bytes) -> None:
        self.store.set(f"{self.generation}/answer/{self.job}/{self.rank}", data)
