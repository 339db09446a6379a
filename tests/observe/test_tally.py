"""Increments counted in a `Tally` reach their series at every read of the registry, exactly once each, also
when another thread flushes while the event loop's thread counts."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.observe.tally import Tally, value_of


def test_every_read_of_the_registry_sees_every_increment_once() -> None:
    registry = CollectorRegistry()
    tally = Tally()
    registry.register(tally.collector)
    counter = Counter("hits", "hits", ("route",), registry=registry)
    histogram = Histogram("wait", "wait", buckets=(0.1, 1.0), registry=registry)
    hits = value_of(counter.labels("/a"))
    for _ in range(3):
        tally.add(hits)
    tally.add(value_of(histogram._sum), 0.25)
    assert registry.get_sample_value("hits_total", {"route": "/a"}) == 3
    assert registry.get_sample_value("wait_sum") == 0.25
    # Read again: nothing is handed over twice; a later increment is.
    assert registry.get_sample_value("hits_total", {"route": "/a"}) == 3
    tally.add(hits, 2)
    assert registry.get_sample_value("hits_total", {"route": "/a"}) == 5


def test_a_flush_from_another_thread_neither_misses_nor_doubles_an_increment() -> None:
    registry = CollectorRegistry()
    counter = Counter("hits", "hits", registry=registry)
    tally = Tally()
    hits = value_of(counter)
    done = threading.Event()
    flushes = 0

    def flusher() -> None:
        nonlocal flushes
        while not done.is_set():
            tally.flush()
            flushes += 1

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for _ in range(200_000):
            tally.add(hits)
    finally:
        done.set()
        thread.join()
    tally.flush()
    assert flushes > 1  # the flushes did overlap the counting
    assert registry.get_sample_value("hits_total") == 200_000


def test_a_series_without_a_value_of_its_own_is_incremented_itself() -> None:
    class Plain:
        def __init__(self) -> None:
            self.total = 0.0

        def inc(self, amount: float) -> None:
            self.total += amount

    series = Plain()
    tally = Tally()
    assert value_of(series) is series
    tally.add(series, 1.5)
    tally.flush()
    tally.flush()
    assert series.total == 1.5
