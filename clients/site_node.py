"""The agent of a site's node k > 0: starts and ends this node's ranks of the site's persistent group.

A site of several nodes (node config ``nodes`` > 1, docs/multidevice.md) runs its SuperNode and
its site-group daemon (`fl_geo.clients.site_daemon`) on node 0. Every other node runs this agent
for as long as the site exists::

    python -m fl_geo.clients.site_node --rendezvous 10.0.0.5:29400 --node-rank 1 --devices cuda:0,cuda:1

It connects to the site's TCP store at node 0 (`fl_geo.inner.site_store`; it waits, retrying, while
node 0 is not up, and reconnects when node 0's daemon is replaced), refreshes its heartbeat there,
and follows the daemon's ``generation``: for every new generation it ends the ranks it has and starts
``local`` new ones (global ranks ``k·local …``) on ``--devices``, with the backend, threads and
timeout the daemon published; when the generation is withdrawn (a failed job, the daemon stopping)
it ends them. The ranks (`fl_geo.inner.site_rank.rank_loop`) read their jobs from the store and
receive the model from rank 0 by broadcast. A node whose device count differs from node 0's
reports it (``node/<k>/error``), and the daemon fails the job with that message.

The ranks unpickle the jobs' model and data factories: run the agent where the same code is
importable (the same environment and ``PYTHONPATH`` as node 0's SuperNode). Importable without
Flower; imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from fl_geo.clients.site_daemon import _describe_exit

__all__ = ["SiteNodeAgent", "main"]

_RECONNECT_S = 1.0


class SiteNodeAgent:
    """Node ``node_rank``'s side of the site group: heartbeat, and this node's ranks per generation."""

    def __init__(self, rendezvous: str, node_rank: int, devices: Sequence[str]) -> None:
        from fl_geo.inner.site_store import parse_rendezvous

        parse_rendezvous(rendezvous)  # a bad address fails here, once
        if node_rank < 1:
            raise ValueError(f"--node-rank must be >= 1 (node 0 runs the SuperNode and the daemon), got {node_rank}")
        if not devices:
            raise ValueError("--devices must name at least one device")
        self.rendezvous, self.node_rank, self.devices = rendezvous, int(node_rank), [str(d) for d in devices]
        self.procs: list[Any] = []
        self.reported: set[int] = set()  # local ranks of this generation whose death was reported
        self.generation = ""
        self.stopping = False

    def end_ranks(self) -> None:
        """SIGTERM this node's ranks, SIGKILL what is left after 1 s, reap them."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []
        self.reported = set()

    def _start_ranks(self, store: Any, generation: str) -> None:
        from fl_geo.fork_server import process_context
        from fl_geo.inner.site_setup import GroupSetup, rank_entry
        from fl_geo.inner.site_store import get_text

        setup = json.loads(get_text(store, f"{generation}/setup", "{}") or "{}")
        local, nodes = int(setup.get("local", 0)), int(setup.get("nodes", 0))
        if local != len(self.devices) or not 0 < self.node_rank < nodes:
            why = (f"node {self.node_rank} has {len(self.devices)} devices, node 0 runs {local} ranks"
                   if local != len(self.devices) else f"--node-rank {self.node_rank} is not in 1..{nodes - 1}")
            store.set(f"node/{self.node_rank}/error", f"{generation}: {why}")
            print(f"site node {self.node_rank}: cannot join generation {generation}: {why}", flush=True)
            return
        group = GroupSetup(devices=tuple(self.devices), backend=str(setup["backend"]), store_path="",
                           timeout_s=float(setup["timeout_s"]), threads=int(setup["threads"]),
                           rank_offset=self.node_rank * local, world=int(setup["world"]),
                           rendezvous=self.rendezvous, generation=generation, owner_pid=os.getpid())
        ctx = process_context()  # a fork server: torch imported once per node, not per rank
        for rank in range(local):
            proc = ctx.Process(target=rank_entry, args=(rank, group, None), name=f"fl-geo-site-node{self.node_rank}-rank-{rank}")
            proc.start()
            self.procs.append(proc)
        print(f"site node {self.node_rank}: generation {generation}: started global ranks "
              f"{group.rank_offset}..{group.rank_offset + local - 1} of {group.world}", flush=True)

    def report_dead_ranks(self, store: Any) -> None:
        """Tell node 0 (``node/<k>/error``) which of this generation's ranks died, once: the job's
        error then names the rank that died, not only node 0's rank whose collective broke."""
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs)
                if not p.is_alive() and p.exitcode not in (None, 0) and r not in self.reported]
        if not dead or not self.generation:
            return
        local = len(self.devices)
        why = "; ".join(f"rank {self.node_rank * local + r} died: it {_describe_exit(code)}" for r, code in dead)
        store.set(f"node/{self.node_rank}/error", f"{self.generation}: {why}")
        self.reported.update(r for r, _ in dead)

    def follow(self, store: Any) -> None:
        """Heartbeat and follow the generations until the store fails or the agent is stopped."""
        from fl_geo.inner.site_store import HEARTBEAT_S, get_text

        while not self.stopping:
            store.add(f"node/{self.node_rank}/heartbeat", 1)  # a counter: no clocks compared across nodes
            self.report_dead_ranks(store)
            generation = get_text(store, "generation")
            if generation != self.generation:
                self.end_ranks()
                self.generation = generation
                if generation:
                    self._start_ranks(store, generation)
            time.sleep(HEARTBEAT_S)

    def serve(self) -> None:
        """Connect (and reconnect) to node 0's store and follow it until SIGTERM/SIGINT."""
        from fl_geo.inner.site_store import connect

        waiting = False
        try:
            while not self.stopping:
                try:
                    store = connect(self.rendezvous, timeout_s=max(_RECONNECT_S, 5.0))
                except Exception:  # noqa: BLE001 - node 0 not up (yet, or again): retry
                    if not waiting:
                        print(f"site node {self.node_rank}: waiting for node 0 at {self.rendezvous}", flush=True)
                        waiting = True
                    time.sleep(_RECONNECT_S)
                    continue
                waiting = False
                print(f"site node {self.node_rank}: joined the site at {self.rendezvous}", flush=True)
                try:
                    self.follow(store)
                except Exception as exc:  # noqa: BLE001 - node 0's daemon went away: end our ranks, reconnect
                    print(f"site node {self.node_rank}: lost node 0 ({type(exc).__name__}); reconnecting", flush=True)
                    self.end_ranks()
                    self.generation = ""
        finally:
            self.end_ranks()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_geo.clients.site_node",
                                     description="a site's node k > 0: runs its ranks of the site group (docs/multidevice.md)")
    parser.add_argument("--rendezvous", required=True, help="host:port of the site's store (node 0's site-rendezvous)")
    parser.add_argument("--node-rank", type=int, required=True, help="this node's index in the site, 1..nodes-1")
    parser.add_argument("--devices", required=True, help="comma-separated devices, one rank each (cpu,cpu or cuda:0,cuda:1)")
    args = parser.parse_args(argv)
    try:
        agent = SiteNodeAgent(args.rendezvous, args.node_rank, args.devices.split(","))
    except ValueError as exc:
        parser.error(str(exc))

    def _stop(signum: int, frame: object) -> None:
        agent.stopping = True
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with contextlib.suppress(SystemExit):
        agent.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
