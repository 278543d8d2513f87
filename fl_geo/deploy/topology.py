"""The deployment topology: one SuperLink, its security, and the SuperNodes with their node config.

:func:`load_topology` reads a YAML file (``configs/deploy/*.yaml``) describing the SuperLink (address,
bind, port), its security (TLS, SuperNode authentication, certificate directory) and the nodes
with their ``node_config`` (partition, site, region, device), and validates every key with an
error that names it. `DeployError`, raised by every step of a deployment, lives here, at the
bottom of the package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_geo.deploy.warm_apps import supported as warm_apps_supported
from fl_geo.hosts import is_loopback
from fl_geo.inner.choices import DEVICE_KINDS

__all__ = [
    "CertPaths",
    "DeployError",
    "NodeSpec",
    "Security",
    "Topology",
    "find_project_root",
    "is_loopback",
    "load_topology",
    "parse_topology",
    "read_topology_file",
]


# The Flower app and the SuperLink/SuperNode must run in this interpreter's environment: with
# runtime dependency installation on, Flower would `uv sync` a fresh env per app and fetch
# CUDA torch wheels from the internet.
NO_DEPS_ENV = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
NODE_CONFIG_KEYS = ("partition-id", "num-partitions", "site", "region", "device")
# Optional: where the site keeps its inner optimizer state across a restarted ServerApp
# (clients/persist.py); a relative path is resolved like the topology's other paths.
NODE_CONFIG_OPTIONAL = ("state-dir",)
DEFAULT_GRACE_S = 10.0


class DeployError(RuntimeError):
    """A deployment step failed; the message names the file, key or log to look at."""


@dataclass(frozen=True)
class CertPaths:
    """Where :func:`generate_certs` puts each file (the SuperLink needs the first four)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    @property
    def public_keys(self) -> Path:
        """All SuperNode public keys, one per line (OpenSSH format, node name as comment)."""
        return self.root / "supernodes.pub"

    def node_private_key(self, node: str) -> Path:
        return self.root / "supernodes" / f"{node}.key"

    def node_public_key(self, node: str) -> Path:
        return self.root / "supernodes" / f"{node}.pub"


# ---------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Security:
    """Transport security of a topology: TLS for every connection, SuperNode authentication."""

    tls: bool
    auth: bool
    certs_dir: Path
    allow_insecure_remote: bool = False


