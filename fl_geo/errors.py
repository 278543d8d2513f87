"""The error types every layer may raise: bad user input and bad peer payloads.

They live in this leaf module so that the framework-free layers (``fl_geo.core``, ``fl_geo.timing``,
``fl_geo.inner``) can raise them without importing the config schema or the Flower wire codec:
``fl_geo.config`` re-exports `ConfigError` (``fl-geo`` turns it into one line and exit code 2) and
``fl_geo.runtime.wire`` re-exports `PayloadError` (a reply carrying one is rejected and counted).
"""

from __future__ import annotations

__all__ = ["ConfigError", "PayloadError", "require"]


class ConfigError(ValueError):
    """A configuration is invalid; the message says which key and why."""


class PayloadError(ValueError):
    """A payload that must not be used: wrong layout, wrong precision, truncated or non-finite."""


def require(cond: bool, msg: str) -> None:
    """Raise `ConfigError` with ``msg`` unless ``cond`` holds: the one-line form of every config
    check, shared by `fl_geo.config` and the section modules that check their own keys."""
    if not cond:
        raise ConfigError(msg)
