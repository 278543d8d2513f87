"""Configuration text in and out: YAML files, ``key=value`` overrides and a public strategy's
keyword values read, checked on their own and merged onto the schema (`FlGeoConfig`) in one
pass, and a config written back as YAML, plain dicts or a section's JSON. Every problem is one
line naming the file or override and the valid keys. Composition, method defaults and the
checks across sections are fl_geo/config.py's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_geo.config_schema import FlGeoConfig
from fl_geo.errors import ConfigError
from fl_geo.yaml_safe import load_yaml

__all__ = ["merge_sources", "read_sources", "schema", "section_to_json", "to_dict", "to_yaml", "user_strategy",
           "wrap_error"]


@functools.cache
def schema() -> DictConfig:
    """The structured schema of every section, built once per process (building it is most of a
    `load_config`). Shared: only ever the first argument of ``OmegaConf.merge``, which copies it;
    never modify it in place."""
    cfg = OmegaConf.structured(FlGeoConfig)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _valid_keys(section: str | None) -> str:
    root = FlGeoConfig()
    obj: Any = getattr(root, section) if section else root
    return ", ".join(f.name for f in fields(obj)) if is_dataclass(obj) else ""


def _section_fields() -> dict[str, list[str]]:
    """Top-level keys that are sections, with their keys (for "a scalar where a section belongs")."""
    root = FlGeoConfig()
    return {f.name: [g.name for g in fields(getattr(root, f.name))]
            for f in fields(root) if is_dataclass(getattr(root, f.name))}


def _check_sections(values: Any, where: str) -> None:
    """A section (``data``, ``strategy``, ...) given a scalar or a list is a one-line error that
    lists the section's keys, instead of omegaconf's "int is not a subclass of DataSection"."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: a config is a mapping of sections ({', '.join(_section_fields())}), "
                          f"got {type(values).__name__}")
    for name, keys in _section_fields().items():
        if name in values and not isinstance(values[name], Mapping):
            raise ConfigError(f"{where}: '{name}' is a section, not a value ({values[name]!r}); set its keys, "
                              f"e.g. {name}.{keys[0]}=..., one of: {', '.join(keys)}")


def _load_yaml(p: Path) -> DictConfig:
    """A YAML config file, read with `fl_geo.yaml_safe.load_yaml` (plain data only, duplicate keys
    refused); every problem is one line with the file (and line, column): not valid YAML, a
    ``!!python`` tag, a key given twice, an empty file (it would run the defaults while the user
    meant something else), or a top level that is not a mapping of sections."""
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc})") from None
    values = load_yaml(text, str(p))
    if values is None:
        raise ConfigError(f"{p}: the file is empty (or only comments); a config is a mapping of sections "
                          f"({', '.join(_section_fields())}); leave the file out to run the defaults")
    _check_sections(values, str(p))
    try:
        return OmegaConf.create(values)
    except OmegaConfBaseException as exc:
        raise wrap_error(exc, str(p)) from None


def wrap_error(exc: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    section = key.split(".")[0] if "." in key else None
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    hint = f" Valid keys here: {_valid_keys(section)}." if "not in" in first_line else ""
    return ConfigError(f"{where}: invalid config key or value '{key}': {first_line}{hint}")


def read_sources(path: str | Path | None, overrides: list[str] | None,
             values: Mapping[str, Any] | None) -> list[tuple[str, DictConfig]]:
    """What the user gave, in merge order (the file, the strategy arguments, each override), each
    read and checked on its own and named for error messages."""
    found: list[tuple[str, DictConfig]] = []
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        found.append((str(p), _load_yaml(p)))
    if values:
        _check_sections(values, "strategy arguments")
        try:
            found.append(("strategy arguments", OmegaConf.create(dict(values))))
        except OmegaConfBaseException as exc:
            raise wrap_error(exc, "strategy arguments") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. strategy.outer_lr=0.5)")
        key = item.partition("=")[0].strip()
        if key in _section_fields():
            keys = _section_fields()[key]
            raise ConfigError(f"override '{item}': '{key}' is a section, not a value; set its keys, "
                              f"e.g. {key}.{keys[0]}=..., one of: {', '.join(keys)}")
        try:
            found.append((f"override '{item}'", _parse_override(item)))
        except OmegaConfBaseException as exc:
            raise wrap_error(exc, f"override '{item}'") from None
    return found


@functools.lru_cache(maxsize=4096)
def _parse_override(item: str) -> DictConfig:
    """One ``key=value`` override as a config, parsed once per process: parsing is ~0.8 ms (as
    much as the rest of a cached load), and a tiny test config repeats the same ~18 overrides in
    every load. Shared like `schema`: only ever merged from (``OmegaConf.merge`` copies what it
    takes; tests/test_config.py checks a parsed override is unchanged by a merge), never
    modified."""
    return OmegaConf.from_dotlist([item])


def merge_sources(base: DictConfig, sources: list[tuple[str, DictConfig]]) -> DictConfig:
    """``base`` with every source merged on, in order, in one pass.

    One ``OmegaConf.merge`` copies the structured base once; a merge per source copied it once
    per override (a tiny test config's ~15 overrides cost ~0.2 s, most of a small run's set-up).
    Only when the merge fails are the sources merged again one at a time, to name the one at fault.
    """
    try:
        return OmegaConf.merge(base, *(cfg for _, cfg in sources))
    except OmegaConfBaseException:
        cfg = base
        for where, src in sources:
            try:
                cfg = OmegaConf.merge(cfg, src)
            except OmegaConfBaseException as exc:
                raise wrap_error(exc, where) from None
        return cfg


def user_strategy(sources: list[tuple[str, DictConfig]]) -> tuple[Any, set[str]]:
    """What the user's sources say of the strategy, read from each without merging them: the
    ``strategy.name`` the last one to set it gives (None: none does) and every ``strategy`` key any
    of them sets. A merge would copy every source to learn two things (a fifth of a load's time);
    where the sources do not merge, the schema merge after this names the one at fault."""
    name, keys = None, set()
    for _, cfg in sources:
        section = cfg.get("strategy")
        if isinstance(section, DictConfig):
            keys.update(str(k) for k in section)
            if "name" in section:
                name = section["name"]
    return name, keys


# libyaml's emitter when PyYAML was built with it (the wheels are): the same text as the pure-Python
# SafeDumper (tests/test_config.py compares them on every shipped config) at a quarter of the cost,
# 2.9 against 12.9 ms for the tiny test config on a 2-core AMD EPYC.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def to_yaml(cfg: FlGeoConfig) -> str:
    """The config as YAML, sections and keys in schema order: `to_dict` dumped by PyYAML, the
    text ``OmegaConf.to_yaml`` gives for it (tests/test_config.py compares the two on every
    shipped config) at a small fraction of the cost (each run writes one)."""
    return yaml.dump(to_dict(cfg), Dumper=_DUMPER, sort_keys=False, allow_unicode=True, default_flow_style=False)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config or one section as plain dicts, lists and scalars (what
    ``OmegaConf.to_container(OmegaConf.structured(cfg))`` gives, without building the structured
    config: that took ~30 ms, and a run asks several times; tests/test_config.py compares both)."""
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def section_to_json(section: Any) -> str:
    """Serialise one section for a Flower ConfigRecord (whose values must be scalars)."""
    return json.dumps(to_dict(section), sort_keys=True)
