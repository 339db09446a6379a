"""Event-loop lag, probed on the loop (the `loop_lag` signal; the CPU signal samples after each probe)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable


class LoopLagMonitor:
    """Event-loop lag: how late a callback runs, probed every `interval` s; `lag` is what persisted through
    the last `window` probes (the smallest of them). `clock` and `sleep` are the loop's, injected so tests
    can drive lag by hand."""

    def __init__(
        self,
        interval: float,
        window: int,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.clock = clock
        self._interval = interval
        self._sleep = sleep
        self._recent: deque[float] = deque([0.0], maxlen=max(1, window))
        # Called on the loop after each probe (the CPU signal samples its clocks there, on the loop thread).
        self.after_probe: list[Callable[[], None]] = []

    @property
    def lag(self) -> float:
        """The lag every one of the recent probes measured at least, in seconds."""
        return min(self._recent)

    async def probe(self) -> float:
        """One probe: sleep `interval`, record how much longer it took; the lag it measured."""
        start = self.clock()
        await self._sleep(self._interval)
        lag = max(0.0, self.clock() - start - self._interval)
        self._recent.append(lag)
        for hook in self.after_probe:
            hook()
        return lag

    async def run(self) -> None:
        """Probe until cancelled (a lifespan task)."""
        while True:
            await self.probe()
