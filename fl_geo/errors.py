"""The error types every layer may raise: bad user input and bad peer payloads.

They live in this leaf module so that the framework-free layers (``fl_geo.core``, ``fl_geo.timing``,
``fl_geo.inner``) can raise them without importing the config schema or the Flower wire codec:
``fl_geo.config`` re-exports `ConfigError` (``fl-geo`` turns it into one line and exit code 2) and
``fl_geo.runtime.wire`` re-exports `PayloadError` (a reply carrying one is rejected and counted).
"""

from __future__ import annotations

__all__ = ["ConfigError", "OutputError", "PayloadError", "require"]


class ConfigError(ValueError):
    """A configuration is invalid; the message says which key and why."""


class OutputError(ConfigError):
    """A file the run must write cannot be written (disk full, no permission) or its directory
    is taken (another run's results, another live writer). A `ConfigError` on purpose: every
    entry point that reports a bad config in one line reports these the same way, and the fix
    is the operator's (free space, another ``run.name`` / ``--out``), never a retry."""


class PayloadError(ValueError):
    """A payload that must not be used: wrong layout, wrong precision, truncated or non-finite."""


def require(cond: bool, msg: str) -> None:
    """Raise `ConfigError` with ``msg`` unless ``cond`` holds: the one-line form of every config
    check, shared by `fl_geo.config` and the section modules that check their own keys."""
    if not cond:
        raise ConfigError(msg)
