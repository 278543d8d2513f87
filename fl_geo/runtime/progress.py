"""A one-line progress display for outer rounds: round, losses, time per round and ETA.

Flower's own logs are per message and say nothing about where a run stands; researchers want to
see at a glance whether a 5-minute quickstart is at round 3 of 10 and how the loss moves. On a
terminal the line is rewritten in place; in CI logs (not a TTY) one line per round is printed.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Prints ``[name] round r/R | train x | val y | s/round | ETA`` after every round."""

    def __init__(self, name: str, total_rounds: int, enabled: bool = True, stream: TextIO | None = None):
        self.name = name
        self.total = total_rounds
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(
        self, rnd: int, train_loss: float | None = None, val_loss: float | None = None,
        fraction: float | None = None,
    ) -> str:
        """``fraction`` (0-1) overrides rnd/total for runs bounded by something else (tokens)."""
        elapsed = time.perf_counter() - self._t0
        per_round = elapsed / max(rnd, 1)
        if fraction is not None and fraction > 0:
            eta = elapsed * (1.0 - min(fraction, 1.0)) / fraction
            parts = [f"[{self.name}] step {rnd} ({100 * min(fraction, 1.0):.0f}% of the token budget)"]
        else:
            eta = per_round * (self.total - rnd)
            parts = [f"[{self.name}] round {rnd}/{self.total}"]
        if train_loss is not None:
            parts.append(f"train {train_loss:.3f}")
        if val_loss is not None:
            parts.append(f"val {val_loss:.3f}")
        parts.append(f"{per_round:.1f} s/round")
        parts.append(f"elapsed {format_duration(elapsed)}")
        parts.append(f"ETA {format_duration(eta)}")
        line = " | ".join(parts)
        if self.enabled:
            if self._tty:
                done = rnd >= self.total or (fraction is not None and fraction >= 1.0)
                end = "\n" if done else ""
                self.stream.write("\r\033[K" + line + end)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        return line
