"""The adaptive concurrency limit: a gradient controller on latency (the `concurrency` signal)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from gateway.overload.config import OverloadConfig
from gateway.quantile import nearest_rank

# How far one update may move the adaptive limit (Envoy's bounds): at most halved, at most doubled.
MIN_GRADIENT = 0.5
MAX_GRADIENT = 2.0


class ConcurrencyLimit:
    """The adaptive in-flight limit for generation requests: a gradient controller on latency.

    Latency runs from a request's arrival at the door to the end of its response, or for a stream to its
    first body byte (a long generation is not latency). Every `sample_interval` s (checked as requests
    complete), the `latency_percentile` of the requests completed since the last update is the *sample*, and

        limit = clamp(limit * gradient + sqrt(limit), min_limit, max_in_flight)
        gradient = clamp(min_rtt * (1 + latency_tolerance) / sample, 0.5, 2)

    The limit only rises when at least half of it was used in the interval (an idle process does not earn a
    limit it never tested). The baseline `min_rtt` is the same percentile over the last `min_rtt_requests`
    *uncontended* requests, those that arrived with fewer than `min_limit` others in flight (Envoy measures
    it with the limit pinned at its floor; sampling the requests that had as little company measures the
    same thing without refusing anyone for it), re-measured every `min_rtt_interval` s. While the process is
    overloaded no request is uncontended, so the baseline keeps its last value instead of creeping up with
    the queue. Until a baseline exists the limit is `max_in_flight`.
    """

    def __init__(self, config: OverloadConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self.limit = config.max_in_flight
        self.min_rtt: float | None = None
        self._samples: list[float] = []
        self._uncontended: deque[float] = deque(maxlen=max(1, config.min_rtt_requests))
        self._interval_start = clock()
        self._next_min_rtt = self._interval_start
        self._peak = 0  # the most in flight during the current interval

    def admitted(self, in_flight: int) -> None:
        """A request was taken; `in_flight` now counts it."""
        self._peak = max(self._peak, in_flight)

    def completed(self, latency: float, company: int) -> None:
        """A request's latency point was reached `latency` s after its arrival, where it found `company`
        others in flight; the limit is updated once per `sample_interval`."""
        self._samples.append(latency)
        if company < self._config.min_limit:
            self._uncontended.append(latency)
        now = self._clock()
        if now - self._interval_start >= self._config.sample_interval:
            self._update(now)

    def _update(self, now: float) -> None:
        config = self._config
        full = len(self._uncontended) == self._uncontended.maxlen
        if full and now >= self._next_min_rtt:
            self.min_rtt = nearest_rank(self._uncontended, config.latency_percentile)
            self._uncontended.clear()
            self._next_min_rtt = now + config.min_rtt_interval
        if self.min_rtt is not None:
            sample = nearest_rank(self._samples, config.latency_percentile)
            target = self.min_rtt * (1 + config.latency_tolerance)
            gradient = min(MAX_GRADIENT, max(MIN_GRADIENT, target / max(sample, 1e-9)))
            # Under half the limit used: it was not what held requests back, nothing is learnt about a
            # higher one (and an idle process would otherwise climb to the ceiling).
            if gradient < 1 or 2 * self._peak >= self.limit:
                proposed = self.limit * gradient + math.sqrt(self.limit)
                # Invariant: min_limit <= limit <= max_in_flight after every update.
                self.limit = max(config.min_limit, min(config.max_in_flight, int(proposed)))
        self._samples.clear()
        self._interval_start = now
        self._peak = 0
