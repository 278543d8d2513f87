"""What starts a persistent site group's rank, without torch (`fl_geo.inner.site_rank` is the rank).

The site-group daemon (`fl_geo.clients.site_daemon`) and a node's agent (`fl_geo.clients.site_node`)
start ranks; the ranks train. The starting process needs only the rank's settings and an entry
point to hand to the process it starts, both here, so a one-node daemon never imports torch: the
ranks come from a fork server that imported it once (`fl_geo.fork_server`), and the
daemon stays a small process (no torch import, about 2.5 CPU-seconds and a few hundred MB less).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection

__all__ = ["GroupSetup", "rank_entry"]


@dataclass(frozen=True)
class GroupSetup:
    """What a rank needs for its whole life (pickled once, when the daemon starts it)."""

    devices: tuple[str, ...]  # this node's ranks
    backend: str
    store_path: str  # one node: the FileStore of this generation of the group ("" on several nodes)
    timeout_s: float  # every collective; bounds a peer that hangs without dying
    threads: int
    rank_offset: int = 0  # global rank of this node's first rank (node k: k x len(devices))
    world: int = 0  # ranks of the whole site; 0 = len(devices) (one node)
    rendezvous: str = ""  # several nodes: host:port of the site's TCP store (fl_geo.inner.site_store)
    generation: str = ""  # several nodes: this generation's id in that store
    # The process that started the ranks (the daemon, or a node's agent): a rank ends when it does,
    # also mid-collective (its parent is the fork server, which outlives it: fork_server.die_with).
    owner_pid: int = 0

    @property
    def world_size(self) -> int:
        return self.world or len(self.devices)

    @property
    def has_files(self) -> bool:
        """Whether this node's ranks map the coordinator's state files (node 0 only)."""
        return self.rank_offset == 0


def rank_entry(rank: int, setup: GroupSetup, conn: Connection | None) -> None:
    """A rank process's target: `fl_geo.inner.site_rank.rank_loop`, imported in the rank."""
    from fl_geo.inner.site_rank import rank_loop

    rank_loop(rank, setup, conn)
