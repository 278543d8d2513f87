"""The one YAML reader for user files (run configs, scenario files): plain data, no surprises.

PyYAML's ``safe_load`` already refuses ``!!python/...`` tags (no object construction), but it
silently keeps the *last* of two equal keys in a mapping: a config that sets ``run.rounds``
twice runs with whichever came last, and a long sweep file can hide that for weeks. This
module's loader is ``yaml.SafeLoader`` plus a check that refuses duplicate keys, naming the key
and both lines. Errors are `fl_geo.errors.ConfigError` (or the subclass the caller passes) with
the file, line and column, so the CLI prints one line and exits 2.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

from fl_geo.errors import ConfigError

__all__ = ["load_yaml"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(yaml.YAMLError):
    """A mapping holds one key twice (raised by the loader, turned into a ConfigError)."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate mapping keys (merge keys ``<<`` may be overridden,
    as YAML's merge semantics intend)."""


def _construct_mapping(loader: _StrictLoader, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping below reports it
            continue
        line = key_node.start_mark.line + 1
        if first is not None:
            raise _DuplicateKey(key, line, first)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# Scalars resolve as omegaconf's own loader resolves them (what OmegaConf.load gave before): YAML
# 1.2 floats (``1e-3`` is a float, not the string YAML 1.1 makes of it) and no timestamps (a
# date-like run name stays a string).
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _StrictLoader.yaml_implicit_resolvers.items()
}

MAX_NODES = 100_000  # values in a document, aliases counted each time they are used


def _count_nodes(value: Any, limit: int) -> int:
    """Values in ``value`` with every alias expanded, stopping once past ``limit`` (an alias
    "bomb" nests references so that copying the data, as omegaconf does, explodes)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        total += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def load_yaml(text: str, where: str, error: type[ConfigError] = ConfigError) -> Any:
    """Parse ``text`` (the contents of ``where``) as plain YAML data.

    Raises ``error`` (a `ConfigError`) for a syntax error (with line and column), a tag that
    would build an object (``!!python/...``, any tag SafeLoader does not know), or a key given
    twice in one mapping (naming the key and both lines). Returns whatever the document holds:
    ``None`` for an empty file, so callers decide whether that is allowed. A document of more
    than `MAX_NODES` values once aliases are expanded is refused too."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except _DuplicateKey as exc:
        raise error(f"{where}: key {exc.key!r} appears twice in one mapping (line {exc.first_line} and line "
                    f"{exc.line}); YAML would silently keep the last one, so remove one of them") from None
    except ConstructorError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or str(exc).splitlines()[0]
        if "tag" in problem:
            raise error(f"{where}: YAML tag refused{at} ({problem}): config files hold plain data only "
                        "(mappings, lists, strings, numbers, booleans)") from None
        raise error(f"{where}: not valid YAML{at}: {problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise error(f"{where}: not valid YAML{at}: {problem}") from None
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise error(f"{where}: more than {MAX_NODES} values once YAML aliases are expanded; a config is "
                    "a few hundred")
    return data
