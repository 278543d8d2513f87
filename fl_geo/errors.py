"""The one error type every layer may raise for bad user input.

It lives in its own leaf module so that the scenario model (``fl_geo.timing``) and the inner loop
(``fl_geo.inner``) can raise it without importing the config schema: ``fl_geo.config`` re-exports it,
and ``fl-geo`` turns it into one line and exit code 2.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration is invalid; the message says which key and why."""
