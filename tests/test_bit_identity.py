"""Every method computes the same numbers as when ``tests/data/bit_identity.json`` was recorded.

Why: refactors of how ``fl-geo run`` builds strategies must not change what a method computes.
Each record is a method config, the overrides of its tiny run, float64 statistics of the final
model and, per CPU kernel fingerprint, the sha256 of its fp32 bits. This test runs the same config
with the same overrides through the function ``fl-geo run`` calls and compares:

- on every CPU, the statistics within ``statistics_rtol`` of the model's norm (CPU kernels move
  them by at most 2.7e-7 of it; a 1 % change of an outer learning rate by 1.8e-3); a method whose
  arithmetic amplifies rounding carries its own, larger tolerance in its record (Muon's bf16
  orthogonalisation: 4e-4, `make_bit_identity.METHOD_STATISTICS_RTOL`);
- where this CPU's kernel fingerprint has records, the bits too, exactly.

So the suite passes on any CPU the README supports and a change of the maths fails everywhere. A
mismatch means the arithmetic changed: if that is intended (a bug fix, a new default), regenerate
with ``tests/data/make_bit_identity.py`` and say so in the commit; otherwise fix the change.

To run the suite as a CPU nobody recorded would, set ``FL_GEO_KERNEL_FINGERPRINT=other``, or make
this CPU use other kernels (x86_64: ``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2``). The records are
skipped, saying why, only under another torch release or another pydoc text (the training text:
the tests pin Python 3.11.7's topics whichever Python runs them, tests/data/__init__.py, so only a
``FL_GEO_PYDOC_TOPICS`` set to other topics changes it), where every number changes although no
code did.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.data.kernel_fingerprint import ENV_OVERRIDE, kernel_description, kernel_fingerprint
from tests.data.make_bit_identity import (
    COMPARABLE_ON,
    RECORD,
    REPO,
    model_statistics,
    pydoc_corpus_sha256,
    run_entry,
    statistics_mismatch,
    statistics_rtol,
)

RECORDS = json.loads(RECORD.read_text(encoding="utf-8"))
METHODS = RECORDS["methods"]


@functools.cache
def _corpus_sha256() -> str:
    return pydoc_corpus_sha256()


def _platform_mismatch() -> str | None:
    """Why the records cannot be compared here at all (None when they can)."""
    here = {"torch": torch.__version__, "pydoc_corpus_sha256": _corpus_sha256()}
    diff = {k: (RECORDS[k], v) for k, v in here.items() if RECORDS[k] != v}
    if not diff:
        return None
    return "bit-identity records were taken on " + ", ".join(f"{k} {rec} (here {now})" for k, (rec, now) in diff.items())


def _exact_records() -> dict[str, str]:
    """This CPU's recorded sha256 per method (empty where its kernels were never recorded)."""
    return RECORDS["exact"].get(kernel_fingerprint(), {}).get("sha256", {})


def test_every_method_config_is_recorded():
    """A new method config needs a record (add it to METHODS in make_bit_identity.py and record it)."""
    configs = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if not p.stem.startswith("quickstart"))
    assert sorted(METHODS) == configs


def test_records_are_only_skipped_for_another_torch_or_corpus(monkeypatch):
    """Another torch skips (with both versions in the reason); another CPU does not skip."""
    monkeypatch.setitem(RECORDS, "torch", "0.0.0+other")
    reason = _platform_mismatch()
    assert reason is not None and "torch 0.0.0+other" in reason and torch.__version__ in reason
    monkeypatch.setitem(RECORDS, "torch", torch.__version__)
    monkeypatch.setitem(RECORDS, "pydoc_corpus_sha256", _corpus_sha256())
    monkeypatch.setenv(ENV_OVERRIDE, "a-cpu-nobody-recorded")
    kernel_fingerprint.cache_clear()
    try:
        assert kernel_fingerprint() == "a-cpu-nobody-recorded"
        assert _platform_mismatch() is None  # compared (by statistics), not skipped
        assert _exact_records() == {}
    finally:
        monkeypatch.delenv(ENV_OVERRIDE)
        kernel_fingerprint.cache_clear()


@pytest.mark.parametrize("method", list(METHODS))
def test_same_numbers_as_recorded(method, tmp_path):
    """The statistics within tolerance on any CPU; the bits too where this CPU's kernels were recorded."""
    reason = _platform_mismatch()
    if reason:
        pytest.skip(reason)
    rec = METHODS[method]
    got = run_entry(rec["config"], rec["overrides"], tmp_path / method)
    assert got["outer_steps"] == rec["outer_steps"], f"{method}: outer steps changed"
    assert got["numel"] == rec["numel"], f"{method}: model size changed"
    drift = statistics_mismatch(got["statistics"], rec["statistics"], statistics_rtol(RECORDS, method))
    assert not drift, (
        f"{method}: the final model's numbers changed beyond CPU rounding: {drift}; if that is intended, "
        f"regenerate with `python -m tests.data.make_bit_identity {method}` and say so in the commit"
    )
    exact = _exact_records().get(method)
    if exact is not None:
        assert got["sha256"] == exact, (
            f"{method}: the final model's bits changed on this CPU (kernels {kernel_fingerprint()}); if that is "
            f"intended, regenerate with `python -m tests.data.make_bit_identity {method}` and say so in the commit"
        )


