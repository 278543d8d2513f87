"""Multi-site deployment: certificates, a topology file, and the SuperLink/SuperNode processes.

``fl-geo run`` simulates datacenters inside one machine. A real multi-site run is one Flower
SuperLink (where the ServerApp, i.e. the outer optimizer, runs) and one SuperNode per site (where
that site's ClientApp trains), joined over the WAN. This module turns that into four steps that a
platform engineer can script and CI can test on loopback:

- :func:`generate_certs` (``fl-geo deploy certs``): a test CA, a SuperLink server certificate
  whose SAN covers the addresses the sites dial, and one SuperNode authentication key pair per
  site. Flower 1.41 authenticates SuperNodes by EC (NIST P-384) keys in OpenSSH format: the
  SuperLink runs with ``--enable-supernode-auth`` (which requires TLS) and only accepts nodes whose
  public key was registered with ``flwr supernode register KEY.pub CONNECTION``; a SuperNode
  proves its identity with ``--auth-supernode-private-key``. (The older
  ``--auth-list-public-keys`` CSV is rejected by 1.41's SuperLink.)
- :func:`load_topology` reads a YAML file (``configs/deploy/*.yaml``) describing the SuperLink,
  its security and the nodes with their ``node_config`` (partition, site, region, device).
- :func:`up` / :func:`down` / :func:`status` start, stop and show the processes of a topology
  that runs on this host (loopback demos, CI); ``examples/deploy/*.sh`` are the per-host wrappers
  for real sites.
- :func:`run_experiment` (``fl-geo deploy run``) submits an fl-geo config with ``flwr run`` and
  waits for it, then finds the run's ``summary.json``.

Processes are started in their own process groups and recorded (pid, process group, start time)
in ``<state_dir>/pids.json``, so that ``down`` (or a test fixture) stops exactly what ``up``
started, including the ``flower-superexec`` and app processes they spawn, and never a process
that merely reused a recorded pid.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_geo.inner.device import DEVICE_KINDS

__all__ = [
    "free_ports",
    "CertPaths",
    "DeployError",
    "NodeSpec",
    "ProcRecord",
    "RunResult",
    "Security",
    "Topology",
    "down",
    "generate_certs",
    "load_topology",
    "parse_topology",
    "run_experiment",
    "status",
    "up",
    "write_flwr_config",
]

# The Flower app and the SuperLink/SuperNode must run in this interpreter's environment: with
# runtime dependency installation on, Flower would `uv sync` a fresh env per app and fetch
# CUDA torch wheels from the internet.
NO_DEPS_ENV = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
NODE_CONFIG_KEYS = ("partition-id", "num-partitions", "site", "region", "device")
# Optional: where the site keeps its inner optimizer state across a restarted ServerApp
# (clients/persist.py); a relative path is resolved like the topology's other paths.
NODE_CONFIG_OPTIONAL = ("state-dir",)
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
DEFAULT_GRACE_S = 10.0


class DeployError(RuntimeError):
    """A deployment step failed; the message names the file, key or log to look at."""


# ---------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True for addresses that never leave this machine (the only place ``--insecure`` is OK).

    A host name other than ``localhost`` counts as remote: we cannot know where DNS points it.
    """
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Security:
    """Transport security of a topology: TLS for every connection, SuperNode authentication."""

    tls: bool
    auth: bool
    certs_dir: Path
    allow_insecure_remote: bool = False


@dataclass(frozen=True)
class NodeSpec:
    """One SuperNode (one site): its Runtime API port on its host and its ``node_config``."""

    name: str
    port: int
    node_config: dict[str, str | int]

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
    def certs(self) -> CertPaths:
        return CertPaths(self.security.certs_dir)

    def cert_hosts(self) -> list[str]:
        """Names the server certificate must cover: the dialled address plus the loopback names."""
        hosts = [self.host]
        for extra in ("127.0.0.1", "localhost"):
            if extra not in hosts:
                hosts.append(extra)
        return hosts


