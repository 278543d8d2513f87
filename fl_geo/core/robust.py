"""Bounded influence of one site on the outer step: a norm bound relative to the median.

The token cap (fl_geo.strategies.replies) bounds how much weight a site can claim; this bounds
what it can do with that weight. An update whose L2 norm is more than ``factor`` times the
median norm of its peers' updates is rejected: a site that scales its update (sign-flipped or
not) to drag the mean cannot hide behind a plausible shape and dtype. A site that sends an
update of an ordinary norm in a bad direction keeps a 1/N share of the mean at most (with the
token cap, its weight is never larger than what its job could produce).

The median needs no trust in any one site: with fewer than half of the updates hostile it lies
within the honest updates' norms. It is taken over

- a synchronous round: the norms of every valid update of the round (`median_norm_outliers`),
  so the server holds the round's replies (wire-precision views of the received messages, one
  per site) until the round is complete, instead of folding each on arrival;
- an asynchronous server: the last ``window`` valid norms (`NormWindow`), scalars only; an
  update is judged against the updates before it, then added, rejected or not, so the median
  follows the majority if honest norms drift (a learning-rate warm-up) and a hostile site
  cannot lock the window.

Below ``minimum`` norms there is no median worth the name (two sites: one of them is the
median), and the bound is not applied; the model-norm bound (``strategy.max_update_ratio``)
and the penalty still are.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

__all__ = ["NormWindow", "median_norm_outliers", "outlier_reason"]


def outlier_reason(norm: float, median: float, factor: float, count: int, where: str) -> str:
    """The logged reason of a rejection, naming the norm, the bound and where the median is from."""
    return (f"update norm {norm:.4g} is more than {factor:g} x the median norm {median:.4g} of {count} "
            f"{where} (strategy.robust=median_norm)")


def median_norm_outliers(norms: Sequence[float], factor: float, minimum: int = 3) -> dict[int, str]:
    """Indices of ``norms`` above ``factor`` × their median, with the reason; {} below ``minimum``
    finite norms. Non-finite norms are left to the caller (the fold refuses them anyway) and do
    not count towards the median."""
    finite = [n for n in norms if math.isfinite(n)]
    if len(finite) < minimum:
        return {}
    median = statistics.median(finite)
    bound = factor * median
    return {i: outlier_reason(n, median, factor, len(finite), "updates this round")
            for i, n in enumerate(norms) if math.isfinite(n) and n > bound}


class NormWindow:
    """The last ``size`` update norms of an asynchronous server and the bound they give."""

    def __init__(self, size: int, factor: float, minimum: int = 3) -> None:
        if size < minimum or factor <= 0 or minimum < 1:
            raise ValueError(f"NormWindow needs size >= minimum >= 1 and factor > 0, got {size}, {minimum}, {factor}")
        self.factor, self.minimum = factor, minimum
        self._norms: deque[float] = deque(maxlen=size)

    def judge(self, norm: float) -> str | None:
        """The reason to reject an update of this ``norm`` (None: within the bound), judged
        against the window before it; the norm then joins the window."""
        reason = None
        if len(self._norms) >= self.minimum:
            median = statistics.median(self._norms)
            if norm > self.factor * median:
                reason = outlier_reason(norm, median, self.factor, len(self._norms), "recent updates")
        if math.isfinite(norm):
            self._norms.append(norm)
        return reason

    def state_dict(self) -> list[float]:
        return list(self._norms)

    def load_state_dict(self, norms: Sequence[float]) -> None:
        self._norms.clear()
        self._norms.extend(float(n) for n in norms)
