"""Flower's own configuration for a topology: the SuperLink connection in ``$FLWR_HOME/config.toml``.

Since Flower 1.41 ``flwr`` reads its connections from ``$FLWR_HOME/config.toml``; fl-geo writes
the topology's entry there (a small TOML writer, so no TOML library is needed to write it), under
a lock, because tests and launchers may write the same file from several threads.
"""

from __future__ import annotations

import json
import os
import re
import threading
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_geo.deploy.topology import DeployError, Topology

__all__ = ["connection_entry", "dumps_toml", "write_flwr_config"]


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
