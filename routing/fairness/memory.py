"""`MemoryCounters`: shared virtual token counters of gateway processes in one Python process (tests and
the fairness benchmark), the contract the Redis store is held to."""

from __future__ import annotations

from collections.abc import Sequence

from routing.fairness.base import CounterUpdate


class MemoryCounters:
    """Counters per (queue, tenant) in a dict (`routing.fairness.base`)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, str], float] = {}

    async def sync(self, queue: str, updates: Sequence[CounterUpdate]) -> list[float]:
        out = []
        for update in updates:
            key = (queue, update.tenant)
            value = max(self._counters.get(key, 0.0) + update.delta, update.floor)
            self._counters[key] = value
            out.append(value)
        return out

    async def close(self) -> None:
        return None