@dataclass(frozen=True)
class SiteNodeSpec:
    """Node ``node_rank`` > 0 of a site that spans nodes: its ``fl-geo site-node`` agent, started by
    ``up`` on this host beside the site's SuperNode (docs/multidevice.md; across machines, run the
    same command on each machine instead)."""

    node_rank: int
    devices: str  # comma-separated, one rank each


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode (one site): its Runtime API port on its host and its ``node_config``; a site
    of several nodes also lists its other nodes (``site_nodes``)."""

    name: str
    port: int
    node_config: dict[str, str | int]
    site_nodes: tuple[SiteNodeSpec, ...] = ()

    def node_config_arg(self) -> str:
        """The ``--node-config`` string Flower parses (TOML values: strings quoted)."""
        parts = []
        for key, value in self.node_config.items():
            parts.append(f"{key}={value}" if isinstance(value, int) else f'{key}="{value}"')
        return " ".join(parts)


@dataclass(frozen=True)
class Topology:
    """A validated deployment topology (see ``configs/deploy/loopback.yaml``)."""

    name: str
    source: str
    app_dir: Path
    host: str  # the address SuperNodes and the flwr CLI dial
    bind: str  # what flower-superlink --host binds
    port: int
    flwr_home: Path
    state_dir: Path
    security: Security
    nodes: tuple[NodeSpec, ...]
    # Fork Flower's per-message app processes from an app server that has imported torch and
    # Flower once (fl_geo/deploy/warm_apps.py); off: Flower starts each one fresh.
    warm_apps: bool = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pids_path(self) -> Path:
        return self.state_dir / "pids.json"

    @property
    def app_shims_dir(self) -> Path:
        """Where ``up`` writes the ``flwr-clientapp`` / ``flwr-serverapp`` shims (first on PATH)."""
        return self.state_dir / "app-shims"

    @property
    def certs(self) -> CertPaths:
        return CertPaths(self.security.certs_dir)

    def cert_hosts(self) -> list[str]:
        """Names the server certificate must cover: the dialled address plus the loopback names."""
        hosts = [self.host]
        for extra in ("127.0.0.1", "localhost"):
            if extra not in hosts:
                hosts.append(extra)
        return hosts


_TOP_KEYS = {"name", "superlink", "flwr_home", "state_dir", "app_dir", "security", "nodes", "warm_apps"}
_SUPERLINK_KEYS = {"host", "port", "bind"}
_SECURITY_KEYS = {"tls", "auth", "certs_dir", "allow_insecure_remote"}
_NODE_KEYS = {"name", "port", "node_config", "extra_node_config", "site_nodes"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _check_keys(where: str, data: Any, allowed: set[str], required: Iterable[str] = ()) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise DeployError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise DeployError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(allowed))}")
    missing = [k for k in required if k not in data]
    if missing:
        raise DeployError(f"{where}: missing required key(s) {', '.join(missing)}")
    return dict(data)


def _port(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise DeployError(f"{where}: must be a port number 1-65535, got {value!r}")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DeployError(f"{where}: must be true or false, got {value!r}")
    return value


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DeployError(f"{where}: must be a non-empty string, got {value!r}")
    return value.strip()


def find_project_root(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` with a ``pyproject.toml`` (the Flower app)."""
    for folder in [start, *start.parents]:
        if (folder / "pyproject.toml").is_file():
            return folder
    return None


