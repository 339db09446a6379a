"""Arrival times of an open-loop load: seeded and pure, in seconds from the start of the run."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from ops.bench.load.workload import Arrival


def _bursts(arrival: Arrival, rng: random.Random) -> Iterator[list[float]]:
    """Bursts in order of their start. Poisson: bursts of one request at `rate`. Bursty: `burst_size`
    requests spread evenly over `burst_spread` seconds, bursts Poisson at `rate / burst_size`, so the mean
    rate stays `rate`."""
    size = 1 if arrival.process == "poisson" else arrival.burst_size
    step = 0.0 if size == 1 else arrival.burst_spread / size
    start = 0.0
    while True:
        start += rng.expovariate(arrival.rate / size)
        yield [start + i * step for i in range(size)]


def arrival_times(
    arrival: Arrival, rng: random.Random, *, count: int | None = None, duration: float | None = None
) -> list[float]:
    """The first `count` arrivals, or those before `duration` seconds (both bound the list when both are
    given), sorted."""
    if count is None and duration is None:
        raise ValueError("arrival_times needs a count or a duration")
    end = math.inf if duration is None else duration
    times: list[float] = []
    for burst in _bursts(arrival, rng):
        # Bursts may overlap when the spread exceeds the gap between them, but no later burst starts before
        # this one: once it starts past the bound, the list is complete.
        if burst[0] >= end:
            break
        if count is not None and len(times) >= count and burst[0] >= sorted(times)[count - 1]:
            break
        times.extend(t for t in burst if t < end)
    times.sort()
    return times if count is None else times[:count]
