"""Where ``fl-geo run``'s Flower simulation gets its Ray from: its own local Ray, or a cluster.

``run.ray_address`` "" lets Flower start a local Ray sized by ``run.sim_cpus`` and stop it when the
run ends (the default). "auto" joins the cluster this machine is part of (``ray start`` wrote its
address), HOST:PORT a head node's GCS address. Flower's Ray backend hands the ``init_args`` of its
backend config to ``ray.init`` unchanged, so the address goes there; ``ray.init`` refuses
``num_cpus`` when it connects to a running cluster, so a cluster's own CPUs replace ``sim_cpus``.
Each ClientApp actor reserves ``run.client_cpus`` CPUs and ``run.client_gpus`` GPUs: Flower starts
as many actors as the cluster's resources allow.

A wrong address would otherwise surface as a Ray connection traceback (after a minute of retries)
from inside Flower, so `check_reachable` probes the head's TCP port first: one line, in seconds.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from fl_geo.errors import ConfigError

__all__ = ["backend_config", "check_ray_section", "check_reachable", "parse_host_port", "resolve_auto"]

PROBE_TIMEOUT_S = 3.0
# Where `ray start` records the address of the cluster this machine joined (what ray.init("auto")
# reads when RAY_ADDRESS is unset).
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")


def parse_host_port(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"`` for IPv6) as ``(host, port)``; ValueError if malformed."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"'{address}' is not HOST:PORT with a port in 1..65535")
    if "://" in address:
        raise ValueError(f"'{address}': give the head's HOST:PORT (GCS port, 6379 by default), no scheme")
    return host, int(port)


def check_ray_section(run: Any) -> None:
    """Validate ``run.ray_address`` / ``client_cpus`` / ``client_gpus``; ConfigError naming the field.

    Called by ``fl_geo.config.validate`` (no network: reachability is `check_reachable`'s job, just
    before the run, because a config may be validated on another machine than the one that runs it).
    """
    address = str(run.ray_address).strip()
    if address and address != "auto":
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise ConfigError(f"run.ray_address: {exc}; use \"\" (a local Ray), auto or HOST:PORT") from None
    if address and run.backend != "ray":
        raise ConfigError(f"run.ray_address={address} needs run.backend=ray (got '{run.backend}')")
    if not float(run.client_cpus) > 0:
        raise ConfigError(f"run.client_cpus must be > 0, got {run.client_cpus}")
    if not float(run.client_gpus) >= 0:
        raise ConfigError(f"run.client_gpus must be >= 0, got {run.client_gpus}")
    if not address and float(run.client_cpus) > run.sim_cpus:
        raise ConfigError(f"run.client_cpus={run.client_cpus} exceeds run.sim_cpus={run.sim_cpus}: "
                          "the local Ray could not start a single client")


def resolve_auto() -> str:
    """The HOST:PORT that ``ray.init(address="auto")`` would join: ``RAY_ADDRESS``, else the
    address ``ray start`` recorded on this machine; ConfigError if there is neither."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env
    try:
        recorded = RAY_CURRENT_CLUSTER.read_text().strip()
    except OSError:
        recorded = ""
    if not recorded:
        raise ConfigError("run.ray_address=auto: this machine has joined no Ray cluster (no RAY_ADDRESS, no "
                          f"{RAY_CURRENT_CLUSTER}); start one with `ray start --head` or give HOST:PORT")
    return recorded


def check_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """One TCP connection to the cluster's head before Flower starts; ConfigError if refused or
    silent for ``timeout_s``. "" (a local Ray) needs no probe."""
    address = address.strip()
    if not address:
        return
    target = resolve_auto() if address == "auto" else address
    try:
        host, port = parse_host_port(target)
    except ValueError as exc:
        raise ConfigError(f"run.ray_address={address}: {exc}") from None
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError | socket.timeout) else (exc.strerror or str(exc))
        raise ConfigError(f"run.ray_address={address}: no Ray head answers at {host}:{port} ({reason}); "
                          "is `ray start --head --port PORT` running there and the port open?") from None


def backend_config(run: Any) -> dict[str, Any]:
    """Flower's Ray backend config for the run section ``run``.

    Local Ray: a new instance (``address="local"``) of ``sim_cpus`` CPUs, no dashboard. Cluster: only the address (ray.init rejects sizing
    arguments for a running cluster). Both: each actor reserves ``client_cpus`` / ``client_gpus``.
    """
    address = str(run.ray_address).strip()
    init_args: dict[str, Any] = {"include_dashboard": False}
    if address:
        init_args["address"] = address
    else:
        # "local": a new Ray even when this machine has joined a cluster (a plain ray.init() would
        # join the one `ray start` recorded, or RAY_ADDRESS's, and then refuse num_cpus)
        init_args["address"] = "local"
        init_args["num_cpus"] = run.sim_cpus
    return {
        "init_args": init_args,
        "client_resources": {"num_cpus": _number(run.client_cpus), "num_gpus": float(run.client_gpus)},
    }


def _number(value: Any) -> int | float:
    """A whole number as an int (Ray's resource arithmetic is exact for those), else a float."""
    value = float(value)
    return int(value) if value.is_integer() else value