_TOP_KEYS = {"name", "superlink", "flwr_home", "state_dir", "app_dir", "security", "nodes"}
_SUPERLINK_KEYS = {"host", "port", "bind"}
_SECURITY_KEYS = {"tls", "auth", "certs_dir", "allow_insecure_remote"}
_NODE_KEYS = {"name", "port", "node_config", "extra_node_config"}
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
    return NodeSpec(name=name, port=_port(f"{where}.port", d["port"]), node_config=node_config)


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
        nodes=nodes,
    )


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file.

    Relative paths inside it are resolved against the project (the nearest folder above the file
    holding ``pyproject.toml``), so ``fl-geo deploy up configs/deploy/loopback.yaml`` works from
    any working directory; a file outside a project resolves against the working directory.
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        raise DeployError(f"topology file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise DeployError(f"{p}: not valid YAML: {exc}") from None
    base = find_project_root(p.resolve().parent) or Path.cwd()
    return parse_topology(data, base, str(p))


# ---------------------------------------------------------------------------------------------
# Certificates and SuperNode keys
# ---------------------------------------------------------------------------------------------


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


def _openssl(openssl: str | None = None) -> str:
    exe = openssl or os.environ.get("OPENSSL") or shutil.which("openssl")
    if not exe or not (Path(exe).is_file() or shutil.which(exe)):
        raise DeployError("openssl not found: install it (e.g. apt-get install openssl) or set OPENSSL=/path/to/openssl")
    return exe


def _run_tool(cmd: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DeployError(f"{what} failed ({shlex.join(cmd)}):\n{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _cert_sans(openssl: str, cert: Path) -> set[str]:
    out = _run_tool([openssl, "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"], "reading the SAN")
    sans: set[str] = set()
    for item in out.replace("\n", ",").split(","):
        item = item.strip()
        if item.startswith("IP Address:"):
            sans.add("IP:" + item.split(":", 1)[1])
        elif item.startswith("DNS:"):
            sans.add(item)
    return sans


def _wanted_sans(hosts: Iterable[str]) -> set[str]:
    out = set()
    for h in hosts:
        h = h.strip().strip("[]")
        try:
            out.add(f"IP:{ipaddress.ip_address(h)}")
        except ValueError:
            out.add(f"DNS:{h}")
    return out


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate_node_key(openssl: str, private_path: Path, public_path: Path, comment: str) -> None:
    """One SuperNode key pair: an EC P-384 key from openssl, stored in OpenSSH format.

    Flower 1.41's SuperNode loads ``--auth-supernode-private-key`` with
    ``load_ssh_private_key`` and ``flwr supernode register`` wants an OpenSSH public key on a
    NIST curve; openssl cannot write OpenSSH encodings, so the ``cryptography`` package (a
    Flower dependency) converts the PEM key openssl generated.
    """
    from cryptography.hazmat.primitives import serialization

    with tempfile.TemporaryDirectory() as tmp:
        pem = Path(tmp) / "key.pem"
        _run_tool([openssl, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-384", "-out", str(pem)],
                  f"generating the key of {comment}")
        key = serialization.load_pem_private_key(pem.read_bytes(), password=None)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_private(private_path, private)
    public_path.write_bytes(public + f" {comment}\n".encode())


def generate_certs(out: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                   nodes: Sequence[str] = ("dc0", "dc1", "dc2"), days: int = 365,
                   openssl: str | None = None) -> CertPaths:
    """Create (or complete) a test CA, a SuperLink certificate for ``hosts`` and node key pairs.

    Idempotent: an existing CA and existing node keys are kept (so already distributed files stay
    valid); the server certificate is re-issued only when missing, not signed by this CA, or its
    SAN does not cover exactly ``hosts``. ``supernodes.pub`` is rewritten from the node keys.
    """
    exe = _openssl(openssl)
    paths = CertPaths(Path(out).resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    hosts = [h for h in (x.strip() for x in hosts) if h]
    if not hosts:
        raise DeployError("generate_certs needs at least one host for the server certificate")
    for n in nodes:
        if not _NAME_RE.match(n):
            raise DeployError(f"node name {n!r} may only use letters, digits, '_', '.', '-'")

    if not (paths.ca_cert.is_file() and paths.ca_key.is_file()):
        with tempfile.TemporaryDirectory() as tmp:
            key = Path(tmp) / "ca.key"
            _run_tool([exe, "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                       "-keyout", str(key), "-out", str(paths.ca_cert), "-days", str(days * 3),
                       "-subj", "/CN=fl-geo deployment test CA",
                       "-addext", "basicConstraints=critical,CA:TRUE",
                       "-addext", "keyUsage=critical,keyCertSign,cRLSign"], "creating the CA")
            _write_private(paths.ca_key, key.read_bytes())
        paths.server_cert.unlink(missing_ok=True)  # a new CA invalidates the old server cert

    wanted = _wanted_sans(hosts)
    fresh = paths.server_cert.is_file() and paths.server_key.is_file()
    if fresh:
        verify = subprocess.run([exe, "verify", "-CAfile", str(paths.ca_cert), str(paths.server_cert)],
                                capture_output=True, text=True, check=False)
        fresh = verify.returncode == 0 and _cert_sans(exe, paths.server_cert) == wanted
    if not fresh:
        with tempfile.TemporaryDirectory() as tmp:
            key, csr, ext = Path(tmp) / "server.key", Path(tmp) / "server.csr", Path(tmp) / "ext.cnf"
            san = ",".join(sorted(wanted))
            ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                           f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n", encoding="utf-8")
            _run_tool([exe, "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                       "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={hosts[0]}"],
                      "creating the SuperLink key")
            _run_tool([exe, "x509", "-req", "-in", str(csr), "-CA", str(paths.ca_cert), "-CAkey", str(paths.ca_key),
                       "-set_serial", "0x" + os.urandom(16).hex(), "-days", str(days), "-out", str(paths.server_cert),
                       "-extfile", str(ext)], "signing the SuperLink certificate")
            _write_private(paths.server_key, key.read_bytes())

    for n in nodes:
        priv, pub = paths.node_private_key(n), paths.node_public_key(n)
        if not (priv.is_file() and pub.is_file()):
            generate_node_key(exe, priv, pub, n)
    keys_dir = paths.root / "supernodes"
    lines = [p.read_text(encoding="utf-8").strip() for p in sorted(keys_dir.glob("*.pub"))] if keys_dir.is_dir() else []
    paths.public_keys.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return paths


def ensure_certs(topo: Topology) -> CertPaths:
    """The topology's certificates and node keys, generated when missing (loopback and CI)."""
    return generate_certs(topo.security.certs_dir, topo.cert_hosts(), [n.name for n in topo.nodes])


# ---------------------------------------------------------------------------------------------
# Flower configuration ($FLWR_HOME/config.toml)
# ---------------------------------------------------------------------------------------------


def _toml_key(key: str) -> str:
    return key if re.match(r"^[A-Za-z0-9_-]+$", key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A JSON string without ASCII escaping is a valid TOML basic string.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """A minimal TOML writer for the nested tables of Flower's config.toml (no dependency)."""
    lines: list[str] = []

    def table(prefix: list[str], d: Mapping[str, Any]) -> None:
        scalars = [(k, v) for k, v in d.items() if not isinstance(v, Mapping)]
        subs = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
        if prefix and (scalars or not subs):
            lines.append("")
            lines.append("[" + ".".join(_toml_key(p) for p in prefix) + "]")
        for k, v in scalars:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        for k, v in subs:
            table([*prefix, k], v)

    table([], data)
    return "\n".join(lines).lstrip("\n") + "\n"


def connection_entry(topo: Topology) -> dict[str, Any]:
    """The ``[superlink.<name>]`` entry of ``flwr`` for this topology."""
    entry: dict[str, Any] = {"address": topo.address}
    if topo.security.tls:
        entry["root-certificates"] = str(topo.certs.ca_cert)
    else:
        entry["insecure"] = True
    return entry


_CONFIG_LOCK = threading.Lock()


def write_flwr_config(topo: Topology) -> Path:
    """Add (or replace) this topology's connection in ``$FLWR_HOME/config.toml``.

    Other connections in the file are kept, so several topologies can share one FLWR_HOME.
    """
    path = topo.flwr_home / "config.toml"
    # Read-modify-write under a lock, replaced atomically: the HALoS tiers start in parallel
    # threads and share one FLWR_HOME; without it one tier's entry could be lost (its
    # `flwr supernode ls` then sees no SuperLink and `up` times out).
    with _CONFIG_LOCK:
        data: dict[str, Any] = {}
        if path.is_file():
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except tomllib.TOMLDecodeError as exc:
                raise DeployError(f"{path}: not valid TOML ({exc}); fix or delete it") from None
        superlink = data.setdefault("superlink", {})
        if not isinstance(superlink, dict):
            raise DeployError(f"{path}: [superlink] must be a table")
        superlink.setdefault("default", topo.name)
        superlink[topo.name] = connection_entry(topo)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(dumps_toml(data), encoding="utf-8")
        tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


@dataclass
class ProcRecord:
    """One process started by :func:`up`; ``start_ticks`` guards against pid reuse."""

    role: str  # superlink | supernode
    name: str
    pid: int
    pgid: int
    start_ticks: int | None
    log: str
    cmd: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return _alive(self.pid, self.start_ticks)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], start time [19])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None


def _reap(pid: int) -> None:
    """Collect a child we started ourselves (a test calling :func:`up` in-process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int, start_ticks: int | None = None) -> bool:
    """Is ``pid`` running (not a zombie) and still the process that was recorded?"""
    _reap(pid)
    if Path("/proc").is_dir() and Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        if stat is None or stat[0] == "Z":
            return False
        return start_ticks is None or int(stat[19]) == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _descendants(pids: Iterable[int]) -> set[int]:
    """All live descendants of ``pids`` (Linux /proc scan; empty elsewhere).

    Flower starts ``flower-superexec`` and the app processes in new sessions in places, so killing
    a process group alone can leave them behind (and a superexec whose parent is a zombie never
    notices it is gone).
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _proc_stat(int(entry.name))
        if stat and stat[0] != "Z":
            children.setdefault(int(stat[1]), []).append(int(entry.name))
    out: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def load_records(topo: Topology) -> list[ProcRecord]:
    if not topo.pids_path.is_file():
        return []
    try:
        raw = json.loads(topo.pids_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DeployError(f"{topo.pids_path}: corrupt ({exc}); stop the processes by hand and delete it") from None
    return [ProcRecord(**r) for r in raw.get("processes", [])]


def _save_records(topo: Topology, records: list[ProcRecord]) -> None:
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = topo.pids_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"topology": topo.source, "processes": [r.__dict__ for r in records]}, indent=2),
                   encoding="utf-8")
    tmp.replace(topo.pids_path)


def flower_env(topo: Topology) -> dict[str, str]:
    """Environment for every Flower process and CLI call of this topology.

    PATH starts with this interpreter's bin folder: the SuperLink and SuperNode spawn
    ``flower-superexec`` by name and must find the one of this venv.
    """
    env = dict(os.environ)
    env.update(NO_DEPS_ENV)
    env["FLWR_HOME"] = str(topo.flwr_home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def flower_exe(name: str) -> str:
    exe = Path(sys.executable).parent / name
    if exe.is_file():
        return str(exe)
    found = shutil.which(name)
    if not found:
        raise DeployError(f"{name} not found next to {sys.executable} or on PATH (is flwr installed in this venv?)")
    return found


def superlink_command(topo: Topology) -> list[str]:
    cmd = [flower_exe("flower-superlink"), "--host", topo.bind, "--port", str(topo.port),
           "--disable-runtime-dependency-installation"]
    if topo.security.tls:
        c = topo.certs
        cmd += ["--ssl-certfile", str(c.server_cert), "--ssl-keyfile", str(c.server_key),
                "--ssl-ca-certfile", str(c.ca_cert)]
    else:
        cmd.append("--insecure")
    if topo.security.auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def supernode_command(topo: Topology, node: NodeSpec, private_key: Path | None = None) -> list[str]:
    """The ``flower-supernode`` command of one node (``private_key`` overrides its own key)."""
    cmd = [flower_exe("flower-supernode"), "--superlink", topo.address, "--port", str(node.port),
           "--node-config", node.node_config_arg()]
    if topo.security.tls:
        cmd += ["--root-certificates", str(topo.certs.ca_cert)]
    else:
        cmd.append("--insecure")
    if topo.security.auth:
        cmd += ["--auth-supernode-private-key", str(private_key or topo.certs.node_private_key(node.name))]
    return cmd


def launch(topo: Topology, role: str, name: str, cmd: list[str]) -> tuple[subprocess.Popen[bytes], ProcRecord]:
    """Start ``cmd`` in its own process group, log to ``<state_dir>/logs/<role>-<name>.log``, record it.

    The record is written before anything waits on the process, so ``down`` can always stop it.
    """
    topo.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = topo.logs_dir / f"{role}-{name}.log"
    with log_path.open("ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=flower_env(topo), cwd=topo.state_dir, start_new_session=True)
    rec = ProcRecord(role=role, name=name, pid=proc.pid, pgid=proc.pid, start_ticks=_start_ticks(proc.pid),
                     log=str(log_path), cmd=cmd)
    _save_records(topo, [*load_records(topo), rec])
    return proc, rec


def _tail(path: str | Path, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("0.0.0.0", "::") else "", port))
        except OSError:
            return False
    return True


def health_ok(topo: Topology, timeout_s: float = 2.0) -> bool:
    """GET /health on the SuperLink's HTTP(S) port (verifying its certificate under TLS)."""
    scheme = "https" if topo.security.tls else "http"
    ctx = ssl.create_default_context(cafile=str(topo.certs.ca_cert)) if topo.security.tls else None
    try:
        with urllib.request.urlopen(f"{scheme}://{topo.address}/health", timeout=timeout_s, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def flwr_cli(topo: Topology, args: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the ``flwr`` CLI of this venv against the topology's FLWR_HOME."""
    return subprocess.run([flower_exe("flwr"), *args], capture_output=True, text=True, env=flower_env(topo),
                          cwd=topo.app_dir, timeout=timeout_s, check=False)


def _json_out(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON object a ``flwr ... --format json`` call printed (stdout may carry a banner)."""
    text = proc.stdout
    start = text.find("{")
    if start < 0:
        return {"success": False, "error-message": (proc.stderr or text).strip()}
    try:
        out = json.loads(text[start:])
    except json.JSONDecodeError:
        return {"success": False, "error-message": text.strip()}
    return out if isinstance(out, dict) else {"success": False, "error-message": text.strip()}


def list_nodes(topo: Topology) -> list[dict[str, Any]]:
    """The SuperLink's node table (``flwr supernode ls``); empty when it cannot be read."""
    out = _json_out(flwr_cli(topo, ["supernode", "ls", topo.name, "--format", "json"]))
    return list(out.get("nodes", [])) if out.get("success") else []


def register_node(topo: Topology, public_key: Path, name: str) -> int:
    """Register one SuperNode public key with an auth-enabled SuperLink; returns its node id."""
    out = _json_out(flwr_cli(topo, ["supernode", "register", str(public_key), topo.name, "--name", name,
                                    "--format", "json"]))
    if not out.get("success"):
        raise DeployError(f"registering {name} ({public_key}) failed: {out.get('error-message', out)}")
    return int(out["node-id"])


@dataclass
class UpResult:
    """What :func:`up` started and how long each phase took (the numbers in docs/deploy.md)."""

    records: list[ProcRecord]
    healthy_s: float
    nodes_online_s: float
    node_ids: dict[str, int] = field(default_factory=dict)


def _fail_if_exited(procs: Sequence[tuple[subprocess.Popen[bytes], ProcRecord]]) -> None:
    for proc, rec in procs:
        code = proc.poll()
        if code is not None:
            raise DeployError(f"{rec.role} {rec.name} exited with code {code} while starting; "
                              f"see {rec.log}:\n{_tail(rec.log)}")


def up(topo: Topology, timeout_s: float = 120.0, echo: bool = False) -> UpResult:
    """Start the SuperLink, then every SuperNode, and wait until all nodes are online.

    On any failure the processes started so far are stopped again (the error names the log
    file to read), so a failed ``up`` never leaves a half-started federation behind.
    """
    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    records = load_records(topo)
    if records:
        live = [r for r in records if r.alive()]
        if live and len(live) == len(records):
            raise DeployError(f"{topo.name} is already up ({len(live)} processes in {topo.pids_path}); "
                              f"run `fl-geo deploy down {topo.source}` first")
        if live:
            raise DeployError(f"{topo.name} is partly up ({len(live)} of {len(records)} recorded processes alive); "
                              f"run `fl-geo deploy down {topo.source}` first")
        topo.pids_path.unlink()  # stale: every recorded process is gone
    busy = [f"{topo.bind}:{topo.port} (superlink)"] if not _port_free(topo.bind, topo.port) else []
    busy += [f"127.0.0.1:{n.port} ({n.name})" for n in topo.nodes if not _port_free("127.0.0.1", n.port)]
    if busy:
        raise DeployError(f"port(s) already in use: {', '.join(busy)}; pick free ports in {topo.source}")
    if topo.security.tls:
        ensure_certs(topo)
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    write_flwr_config(topo)

    t0 = time.monotonic()
    deadline = t0 + timeout_s
    started: list[tuple[subprocess.Popen[bytes], ProcRecord]] = []
    try:
        started.append(launch(topo, "superlink", topo.name, superlink_command(topo)))
        say(f"superlink {topo.address} (pid {started[0][1].pid}), log {started[0][1].log}")
        while not health_ok(topo):
            _fail_if_exited(started)
            if time.monotonic() > deadline:
                raise DeployError(f"SuperLink at {topo.address} not healthy after {timeout_s:.0f} s; "
                                  f"see {started[0][1].log}:\n{_tail(started[0][1].log)}")
            time.sleep(0.2)
        healthy_s = time.monotonic() - t0
        say(f"superlink healthy after {healthy_s:.1f} s")

        node_ids: dict[str, int] = {}
        if topo.security.auth:
            for node in topo.nodes:
                node_ids[node.name] = register_node(topo, topo.certs.node_public_key(node.name), node.name)
            say(f"registered {len(node_ids)} SuperNode public keys")
        for node in topo.nodes:
            started.append(launch(topo, "supernode", node.name, supernode_command(topo, node)))
            say(f"supernode {node.name} port {node.port} node_config {node.node_config_arg()}, log {started[-1][1].log}")

        want = len(topo.nodes)
        online: list[dict[str, Any]] = []
        while True:
            _fail_if_exited(started)
            online = [n for n in list_nodes(topo) if n.get("status") == "online"]
            if len(online) >= want:
                break
            if time.monotonic() > deadline:
                logs = ", ".join(r.log for _, r in started[1:])
                raise DeployError(f"only {len(online)} of {want} SuperNodes online after {timeout_s:.0f} s; "
                                  f"see the node logs: {logs}")
            time.sleep(0.5)
        nodes_s = time.monotonic() - t0
        say(f"{want} SuperNodes online after {nodes_s:.1f} s")
        return UpResult(records=[r for _, r in started], healthy_s=healthy_s, nodes_online_s=nodes_s,
                        node_ids=node_ids)
    except BaseException:
        down(topo)
        raise


@dataclass
class DownResult:
    """Which recorded processes (and their descendants) were signalled, and which needed SIGKILL."""

    signalled: list[int]
    killed: list[int]
    survivors: list[int]


def down(topo: Topology, grace_s: float = DEFAULT_GRACE_S) -> DownResult:
    """Stop every recorded process: SIGTERM to its group and descendants, SIGKILL after ``grace_s``.

    SuperNodes go first so they can deregister while the SuperLink still answers. Safe to call
    twice: without ``pids.json`` it does nothing.
    """
    records = load_records(topo)
    if not records:
        topo.pids_path.unlink(missing_ok=True)
        return DownResult([], [], [])
    ordered = [r for r in records if r.role != "superlink"] + [r for r in records if r.role == "superlink"]
    signalled: list[int] = []
    killed: list[int] = []

    def stop(batch: list[ProcRecord]) -> None:
        mine = [r for r in batch if r.alive()]
        pids = {r.pid for r in mine} | _descendants(r.pid for r in mine)
        for r in mine:
            _signal(r.pgid, signal.SIGTERM, group=True)
        for pid in pids:
            _signal(pid, signal.SIGTERM, group=False)
        signalled.extend(sorted(pids))
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(_alive(p) for p in pids):
            pids |= _descendants(p for p in pids if _alive(p))  # processes spawned while stopping
            time.sleep(0.1)
        for pid in sorted(p for p in pids if _alive(p)):
            _signal(pid, signal.SIGKILL, group=False)
            killed.append(pid)
        for r in mine:
            _signal(r.pgid, signal.SIGKILL, group=True)  # anything left in the group
        time.sleep(0.05)
        for pid in pids:
            _reap(pid)

    stop([r for r in ordered if r.role != "superlink"])
    stop([r for r in ordered if r.role == "superlink"])
    survivors = sorted(p for p in signalled if _alive(p))
    if not survivors:
        topo.pids_path.unlink(missing_ok=True)
    return DownResult(signalled=signalled, killed=killed, survivors=survivors)


def status(topo: Topology) -> dict[str, Any]:
    """Recorded processes with their liveness, SuperLink health and the node table."""
    records = load_records(topo)
    procs = [{"role": r.role, "name": r.name, "pid": r.pid, "alive": r.alive(), "log": r.log} for r in records]
    superlink_up = any(p["alive"] for p in procs if p["role"] == "superlink")
    healthy = health_ok(topo) if superlink_up else False
    return {"topology": topo.source, "address": topo.address, "tls": topo.security.tls, "auth": topo.security.auth,
            "processes": procs, "healthy": healthy, "nodes": list_nodes(topo) if healthy else []}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """A submitted run: Flower's id and final status, and where fl-geo wrote its results."""

    run_id: int
    status: str
    details: str
    run_dir: Path | None
    summary: dict[str, Any] | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed" and self.summary is not None


def _override_value(overrides: Sequence[str], key: str) -> str | None:
    for item in reversed(overrides):
        k, _, v = item.partition("=")
        if k.strip() == key:
            return v.strip()
    return None


def _config_arg(config: Path, app_dir: Path) -> str:
    """The config path as the ServerApp should see it: project-relative when inside the app
    (the ServerApp resolves it against its own checkout), absolute otherwise."""
    p = config.resolve()
    try:
        return str(p.relative_to(app_dir))
    except ValueError:
        return str(p)


def run_status(topo: Topology, run_id: int) -> tuple[str, str]:
    """(status, details) of one run, e.g. ("finished:completed", "")."""
    out = _json_out(flwr_cli(topo, ["ls", topo.name, "--run-id", str(run_id), "--format", "json"]))
    runs = out.get("runs") or []
    if not out.get("success") or not runs:
        return "unknown", str(out.get("error-message", ""))
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


def run_experiment(topo: Topology, config: str | Path, overrides: Sequence[str] = (), out_dir: str | Path | None = None,
                   stream: bool = False, wait: bool = True, timeout_s: float = 0.0,
                   poll_s: float = 2.0, echo: bool = True) -> RunResult:
    """Submit ``config`` (+ ``overrides``) with ``flwr run`` and, unless ``wait=False``, wait for it.

    ``run.out_dir`` is set to an absolute folder (``out_dir``, default ``<app>/runs``; the run
    directory is created on the SuperLink's host) so the caller can find the run's directory:
    the one folder ``<out_dir>/<run.name>-*`` that appeared during the run. ``stream`` prints
    Flower's log stream while waiting. A run still going after ``timeout_s`` (0 = no limit) is
    stopped with ``flwr stop``.
    """
    from fl_geo.config import load_config

    say = (lambda msg: print(msg, file=sys.stderr)) if echo else (lambda msg: None)
    overrides = list(overrides)
    cfg_path = Path(config)
    if not cfg_path.is_absolute() and not cfg_path.exists() and (topo.app_dir / cfg_path).exists():
        cfg_path = topo.app_dir / cfg_path
    user_out = _override_value(overrides, "run.out_dir")
    if user_out is not None:
        out = Path(user_out).expanduser()
        out = out if out.is_absolute() else topo.app_dir / out
    else:
        out = Path(out_dir).expanduser() if out_dir else topo.app_dir / "runs"
        out = out if out.is_absolute() else Path.cwd() / out
    out = out.resolve()
    overrides = [o for o in overrides if o.partition("=")[0].strip() != "run.out_dir"] + [f"run.out_dir={out}"]
    cfg = load_config(cfg_path, overrides)  # validate here: a typo fails before anything is submitted
    name = cfg.run.name

    write_flwr_config(topo)
    topo.state_dir.mkdir(parents=True, exist_ok=True)
    run_config = topo.state_dir / f"run-config-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.toml"
    # A TOML file, not a `--run-config 'k="v"'` string: Flower's parser cannot escape quotes, and
    # overrides such as data.files='[a.txt, "b c.txt"]' need them.
    run_config.write_text(dumps_toml({"config": _config_arg(cfg_path, topo.app_dir),
                                      "overrides": shlex.join(overrides)}), encoding="utf-8")
    before = {p.resolve() for p in out.glob(f"{name}-*")}
    t0 = time.monotonic()
    submit = flwr_cli(topo, ["run", str(topo.app_dir), topo.name, "--run-config", str(run_config),
                             "--format", "json"], timeout_s=300)
    res = _json_out(submit)
    if not res.get("success") or not res.get("run-id"):
        raise DeployError(f"flwr run failed: {res.get('error-message') or submit.stderr.strip() or submit.stdout.strip()}")
    run_id = int(res["run-id"])
    say(f"run {run_id} submitted to {topo.name} ({topo.address}): {cfg_path} {' '.join(overrides)}")
    if not wait:
        return RunResult(run_id, "submitted", "", None, None, time.monotonic() - t0)

    streamer = None
    if stream:
        streamer = subprocess.Popen([flower_exe("flwr"), "log", str(run_id), topo.name, "--stream"],
                                    env=flower_env(topo), cwd=topo.app_dir, stdin=subprocess.DEVNULL)
    state, details = "unknown", ""
    try:
        while True:
            state, details = run_status(topo, run_id)
            if state.startswith("finished"):
                break
            if timeout_s and time.monotonic() - t0 > timeout_s:
                flwr_cli(topo, ["stop", str(run_id), topo.name])
                state, details = "timeout", f"run did not finish within {timeout_s:.0f} s (stopped)"
                break
            time.sleep(poll_s)
    finally:
        if streamer is not None:
            try:
                streamer.wait(timeout=5)
            except subprocess.TimeoutExpired:
                streamer.terminate()
                streamer.wait(timeout=5)
    wall = time.monotonic() - t0
    new_dirs = sorted({p.resolve() for p in out.glob(f"{name}-*")} - before, key=lambda p: p.stat().st_mtime)
    run_dir = new_dirs[-1] if new_dirs else None
    summary = None
    if run_dir is not None and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    note = f" ({details})" if details and details != "N/A" else ""
    say(f"run {run_id}: {state}{note} after {wall:.1f} s; run dir {run_dir}")
    return RunResult(run_id, state, details, run_dir, summary, wall)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held until chosen, so they cannot repeat): for
    loopback topologies built on the fly (tests, `fl-geo bench flower-path`)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
