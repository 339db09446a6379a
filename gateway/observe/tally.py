"""Increments of prometheus_client series, counted in a plain dict and handed to the series when read.

A prometheus_client value takes a lock on every increment (`MutexValue.inc`; in multiprocess mode the file's
too), and each request makes about 30 of them (its counters, histogram buckets and sums): with the `inc`
call around it, about 0.5 us each, most of the cost of its metrics. A `Tally` adds each increment to a running
total per value instead, and `flush()` increments each value by what its total gained since the last flush.

Flushed whenever the registry is read (`Tally.collector`, registered before the series it serves, runs first
in every `registry.collect()`: a scrape, an OTLP push, a test's read), and in a worker of `lockgate serve
--workers N` every `metrics.multiprocess_interval` seconds and at its end (the merged files are read by other
processes). Safe across threads: increments come from the event loop only and write nothing but the totals;
`flush()` reads a snapshot of them (one C-level copy) under a lock of its own, so a flush from another
thread (the OTLP push) neither misses nor doubles an increment.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol


class Incrementable(Protocol):
    """A prometheus_client value (or series): what a tally hands its increments to."""

    def inc(self, amount: float) -> None:
        """Add `amount`."""


class Tally:
    """Running totals of increments per value, flushed into the values on `flush()`."""

    __slots__ = ("_flushed", "_lock", "totals")

    def __init__(self) -> None:
        # Written by the event loop only (`Observer` inlines `add`: `totals[v] = totals.get(v, 0) + a`).
        self.totals: dict[Incrementable, float] = {}
        self._flushed: dict[Incrementable, float] = {}
        self._lock = threading.Lock()

    def add(self, value: Incrementable, amount: float = 1) -> None:
        """Count `amount` more for `value` (handed over at the next flush)."""
        totals = self.totals
        totals[value] = totals.get(value, 0) + amount

    def flush(self) -> None:
        """Increment every value by what its total gained since the last flush."""
        with self._lock:
            flushed = self._flushed
            for value, total in list(self.totals.items()):
                gained = total - flushed.get(value, 0)
                if gained:
                    value.inc(gained)
                    flushed[value] = total

    @property
    def collector(self) -> _Flushing:
        """A collector with no series whose `collect()` flushes this tally: registered on a registry before
        the series the tally serves, every read of that registry sees every increment."""
        return _Flushing(self)


class _Flushing:
    def __init__(self, tally: Tally) -> None:
        self._tally = tally

    def collect(self) -> list[Any]:
        self._tally.flush()
        return []


def value_of(series: Any) -> Incrementable:
    """The value a counter series (or a histogram's bucket or sum) increments: prometheus_client's own
    `_value`, so a flush takes its lock once; the series itself where a version has no such attribute."""
    value: Incrementable | None = getattr(series, "_value", None)
    return value if value is not None and hasattr(value, "inc") else series
