"""Scenario files: the YAML form of `fl_geo.timing.scenario`, read and written with omegaconf.

The scenario model (``fl_geo.timing``) is plain dataclasses and arithmetic so that the clocks and
the placement search never depend on a config library. This module is the one place that turns
YAML (a file in ``configs/scenarios/``, a name looked up there, dotted overrides, or a string
shipped in a run config) into a validated `Scenario`, naming the full key path in every error.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_geo.copy_cache import CopyCache
from fl_geo.paths import SCENARIOS_DIR as _REPO_SCENARIOS
from fl_geo.timing.scenario import Scenario
from fl_geo.timing.scenario_spec import ScenarioError, ScenarioSpec
from fl_geo.yaml_safe import load_yaml

__all__ = [
    "list_scenarios",
    "load_scenario",
    "scenario_dirs",
    "scenario_from_dict",
    "scenario_from_yaml_string",
    "scenario_to_yaml",
]


# ---- reading ----------------------------------------------------------------------------------------


def _nested_type(hint: Any) -> tuple[type | None, bool]:
    """(dataclass type, is_list) for a field holding a dataclass or a list of them, else (None, False)."""
    if is_dataclass(hint):
        return hint, False  # type: ignore[return-value]
    if get_origin(hint) is list:
        (arg,) = get_args(hint)
        if is_dataclass(arg):
            return arg, True  # type: ignore[return-value]
    return None, False


def _build(cls: type, raw: Any, path: str, where: str) -> Any:
    """Build ``cls`` from plain data, naming the full key path in every error.

    omegaconf's own errors lose the path inside lists of dataclasses (``speed`` instead of
    ``nodes[3].speed``), so keys are checked here and only scalar fields go through omegaconf's
    type conversion, one dataclass at a time.
    """
    names = [f.name for f in fields(cls)]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ScenarioError(
            f"{where}: '{path.rstrip('.') or 'top level'}' must be a mapping with keys {', '.join(names)}; "
            f"got {type(raw).__name__}"
        )
    hints = get_type_hints(cls)
    scalars: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ScenarioError(
                f"{where}: unknown key '{path}{key}'{hint}; valid keys here: {', '.join(names)}"
            )
        sub, is_list = _nested_type(hints[key])
        if sub is None:
            scalars[key] = value
        elif is_list:
            value = [] if value is None else value
            if not isinstance(value, list):
                raise ScenarioError(f"{where}: '{path}{key}' must be a list, got {type(value).__name__}")
            nested[key] = [_build(sub, item, f"{path}{key}[{i}].", where) for i, item in enumerate(value)]
        else:
            nested[key] = _build(sub, value, f"{path}{key}.", where)
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(_structured(cls), OmegaConf.create(scalars)))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ScenarioError(f"{where}: invalid value for '{path}{key}': {first}") from None
    for key, value in nested.items():
        setattr(obj, key, value)
    return obj


@functools.cache
def _structured(cls: type) -> Any:
    """The struct-mode omegaconf schema of one scenario dataclass, built once per process (a
    scenario builds one per node, link window and section). Shared: only ever the first argument
    of ``OmegaConf.merge``, which copies it; never modified."""
    base = OmegaConf.structured(cls)
    OmegaConf.set_struct(base, True)
    return base


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def scenario_from_dict(data: dict[str, Any], source: str = "scenario", name: str = "") -> Scenario:
    """Validate plain data (as parsed from YAML) into a :class:`Scenario`.

    ``name`` fills in the scenario name when the data does not set one (the file stem).
    """
    spec: ScenarioSpec = _build(ScenarioSpec, data, "", source)
    if not spec.name:
        spec.name = name
    return Scenario(spec, source)


def scenario_to_yaml(scenario: Scenario) -> str:
    """YAML that :func:`scenario_from_yaml_string` turns back into this scenario."""
    return OmegaConf.to_yaml(OmegaConf.structured(scenario.spec))


def scenario_from_yaml_string(text: str, source: str = "scenario") -> Scenario:
    """Rebuild a scenario from :func:`scenario_to_yaml` output (e.g. shipped in a run config)."""
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    except OmegaConfBaseException as exc:
        raise ScenarioError(f"{source}: not valid YAML: {exc}") from None
    return scenario_from_dict(data, source)  # type: ignore[arg-type]


def scenario_dirs() -> list[Path]:
    """Where scenario names are looked up: ``./configs/scenarios``, then the repository's."""
    dirs = [Path.cwd() / "configs" / "scenarios", _REPO_SCENARIOS]
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def list_scenarios() -> list[str]:
    """Names of the scenarios found in :func:`scenario_dirs`."""
    return sorted({p.stem for d in scenario_dirs() for p in d.glob("*.yaml")})


