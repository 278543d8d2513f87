"""The HALoS bridge ClientApp: a region's SuperNode on the global SuperLink.

The global ServerApp (the GPS, `fl_geo.halos.apps.global_app`) cannot reach a regional
ServerApp through Flower (a SuperNode connects to one SuperLink and a process cannot be a
ServerApp and a ClientApp task at once, docs/flower.md "Two tiers (HALoS) on Flower"). So each region runs one
bridge SuperNode on the global SuperLink, started with

    --node-config 'lps-address="unix:///run/fl-geo/region0.sock" region="eu" region-id=0 num-regions=2'

and for every global ``train`` message this ClientApp hands the global model to the co-located
LPS over its Unix socket (`fl_geo.halos.ipc`) and returns the LPS's next update. The payload
bytes pass through untouched (validated by the receivers against their model spec), so the
bridge needs neither torch nor the model: a message costs a socket round trip plus the wait for
the LPS, not a torch import.

Message ``config`` keys (set by the GPS): ``stop`` (bool: deliver θ_g, then end the regional
run), ``global_version``, ``resync`` (bool: a resumed GPS's first θ_g, `BridgeRequest`),
``connect_timeout_s``, ``exchange_timeout_s``.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.halos.ipc import exchange
from fl_geo.runtime.protocol import PROFILE_KEY, BridgeRequest

app = ClientApp()

# Counters an LPS reports with each update (copied into the reply's metrics).
LPS_COUNTERS = ("lps_version", "sends", "merges", "local_updates", "tokens")


def _node(context: Context, key: str) -> str:
    value = context.node_config.get(key)
    if value is None or str(value) == "":
        raise KeyError(f"bridge SuperNode needs node_config {key!r} (e.g. --node-config "
                       "'lps-address=\"unix:///tmp/fl-geo/region0.sock\" region=\"r0\" region-id=0 num-regions=2')")
    return str(value)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Tell the GPS which region this bridge serves (NodeInfo carries no node_config): the
    standard profile record, with the region index as ``partition_id``."""
    profile = ConfigRecord({
        "partition_id": int(_node(context, "region-id")),
        "num_partitions": int(_node(context, "num-regions")),
        "device": "cpu",
        "site": _node(context, "region"),
    })
    return Message(RecordDict({PROFILE_KEY: profile}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Deliver θ_g (if the message has one) to the LPS and reply with its next update U_k.

    Any IPC failure raises, so the GPS receives an error reply naming the address and cause.
    """
    request = BridgeRequest.in_message(msg)
    address = _node(context, "lps-address")
    header = {"op": "exchange", "stop": request.stop, "global_version": request.global_version,
              "resync": request.resync, "region": _node(context, "region")}
    record = msg.content.array_records.get("arrays")
    reply, update = exchange(address, header, record, connect_timeout_s=request.connect_timeout_s,
                             reply_timeout_s=request.exchange_timeout_s)
    stop = request.stop
    metrics = {k: int(reply[k]) for k in LPS_COUNTERS if isinstance(reply.get(k), int)}
    content = RecordDict({"metrics": MetricRecord({**metrics, "stopped": int(stop)})})
    if update is not None:
        content["arrays"] = update
    return Message(content, reply_to=msg)
