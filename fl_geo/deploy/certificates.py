"""Certificates and SuperNode keys (``fl-geo deploy certs``).

:func:`generate_certs` makes a test CA, a SuperLink server certificate whose SAN covers the
addresses the sites dial, and one SuperNode authentication key pair per site. Flower 1.41
authenticates SuperNodes by EC (NIST P-384) keys in OpenSSH format: the SuperLink runs with
``--enable-supernode-auth`` (which requires TLS) and only accepts nodes whose public key was
registered with ``flwr supernode register KEY.pub CONNECTION``; a SuperNode proves its identity
with ``--auth-supernode-private-key``. (The older ``--auth-list-public-keys`` CSV is rejected by
1.41's SuperLink.)
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from fl_geo.deploy.topology import _NAME_RE, CertPaths, DeployError, Topology

__all__ = ["ensure_certs", "generate_certs", "generate_node_key"]


# ---------------------------------------------------------------------------------------------
# Certificates and SuperNode keys
# ---------------------------------------------------------------------------------------------


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
