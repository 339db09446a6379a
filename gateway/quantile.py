"""The one percentile definition of the gateway's own figures (the adaptive limit's latency sample, the
console's score spreads) and of the benches that report alike: nearest rank."""

from __future__ import annotations

import math
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-1) of `values`: the smallest value with at least a fraction `q` of
    them at or below it (the lowest value for q = 0); 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