def test_this_cpu_has_exact_records():
    """Says, as a skip, when this CPU's kernels have no exact records (the statistics still ran)."""
    if _platform_mismatch():
        pytest.skip(_platform_mismatch())
    if not _exact_records():
        recorded = ", ".join(f"{fp} ({e['cpu_capability']}, {e['cpu']})" for fp, e in RECORDS["exact"].items())
        pytest.skip(f"no exact bits recorded for this CPU's kernels {kernel_description()}; the numbers were "
                    f"compared within statistics_rtol={RECORDS['statistics_rtol']} (exact bits recorded for: {recorded}); "
                    "add them with `python -m tests.data.make_bit_identity --add-this-cpu`")
    assert set(_exact_records()) == set(METHODS)


def test_tolerance_passes_rounding_and_catches_a_changed_model():
    """Rounding-sized noise (1e-7 of each value) passes; one tenth of the weights (a layer, say) 0.1 %
    larger fails, and so does the whole model 0.1 % larger.

    A handful of linear statistics cannot see a tiny change in a random direction; what they
    must see is what a changed formula or default does, which moves whole layers (measured: a 1 %
    change of an outer learning rate moves them by 1.8e-3 of the norm)."""
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(20_000, generator=gen)
    rec = model_statistics(params)
    rounded = params * (1 + 1e-7 * torch.randn(params.shape, generator=gen))
    assert statistics_mismatch(model_statistics(rounded), rec, RECORDS["statistics_rtol"]) == []
    changed = params.clone()
    changed[:2_000] *= 1.001
    assert statistics_mismatch(model_statistics(changed), rec, RECORDS["statistics_rtol"]) != []
    assert statistics_mismatch(model_statistics(params * 1.001), rec, RECORDS["statistics_rtol"]) != []


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="ATen's avx2 kernels are x86_64's")
def test_a_run_on_other_cpu_kernels_passes_by_tolerance_not_bits():
    """A real other-CPU run: this machine forced onto its AVX2 kernels (ATen, MKL, oneDNN) rounds
    differently; its fingerprint differs from this CPU's, and DiLoCo's tiny run still matches the
    record within tolerance."""
    if _platform_mismatch():
        pytest.skip(_platform_mismatch())
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    env.pop(ENV_OVERRIDE, None)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip(f"this CPU has no AVX2 kernels ({torch.backends.cpu.get_cpu_capability()})")
    script = (
        "import json, sys, tempfile, pathlib\n"
        "from tests.data.kernel_fingerprint import kernel_fingerprint\n"
        "from tests.data.make_bit_identity import run_entry\n"
        f"rec = json.loads(pathlib.Path({str(RECORD)!r}).read_text())['methods']['diloco']\n"
        "with tempfile.TemporaryDirectory() as tmp:\n"
        "    got = run_entry(rec['config'], rec['overrides'], pathlib.Path(tmp))\n"
        "print(json.dumps({'fingerprint': kernel_fingerprint(), **got}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["fingerprint"] == kernel_fingerprint():
        pytest.skip("forcing AVX2 kernels did not change this CPU's fingerprint (it runs AVX2 kernels already)")
    assert statistics_mismatch(got["statistics"], METHODS["diloco"]["statistics"], RECORDS["statistics_rtol"]) == []
    assert got["outer_steps"] == METHODS["diloco"]["outer_steps"]


def test_record_file_is_well_formed():
    """The record names its platform, a tolerance and, per method, a config that exists, statistics
    and, per recorded CPU, 64-hex digests of methods that exist."""
    for key in ("torch", "flwr", *COMPARABLE_ON):
        assert isinstance(RECORDS[key], str) and RECORDS[key]
    assert 0 < RECORDS["statistics_rtol"] < 1e-3
    for method, rec in METHODS.items():
        assert (REPO / rec["config"]).is_file(), method
        assert rec["outer_steps"] > 0 and rec["overrides"], method
        assert rec["statistics"]["l2"] > 0 and len(rec["statistics"]["projections"]) >= 4, method
        assert 0 < statistics_rtol(RECORDS, method) < 1e-3, method
    assert RECORDS["exact"], "no CPU has exact records"
    for fingerprint, entry in RECORDS["exact"].items():
        assert len(fingerprint) == 16 and entry["cpu_capability"] and entry["machine"], fingerprint
        for method, sha in entry["sha256"].items():
            assert method in METHODS and len(sha) == 64 and int(sha, 16) >= 0, (fingerprint, method)
