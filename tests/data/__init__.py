"""Recorded reference data for the tests (and the scripts that regenerate it)."""

from __future__ import annotations

import os
from pathlib import Path

from fl_geo.data.corpus import PYDOC_TOPICS_ENV

# The pydoc topics of Python 3.11.7, which every recorded number was trained on (the tiny runs use
# the ``pydoc`` corpus). A Python's own topics change between patch releases: under Debian's 3.11.2
# the bit-identity records could not be compared at all and two robustness tests' margins moved.
PYDOC_TOPICS = Path(__file__).with_name("pydoc_topics_3.11.7.json.gz")


def pin_pydoc_topics() -> None:
    """Make the ``pydoc`` corpus read `PYDOC_TOPICS` in this process and every process it starts
    (unless the caller already named a topics file)."""
    os.environ.setdefault(PYDOC_TOPICS_ENV, str(PYDOC_TOPICS))
