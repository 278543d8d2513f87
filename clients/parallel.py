"""The trainer of a multi-device site's ``train`` job: spawned per message, or the node's site group.

``client.devices`` (or node config ``devices``) > 1 runs the inner loop as a data-parallel job
(docs/multidevice.md). By default the ClientApp spawns the ranks for this message
(`DataParallelTrainer`); a node whose config names a site group (``site-group="unix:///..."``)
hands the job to its persistent ranks instead (`SiteGroupTrainer`, fl_geo.clients.site_group).
Both give the handler the same interface and the same numbers; the group's trainer holds the
node's group lock until the handler calls ``release``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fl_geo.clients.site import Site, as_batch_source
from fl_geo.inner.distributed import DataParallelTrainer, resolve_devices, spec_of
from fl_geo.inner.training import BatchSource

if TYPE_CHECKING:
    from fl_geo.clients.api import DatacenterClient
    from fl_geo.runtime import protocol

__all__ = ["SITE_GROUP_KEY", "SITE_RENDEZVOUS_KEY", "parallel_trainer", "release", "site_nodes"]

SITE_GROUP_KEY = "site-group"  # node config: the address of the node's site-group daemon
SITE_GROUP_IDLE_KEY = "site-group-idle-s"  # node config: the daemon exits after this long unused
SITE_RENDEZVOUS_KEY = "site-rendezvous"  # node config: host:port of a multi-node site's store, on node 0


def site_nodes(site: Site) -> int:
    """Nodes of this site: node config ``nodes`` (a site knows its hardware), else ``client.nodes``, else 1."""
    return int(site.node_config.get("nodes", site.sections["client"].get("nodes", 1)))


def user_source(batches_fn: Any, site: Site) -> BatchSource:
    """``batches_fn(site)`` as a `BatchSource`: what every rank of a site group calls for its data."""
    return as_batch_source(batches_fn(site))


def _qualname(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # a functools.partial: its function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def parallel_trainer(client: DatacenterClient, req: protocol.TrainRequest, site: Site,
                     count: int) -> DataParallelTrainer | Any:
    """The trainer of a ``count``-rank job for this message (its ``params`` not yet filled).

    The devices are checked here, on the site's own machine (the server that validated the
    config may have no GPU). A site group is identified by the run, the model (`Site.model_key`
    and the user's model and data functions) and the ranks' devices, backend and threads: a
    daemon started for anything else is replaced, never reused.
    """
    if client.optimizer_fn is not None:
        raise ValueError("client.devices > 1 runs the default inner optimizer (client.optimizer) only "
                         "(its state lives in the job's shared buffers); drop optimizer_fn")
    parallel = str(site.sections["client"].get("parallel", "ddp"))  # an older client section: ddp
    address = str(site.node_config.get(SITE_GROUP_KEY, "") or "")
    nodes = site_nodes(site)
    if nodes > 1 and not address:
        # The other nodes' ranks must outlive the message: only the persistent group has them.
        raise ValueError(f"a site of {nodes} nodes (client.nodes / node config nodes) runs in the node's "
                         "persistent site group: set node config site-group and site-rendezvous on node 0")
    if site.inner.optimizer != "adamw" and (address or parallel == "fsdp"):
        # The site group's shared files and the FSDP ranks hold AdamW's state layout only; the
        # spawned DDP job (no site group) also shares Muon's (fl_geo.inner.muon).
        raise ValueError(f"client.optimizer={site.inner.optimizer} runs in the spawned DDP job only, not "
                         f"{'the site group' if address else 'client.parallel=fsdp'}; use client.optimizer=adamw there")
    device = str(site.node_config.get("device", site.inner.device))
    devices, backend = resolve_devices(device, count, str(site.sections["client"].get("dist_backend", "auto")))
    factory = functools.partial(client.model_fn, site)
    spec = spec_of(factory)
    options = {"loss_fn": client.loss_fn, "lr_schedule": client.lr_schedule, "tokens_fn": client.tokens_fn,
               "parallel": parallel}
    if not address:
        return DataParallelTrainer(factory, site.inner, spec, devices, backend, threads=req.threads, **options)
    from fl_geo.clients.site_group import DEFAULT_IDLE_S, SiteGroup, SiteGroupTrainer

    identity = {"run": req.run_name, "model": site.model_key(), "model_fn": _qualname(client.model_fn),
                "batches_fn": _qualname(client.batches_fn), "partition": site.partition_id, "parallel": parallel}
    idle = float(site.node_config.get(SITE_GROUP_IDLE_KEY, DEFAULT_IDLE_S))
    group = SiteGroup(address, identity, devices, backend, threads=req.threads, idle_s=idle, nodes=nodes,
                      rendezvous=str(site.node_config.get(SITE_RENDEZVOUS_KEY, "") or ""))
    return SiteGroupTrainer(group, factory, site.inner, spec,
                            batches=functools.partial(user_source, client.batches_fn, site), **options)


def release(trainer: Any) -> None:
    """Let the node's next job use its site group (a no-op for other trainers)."""
    done = getattr(trainer, "release", None)
    if done is not None:
        done()