def _resolve(path_or_name: str | Path) -> Path:
    p = Path(path_or_name)
    if p.is_file():
        return p
    looks_like_path = isinstance(path_or_name, Path) or len(p.parts) > 1
    if not looks_like_path:  # a name: 'halos_4x4' or 'halos_4x4.yaml'
        for d in scenario_dirs():
            cand = d / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
            if cand.is_file():
                return cand
        where = ", ".join(str(d) for d in scenario_dirs()) or "configs/scenarios"
        raise ScenarioError(
            f"scenario '{path_or_name}' not found in {where}; available: {', '.join(list_scenarios()) or 'none'}"
        )
    raise ScenarioError(f"scenario file not found: {p}")


# Validating a scenario builds and merges an omegaconf schema per node, link window and section
# (27-100 ms for the shipped files on a 2-core machine), and a run loads its scenario more than once
# (the clock, wall faults, placement); sweeps, seed groups and tests load the same few files again.
# A load with the same resolved file, text and overrides gets a copy of the scenario built before.
_cache: CopyCache[Scenario] = CopyCache(64)


def load_scenario(path_or_name: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Load a scenario by file path or by name (``configs/scenarios/<name>.yaml``).

    ``overrides`` are dotted ``key=value`` items applied on top of the file, e.g.
    ``heterogeneity.eta_percent=50`` or ``model.step_time_s=0.623`` (list-valued keys are
    replaced whole: ``links.bandwidth_gbps=[[100.0]]``).

    Each call returns a scenario of its own: where the same file (same text) and overrides were
    loaded before, a copy of that one (validation reads nothing but these inputs).
    """
    path = _resolve(path_or_name)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read scenario YAML: {exc}") from None
    key = (str(path), str(path.resolve()), text, tuple(str(o) for o in overrides or ()))
    if (hit := _cache.get(key)) is not None:
        return hit
    scenario = _parse_scenario(path, text, overrides)
    _cache.put(key, scenario)
    return scenario


def _parse_scenario(path: Path, text: str, overrides: list[str] | None) -> Scenario:
    # plain data only: a !!python tag, a key given twice or bad syntax is one line naming the line
    data = load_yaml(text, str(path), ScenarioError)
    if data is None:
        raise ScenarioError(f"{path}: the scenario file is empty; it needs at least regions, nodes, "
                            "links.bandwidth_gbps and model.step_time_s")
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario file must be a mapping of keys, got {type(data).__name__}")
    for item in overrides or []:
        if "=" not in item:
            raise ScenarioError(
                f"scenario override '{item}' is not of the form key=value (e.g. heterogeneity.eta_percent=50)"
            )
        try:
            extra = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=True)
        except OmegaConfBaseException as exc:
            raise ScenarioError(f"scenario override '{item}': {exc}") from None
        data = _deep_merge(data, extra)  # type: ignore[arg-type]
    source = f"{path} with overrides {' '.join(overrides)}" if overrides else str(path)
    return scenario_from_dict(data, source, name=path.stem)  # type: ignore[arg-type]
