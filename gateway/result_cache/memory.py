"""Answers in this process: least recently used first out past `max_bytes`, expiry on the injected clock."""

from __future__ import annotations

from collections import OrderedDict

from policy.clock import Clock


class MemoryResultStore:
    """`ResultStore` in an ordered dict, at most `max_bytes` of values, each kept `ttl` seconds of `clock`."""

    def __init__(self, clock: Clock, *, ttl: float, max_bytes: int) -> None:
        self._clock = clock
        self._ttl = ttl
        self._max_bytes = max_bytes
        self._values: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    async def get(self, key: str) -> bytes | None:
        """See `ResultStore.get` (a hit becomes the most recently used)."""
        found = self._values.get(key)
        if found is None:
            return None
        expires_at, value = found
        if expires_at <= self._clock():
            self._drop(key)
            return None
        self._values.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes) -> None:
        """See `ResultStore.put`; a value larger than the whole store is not kept."""
        if key in self._values:
            self._drop(key)
        if len(value) > self._max_bytes:
            return
        while self._values and self.bytes + len(value) > self._max_bytes:
            self._drop(next(iter(self._values)))
        self._values[key] = (self._clock() + self._ttl, value)
        self.bytes += len(value)

    def _drop(self, key: str) -> None:
        _, value = self._values.pop(key)
        self.bytes -= len(value)

    async def aclose(self) -> None:
        """Nothing to release."""
