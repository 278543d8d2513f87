"""Who this node is: fl-geo's answer to the profile query, one contract for every fl-geo ClientApp.

The server asks with a ``query`` message (``clients="fl-geo"``, the CLI path) or, where it does not
know whether a node runs a plain Flower ClientApp (``clients="auto"``), with the *profile probe*:
a ``train`` message that carries the `ProfileQuery` next to a first job's model and config
(fl_geo.runtime.profiling). `profile_probe_mod` answers the probe before any train handler sees it,
so a ClientApp's own train handler never has to tell a probe from a job.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict

from fl_geo.inner.device import pick_device
from fl_geo.runtime import protocol


def partition_ids(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of the node; a KeyError that says how to set them."""
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise KeyError(
            "node_config needs 'partition-id' and 'num-partitions' "
            "(simulation sets them; a SuperNode takes --node-config 'partition-id=0 num-partitions=4')"
        )
    return int(nc["partition-id"]), int(nc["num-partitions"])


def first_device(setting: str) -> str:
    """A node's ``device`` may list the devices of a data-parallel site (``"cuda:0,cuda:2"``,
    fl_geo.inner.distributed); a handler that uses one device takes the first."""
    return setting.split(",", 1)[0].strip()


def profile_reply(msg: Message, context: Context) -> Message:
    """Tell the server who we are: partition, device, site (and the site's own device count);
    NodeInfo carries no node_config. The request is validated first (`ProfileQuery`: protocol
    version, fields); a bad one raises `ProtocolError`, which Flower turns into an error reply."""
    protocol.ProfileQuery.in_message(msg)
    pid, nparts = partition_ids(context)
    device = str(context.node_config.get("device", "auto"))
    profile = ConfigRecord(
        {
            "partition_id": pid,
            "num_partitions": nparts,
            "device": str(pick_device(first_device(device))),
            "site": str(context.node_config.get("site", f"dc{pid}")),
        }
    )
    if "devices" in context.node_config:  # a site's own rank count overrides client.devices x client.nodes
        profile["devices"] = int(context.node_config["devices"]) * int(context.node_config.get("nodes", 1))
    decl = protocol.ReplyDeclaration(payload="none", precision="fp32").to_record()
    return Message(RecordDict({protocol.PROFILE_KEY: profile, protocol.REQUEST_RECORD: decl}), reply_to=msg)


def profile_probe_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: answer the profile probe (`protocol.is_profile_probe`) with the profile,
    training nothing; every other message passes through."""
    if protocol.is_profile_probe(msg):
        return profile_reply(msg, context)
    return call_next(msg, context)
