"""The two questions a launcher keeps asking a SuperLink, asked through Flower's Control API in
this process: the state of one run, and the node table.

Why not the ``flwr`` CLI: every ``flwr ls`` or ``flwr supernode ls`` is a new Python process
that imports the whole Flower CLI, about 1.2 s of CPU, to send one small request. A launcher
waiting for a run, or for its SuperNodes to come online, asks every few seconds, so on the host
that also runs the ServerApp the questions alone took a noticeable share of a core (and of the
test suite: about 120 such processes per run). Here the same request is one HTTP call on
Flower's own Control API client (`flwr.supercore.control.ControlHttpClient`, the client the CLI
uses), with the TLS trust root the topology already configures for the CLI.

What stays the CLI's: submitting, stopping and logging runs, registering node keys, and any
SuperLink that needs a Flower account login (an account-auth interceptor and its tokens live in
the CLI). Every answer falls back to the CLI when this client cannot be built (another Flower
version) or the call fails, so a question is never lost: the CLI's answer, with its error
message, is the reference. The answers have the CLI's JSON shape (``status`` strings such as
``finished:completed``; node dicts with ``node-id``, ``owner-name``, ``status``), so callers do
not know which path answered.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fl_geo.deploy.topology import Topology

__all__ = ["ControlUnavailable", "query_nodes", "query_run_status"]

log = logging.getLogger("fl_geo")

_CLIENT_TIMEOUT_S = 30.0


class ControlUnavailable(RuntimeError):
    """This process could not ask the Control API (no client for this Flower version, a
    refused or failed call): the caller asks the ``flwr`` CLI instead."""


class _VersionHeaders:
    """Attach Flower's runtime-version headers, as the CLI does, without the CLI's reaction to
    an incompatible SuperLink (it exits the process): that answer becomes an error here, and
    the CLI fallback reports it in its own words."""

    def __init__(self) -> None:
        from flwr.supercore.runtime_version_compatibility import RuntimeVersionMetadata

        self.headers = dict(RuntimeVersionMetadata.from_local_component("flwr CLI").as_metadata())

    def intercept(self, context: Any, call_next: Any) -> Any:
        context.request.headers.update(self.headers)
        return call_next(context)


def _client(topo: Topology) -> Any:
    try:
        from flwr.supercore.control import ControlHttpClient
    except ImportError as exc:
        raise ControlUnavailable(f"this Flower has no Control API client ({exc})") from None
    tls = topo.security.tls
    try:
        root = topo.certs.ca_cert.read_bytes() if tls else None
        return ControlHttpClient.from_server_address(server_address=topo.address, insecure=not tls,
                                                     root_certificates=root, interceptors=[_VersionHeaders()])
    except Exception as exc:  # noqa: BLE001 - any failure to build it means: ask the CLI
        raise ControlUnavailable(f"cannot build a Control API client: {exc}"[:300]) from None


def _call(topo: Topology, method: str, request: Any) -> Any:
    client = _client(topo)
    try:
        return getattr(client, method)(request)
    except Exception as exc:  # noqa: BLE001 - refused, unreachable, another protocol: ask the CLI
        raise ControlUnavailable(f"Control API {method} failed: {exc}"[:300]) from None
    finally:
        client.close()


def query_run_status(topo: Topology, run_id: int) -> tuple[str, str]:
    """(status, details) of run ``run_id`` as ``flwr ls --run-id`` reports them: the status
    joined with its sub-status (``running``, ``finished:completed``), details ``N/A`` when
    Flower gave none. `ControlUnavailable` when the question could not be asked here, or the
    SuperLink does not know the run (the CLI's answer then carries the reason)."""
    from flwr.proto.control_pb2 import ListRunsRequest

    res = _call(topo, "ListRuns", ListRunsRequest(run_id=run_id))
    run = res.run_dict.get(run_id)
    if run is None:
        raise ControlUnavailable(f"the SuperLink lists no run {run_id}")
    status, sub = run.status.status, run.status.sub_status
    return (f"{status}:{sub}" if sub else status), (run.status.details or "N/A")


def query_nodes(topo: Topology) -> list[dict[str, Any]]:
    """The SuperLink's nodes, not the deleted ones, as ``flwr supernode ls --format json`` lists
    them, oldest registration first (``node-id`` as a string, ``owner-name``, ``status``: online, offline, registered).
    `ControlUnavailable` when the question could not be asked here."""
    from flwr.proto.control_pb2 import ListNodesRequest

    res = _call(topo, "ListNodes", ListNodesRequest())
    return [{"node-id": str(n.node_id), "owner-name": n.owner_name, "status": n.status}
            for n in sorted(res.nodes_info, key=lambda n: n.registered_at) if n.status != "deleted"]
