"""Where the repository's own files are: one place instead of a ``parents[N]`` in every module.

fl-geo runs from a checkout (``pip install -e .``): the configs, scenarios and the small Flower
apps it launches live next to the package, not inside it. Modules that need them import these
names, so moving a module into another folder cannot silently point it at the wrong directory.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["APPS_DIR", "CONFIGS_DIR", "PROJECT_ROOT", "SCENARIOS_DIR"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = PROJECT_ROOT / "configs"
SCENARIOS_DIR = CONFIGS_DIR / "scenarios"
APPS_DIR = PROJECT_ROOT / "apps"