def _node_value(where: str, key: str, value: Any) -> str | int:
    if key in ("partition-id", "num-partitions"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DeployError(f"{where}.{key}: must be a non-negative integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DeployError(f"{where}.{key}: must be a string or number, got {value!r}")
    if isinstance(value, int | float):
        return value if isinstance(value, int) else str(value)
    if '"' in value or "\n" in value:
        # Flower's --node-config parser reads "..." values without escapes.
        raise DeployError(f"{where}.{key}: may not contain double quotes or newlines: {value!r}")
    return value


def _parse_node(i: int, data: Any, base_dir: Path) -> NodeSpec:
    where = f"nodes[{i}]"
    d = _check_keys(where, data, _NODE_KEYS, required=("port", "node_config"))
    name = _str(f"{where}.name", d.get("name", f"node{i}"))
    if not _NAME_RE.match(name):
        raise DeployError(f"{where}.name: {name!r} may only use letters, digits, '_', '.', '-'")
    where = f"nodes[{i}] ({name})"
    cfg = _check_keys(f"{where}.node_config", d["node_config"], set(NODE_CONFIG_KEYS + NODE_CONFIG_OPTIONAL),
                      required=NODE_CONFIG_KEYS)
    node_config: dict[str, str | int] = {k: _node_value(f"{where}.node_config", k, cfg[k]) for k in NODE_CONFIG_KEYS}
    if "state-dir" in cfg:
        state_dir = Path(_str(f"{where}.node_config.state-dir", cfg["state-dir"])).expanduser()
        state_dir = (state_dir if state_dir.is_absolute() else base_dir / state_dir).resolve()
        node_config["state-dir"] = _node_value(f"{where}.node_config", "state-dir", str(state_dir))
    if node_config["partition-id"] >= node_config["num-partitions"]:  # type: ignore[operator]
        raise DeployError(f"{where}.node_config: partition-id {node_config['partition-id']} must be < "
                          f"num-partitions {node_config['num-partitions']}")
    device = str(node_config["device"]).lower()
    if device.split(":", 1)[0] not in DEVICE_KINDS:
        raise DeployError(f"{where}.node_config.device: {device!r} is not one of {', '.join(DEVICE_KINDS)} (or cuda:N)")
    extra = d.get("extra_node_config") or {}
    if not isinstance(extra, Mapping):
        raise DeployError(f"{where}.extra_node_config: expected a mapping")
    for key, value in extra.items():
        if key in node_config:
            raise DeployError(f"{where}.extra_node_config.{key}: set it under node_config")
        if not re.match(r"^[A-Za-z0-9_.-]+$", str(key)):
            raise DeployError(f"{where}.extra_node_config: invalid key {key!r}")
        node_config[str(key)] = _node_value(f"{where}.extra_node_config", str(key), value)
    site_nodes = _parse_site_nodes(where, d.get("site_nodes"), node_config)
    return NodeSpec(name=name, port=_port(f"{where}.port", d["port"]), node_config=node_config, site_nodes=site_nodes)


def _parse_site_nodes(where: str, data: Any, node_config: Mapping[str, str | int]) -> tuple[SiteNodeSpec, ...]:
    """``site_nodes: [{devices: "cpu,cpu"}, ...]``: nodes 1, 2, ... of the site, checked against the
    node config that node 0's SuperNode gets (``nodes``, ``devices``, ``site-group``, ``site-rendezvous``)."""
    if data is None:
        return ()
    if not isinstance(data, list) or not data:
        raise DeployError(f"{where}.site_nodes: expected a non-empty list of {{devices: ...}}")
    need = ("nodes", "devices", "site-group", "site-rendezvous")
    missing = [k for k in need if k not in node_config]
    if missing:
        raise DeployError(f"{where}.site_nodes: a site of several nodes needs extra_node_config {', '.join(missing)} "
                          "(docs/multidevice.md)")
    if node_config["nodes"] != len(data) + 1:
        raise DeployError(f"{where}.site_nodes: {len(data)} other nodes, but extra_node_config nodes is "
                          f"{node_config['nodes']} (it counts node 0 too: {len(data) + 1})")
    out = []
    for k, entry in enumerate(data, start=1):
        spec = _check_keys(f"{where}.site_nodes[{k - 1}]", entry, {"devices"}, required=("devices",))
        devices = _str(f"{where}.site_nodes[{k - 1}].devices", spec["devices"])
        if len([d for d in devices.split(",") if d.strip()]) != node_config["devices"]:
            raise DeployError(f"{where}.site_nodes[{k - 1}].devices: {devices!r} is not {node_config['devices']} "
                              "devices (every node of a site runs as many ranks as node 0's devices)")
        out.append(SiteNodeSpec(node_rank=k, devices=devices))
    return tuple(out)


def parse_topology(data: Any, base_dir: Path, source: str = "<topology>") -> Topology:
    """Validate a topology mapping; relative paths are resolved against ``base_dir``.

    Every unknown key and every missing field is an error naming it: a typo in a security key
    must not silently leave a site unauthenticated.
    """
    d = _check_keys(source, data, _TOP_KEYS, required=("superlink", "nodes"))
    name = _str(f"{source}: name", d.get("name", Path(source).stem if source != "<topology>" else "deploy"))
    if not _NAME_RE.match(name):
        raise DeployError(f"{source}: name {name!r} may only use letters, digits, '_', '.', '-'")
    sl = _check_keys(f"{source}: superlink", d["superlink"], _SUPERLINK_KEYS, required=("host", "port"))
    host = _str(f"{source}: superlink.host", sl["host"])
    port = _port(f"{source}: superlink.port", sl["port"])
    bind = _str(f"{source}: superlink.bind", sl.get("bind", host))

    def path(value: Any, key: str) -> Path:
        p = Path(_str(f"{source}: {key}", str(value))).expanduser()
        return (p if p.is_absolute() else base_dir / p).resolve()

    app_dir = path(d.get("app_dir", "."), "app_dir")
    flwr_home = path(d.get("flwr_home", f".flwr-deploy/{name}"), "flwr_home")
    state_dir = path(d["state_dir"], "state_dir") if "state_dir" in d else flwr_home / "state"

    warm_apps = _bool(f"{source}: warm_apps", d.get("warm_apps", warm_apps_supported()))
    if warm_apps and not warm_apps_supported():
        raise DeployError(f"{source}: warm_apps=true needs Linux (abstract Unix sockets, SO_PEERCRED); "
                          "remove the key or set it to false")

    sec = _check_keys(f"{source}: security", d.get("security") or {}, _SECURITY_KEYS)
    loopback = is_loopback(host)
    # Real sites get TLS + SuperNode authentication unless the file says otherwise.
    tls = _bool(f"{source}: security.tls", sec.get("tls", not loopback))
    auth = _bool(f"{source}: security.auth", sec.get("auth", tls and not loopback))
    allow_remote = _bool(f"{source}: security.allow_insecure_remote", sec.get("allow_insecure_remote", False))
    certs_dir = path(sec.get("certs_dir", flwr_home / "certs"), "security.certs_dir")
    if auth and not tls:
        raise DeployError(f"{source}: security.auth=true needs security.tls=true (Flower refuses SuperNode "
                          "authentication without TLS)")
    if not tls and not allow_remote:
        for key, value in (("host", host), ("bind", bind)):
            if not is_loopback(value):
                raise DeployError(f"{source}: superlink.{key} {value!r} is not a loopback address, so the topology "
                                  "must use security.tls=true (plaintext would cross the network); set "
                                  "security.allow_insecure_remote=true only for an isolated test network")

    nodes_raw = d["nodes"]
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise DeployError(f"{source}: nodes must be a non-empty list")
    nodes = tuple(_parse_node(i, n, base_dir) for i, n in enumerate(nodes_raw))
    names = [n.name for n in nodes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DeployError(f"{source}: duplicate node name(s) {', '.join(dup)}")
    ports = [port] + [n.port for n in nodes]
    dup_ports = sorted({p for p in ports if ports.count(p) > 1})
    if dup_ports:
        raise DeployError(f"{source}: port(s) {', '.join(map(str, dup_ports))} used twice (the SuperLink and each "
                          "SuperNode on one host need their own port)")
    parts = [n.node_config["partition-id"] for n in nodes]
    dup_parts = sorted({p for p in parts if parts.count(p) > 1})  # type: ignore[type-var]
    if dup_parts:
        raise DeployError(f"{source}: partition-id(s) {dup_parts} assigned to more than one node")
    nparts = {n.node_config["num-partitions"] for n in nodes}
    if len(nparts) > 1:
        raise DeployError(f"{source}: nodes disagree on num-partitions ({sorted(nparts)})")  # type: ignore[type-var]
    return Topology(
        name=name, source=source, app_dir=app_dir, host=host, bind=bind, port=port,
        flwr_home=flwr_home, state_dir=state_dir,
        security=Security(tls=tls, auth=auth, certs_dir=certs_dir, allow_insecure_remote=allow_remote),
        nodes=nodes, warm_apps=warm_apps,
    )


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file.

    Relative paths inside it are resolved against the project (the nearest folder above the file
    holding ``pyproject.toml``), so ``fl-geo deploy up configs/deploy/loopback.yaml`` works from
    any working directory; a file outside a project resolves against the working directory.
    """
    data, base = read_topology_file(path)
    return parse_topology(data, base, str(Path(path)))


def read_topology_file(path: str | Path) -> tuple[Any, Path]:
    """A topology YAML file's data and the directory its relative paths resolve against (the
    project root above it, else the working directory); DeployError if missing or not YAML."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise DeployError(f"topology file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise DeployError(f"{p}: not valid YAML: {exc}") from None
    return data, find_project_root(p.resolve().parent) or Path.cwd()
