"""The time a component is given rather than reads: `Clock` (seconds, `time.time` in service) and `Sleep`
(`asyncio.sleep` in service). Tests pass their own, so nothing waits on real time."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

Clock = Callable[[], float]
Sleep = Callable[[float], Coroutine[Any, Any, None]]
