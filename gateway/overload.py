"""Load shedding before work queues up: generation requests are refused at the door, in microseconds, while
the process is overloaded (as Envoy's overload manager does).

Two signals, either of which sheds:

- **in flight**: generation requests this process holds (from arrival to the response's last byte) at
  `overload.max_in_flight`;
- **event-loop lag**: how late the loop runs a callback scheduled `overload.lag_probe_interval` seconds ahead
  (`LoopLagMonitor`), at or above `overload.max_loop_lag` on each of the last `lag_window` probes. A loop
  that late delays every stream the process serves, so taking more work only makes all of it late. Lag that
  persists through the window is overload; one late probe (another process took the core for a moment) is
  not, and sheds nothing.

A shed request gets 503 `overloaded` in the OpenAI error shape with `Retry-After`, from an ASGI wrapper in
front of Litestar: its body is not read, no route, auth, quota or engine is reached. Only generation routes
are shed (`SHED_PATHS`); health, metrics, admin and audit routes always pass. `OverloadGate.shed` counts
refusals by reason for the metrics.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ErrorBody, ErrorResponse

ShedReason = Literal["in_flight", "loop_lag"]
SHED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class OverloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[overload]`: when generation requests are refused at the door."""

    # Off: nothing is shed (requests still queue in admission, bounded by its own limits).
    enabled: bool = True
    # Generation requests one process holds at once (arrival to last byte); the next one is shed.
    max_in_flight: int = 512
    # Event-loop lag, in seconds, that sheds new generation requests when every one of the last `lag_window`
    # probes measured at least that much; 0 = never shed for lag.
    max_loop_lag: float = 0.1
    # Seconds between two lag probes, and how many recent probes the lag must persist through (0.5 s of
    # sustained lag by default; a probe costs a wake-up of the loop, so not much more often than this).
    lag_probe_interval: float = 0.05
    lag_window: int = 10
    # Retry-After of a shed request, in seconds (whole seconds on the wire, at least 1).
    retry_after: float = 1.0


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
        self._interval = interval
        self._clock = clock
        self._sleep = sleep
        self._recent: deque[float] = deque([0.0], maxlen=max(1, window))

    @property
    def lag(self) -> float:
        """The lag every one of the recent probes measured at least, in seconds."""
        return min(self._recent)

    async def probe(self) -> float:
        """One probe: sleep `interval`, record how much longer it took; the lag it measured."""
        start = self._clock()
        await self._sleep(self._interval)
        lag = max(0.0, self._clock() - start - self._interval)
        self._recent.append(lag)
        return lag

    async def run(self) -> None:
        """Probe until cancelled (a lifespan task)."""
        while True:
            await self.probe()


class OverloadGate:
    """The in-flight count, the lag monitor, and what was shed, for one process."""

    def __init__(self, config: OverloadConfig, monitor: LoopLagMonitor) -> None:
        self.config = config
        self.monitor = monitor
        self.in_flight = 0
        self.shed: dict[ShedReason, int] = {"in_flight": 0, "loop_lag": 0}
        retry = str(max(1, math.ceil(config.retry_after)))
        self._headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", retry.encode()),
        ]

    def refusal(self) -> ShedReason | None:
        """Why a new generation request would be shed now (None: it is taken)."""
        if not self.config.enabled:
            return None
        if self.in_flight >= self.config.max_in_flight:
            return "in_flight"
        if 0 < self.config.max_loop_lag <= self.monitor.lag:
            return "loop_lag"
        return None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the gate: generation requests are counted, and shed while overloaded."""

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or scope["path"] not in SHED_PATHS:
                await app(scope, receive, send)
                return
            reason = self.refusal()
            if reason is not None:
                self.shed[reason] += 1
                await self._refuse(reason, send)
                return
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1

        return gated

    async def _refuse(self, reason: ShedReason, send: Send) -> None:
        what = "too many requests in flight" if reason == "in_flight" else "its event loop is running late"
        body = msgspec.json.encode(
            ErrorResponse(
                error=ErrorBody(
                    message=f"the gateway is overloaded ({what}); retry after the Retry-After delay",
                    type="service_unavailable",
                    code="overloaded",
                )
            )
        )
        headers = [*self._headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
