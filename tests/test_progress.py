"""The progress line: its ETA follows whichever budget ends the run first, and it shows virtual time."""

from __future__ import annotations

import io

import pytest

from fl_geo.runtime import progress as progress_module
from fl_geo.runtime.progress import Progress, format_duration


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """perf_counter under the test's control: set now[0] to move time."""
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    return now


def test_eta_from_rounds(clock: list[float]) -> None:
    p = Progress("r", 10, stream=io.StringIO())
    clock[0] = 20.0
    line = p.update(2, 3.0, 2.5)
    assert line == "[r] round 2/10 | train 3.000 | val 2.500 | 10.0 s/round | elapsed 20s | ETA 1m20s"


def test_eta_from_the_token_budget_when_it_ends_the_run_first(clock: list[float]) -> None:
    # The reported case: "round 2/1000 ... ETA 13h48m" for a run the token budget ends after 8 rounds.
    p = Progress("r", 1000, stream=io.StringIO(), max_tokens=8_000)
    clock[0] = 100.0
    line = p.update(2, tokens=2_000)
    assert "round 2/1000 (25% of 8,000 tokens)" in line and line.endswith("ETA 5m00s")
    # the rounds end first: no token share in the head, the ETA follows the rounds
    clock[0] = 0.0
    p = Progress("r", 4, stream=io.StringIO(), max_tokens=1_000_000)
    clock[0] = 100.0
    line = p.update(2, tokens=2_000)
    assert line.startswith("[r] round 2/4 |") and line.endswith("ETA 1m40s")


def test_virtual_time_is_shown_and_a_finished_line_ends(clock: list[float]) -> None:
    out = io.StringIO()
    p = Progress("r", 2, stream=out)
    clock[0] = 4.0
    line = p.update(2, virtual_s=3725.0)
    assert "| virtual 1h02m |" in line and line.endswith("ETA 0s")
    assert out.getvalue() == line + "\n"  # not a TTY: one line per round
    assert "virtual" not in p.update(2, virtual_s=None) and "virtual" not in p.update(2, virtual_s=float("nan"))


def test_explicit_fraction_wins_and_zero_progress_has_no_eta(clock: list[float]) -> None:
    p = Progress("r", 10, stream=io.StringIO(), enabled=False)
    clock[0] = 30.0
    assert p.update(1, fraction=0.5).endswith("ETA 30s")
    assert p.update(0).endswith("ETA ?")


def test_format_duration() -> None:
    assert [format_duration(s) for s in (-1, 59, 61, 3599, 3600, 90_000)] == ["0s", "59s", "1m01s", "59m59s",
                                                                              "1h00m", "25h00m"]
