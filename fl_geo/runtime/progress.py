"""A one-line progress display for outer rounds: round, losses, virtual time, time per round and ETA.

Flower's own logs are per message and say nothing about where a run stands; researchers want to
see at a glance whether a 5-minute quickstart is at round 3 of 10 and how the loss moves. On a
terminal the line is rewritten in place; in CI logs (not a TTY) one line per round is printed.
"""

from __future__ import annotations

import math
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
    """Prints ``[name] round r/R | train x | val y | virtual t | s/round | elapsed | ETA`` per round.

    ``train x`` is shown only when the step's replies reported a training loss (a plain Flower
    ClientApp need not: its step's ``train/loss`` is NaN, and the field is left out).

    The ETA follows whichever budget ends the run first: ``total_rounds`` outer rounds or
    ``max_tokens`` tokens (``run.max_tokens``; 0 = no token budget). A run on a virtual clock also
    shows how much modelled time has passed.
    """

    def __init__(self, name: str, total_rounds: int, enabled: bool = True, stream: TextIO | None = None,
                 max_tokens: int = 0):
        self.name = name
        self.total = total_rounds
        self.max_tokens = max_tokens
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._t0 = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(
        self, rnd: int, train_loss: float | None = None, val_loss: float | None = None,
        fraction: float | None = None, *, tokens: int | None = None, virtual_s: float | None = None,
    ) -> str:
        """One line for round ``rnd``. ``fraction`` (0-1), when given, is how much of the run is
        done (a loop that knows better); otherwise it is the larger of rnd/total and
        tokens/max_tokens."""
        elapsed = time.perf_counter() - self._t0
        per_round = elapsed / max(rnd, 1)
        by_tokens = tokens / self.max_tokens if self.max_tokens and tokens is not None else 0.0
        if fraction is None:
            fraction = max(rnd / self.total if self.total else 0.0, by_tokens)
        fraction = min(max(fraction, 0.0), 1.0)
        head = f"[{self.name}] round {rnd}/{self.total}"
        if by_tokens and by_tokens * self.total >= rnd:  # the token budget is the one that ends the run
            head += f" ({100 * min(by_tokens, 1.0):.0f}% of {self.max_tokens:,} tokens)"
        parts = [head]
        if train_loss is not None and math.isfinite(train_loss):  # NaN: no reply of the step carried a loss
            parts.append(f"train {train_loss:.3f}")
        if val_loss is not None:
            parts.append(f"val {val_loss:.3f}")
        if virtual_s is not None and math.isfinite(virtual_s):
            parts.append(f"virtual {format_duration(virtual_s)}")
        parts.append(f"{per_round:.1f} s/round")
        parts.append(f"elapsed {format_duration(elapsed)}")
        eta = elapsed * (1.0 - fraction) / fraction if fraction > 0 else float("inf")
        parts.append(f"ETA {format_duration(eta) if math.isfinite(eta) else '?'}")
        line = " | ".join(parts)
        if self.enabled:
            if self._tty:
                end = "\n" if fraction >= 1.0 else ""
                self.stream.write("\r\033[K" + line + end)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        return line
