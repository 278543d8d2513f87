"""Every method gives the same bits as when ``tests/data/bit_identity.json`` was recorded.

Why: refactors of how ``fl-geo run`` builds strategies must not change what a method computes,
not even in the last bit. Each record is a method config, the overrides of its tiny run and the
sha256 of the final fp32 flat model; this test runs the same config with the same overrides
through the function ``fl-geo run`` calls and compares. A mismatch means the arithmetic changed:
if that is intended (a bug fix, a new default), regenerate with ``tests/data/make_bit_identity.py``
and say so in the commit; otherwise fix the change.

Float kernels may differ across torch builds and CPU architectures, and the tiny runs train on the
Python release's pydoc topics, so the records are only checked on the torch version, machine and
pydoc corpus they were taken on (skipped elsewhere, saying why).
"""

from __future__ import annotations

import functools
import json
import platform
from pathlib import Path

import pytest
import torch

from tests.data.make_bit_identity import RECORD, REPO, pydoc_corpus_sha256, run_entry

RECORDS = json.loads(RECORD.read_text(encoding="utf-8"))
METHODS = RECORDS["methods"]


@functools.cache
def _corpus_sha256() -> str:
    return pydoc_corpus_sha256()


def _platform_mismatch() -> str | None:
    """Why the records cannot be compared here (None when they can)."""
    here = {"torch": torch.__version__, "machine": platform.machine(), "pydoc_corpus_sha256": _corpus_sha256()}
    diff = {k: (RECORDS[k], v) for k, v in here.items() if RECORDS[k] != v}
    if not diff:
        return None
    return "bit-identity records were taken on " + ", ".join(f"{k} {rec} (here {now})" for k, (rec, now) in diff.items())


def test_every_method_config_is_recorded():
    """A new method config needs a record (add it to METHODS in make_bit_identity.py and record it)."""
    configs = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if not p.stem.startswith("quickstart"))
    assert sorted(METHODS) == configs


def test_records_are_only_compared_on_their_platform(monkeypatch):
    """Another torch or CPU skips (with both versions in the reason) instead of failing."""
    monkeypatch.setitem(RECORDS, "torch", "0.0.0+other")
    reason = _platform_mismatch()
    assert reason is not None and "torch 0.0.0+other" in reason and torch.__version__ in reason
    monkeypatch.setitem(RECORDS, "torch", torch.__version__)
    monkeypatch.setitem(RECORDS, "machine", "riscv128")
    assert "machine riscv128" in (_platform_mismatch() or "")


@pytest.mark.parametrize("method", list(METHODS))
def test_same_bits_as_recorded(method, tmp_path):
    reason = _platform_mismatch()
    if reason:
        pytest.skip(reason)
    rec = METHODS[method]
    got = run_entry(rec["config"], rec["overrides"], tmp_path / method)
    assert got["outer_steps"] == rec["outer_steps"], f"{method}: outer steps changed"
    assert got["numel"] == rec["numel"], f"{method}: model size changed"
    assert got["sha256"] == rec["sha256"], (
        f"{method}: the final model's bits changed; if that is intended, regenerate with "
        f"`python -m tests.data.make_bit_identity {method}` and say so in the commit"
    )


def test_record_file_is_well_formed():
    """The record names its platform and, per method, a config that exists and a 64-hex digest."""
    for key in ("torch", "machine", "flwr", "pydoc_corpus_sha256"):
        assert isinstance(RECORDS[key], str) and RECORDS[key]
    for method, rec in METHODS.items():
        assert (REPO / rec["config"]).is_file(), method
        assert len(rec["sha256"]) == 64 and int(rec["sha256"], 16) >= 0, method
        assert rec["outer_steps"] > 0 and rec["overrides"], method
        assert Path(rec["config"]).stem == method
