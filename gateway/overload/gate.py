"""`OverloadGate`: the ASGI wrapper that refuses generation requests while any signal says overload."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, HTTPResponseStartEvent, Message, Receive, Scope, Send

from gateway.errors import ErrorBody, ErrorResponse, retry_after_headers
from gateway.overload.config import OverloadConfig
from gateway.overload.cpu import CpuShedder
from gateway.overload.lag import LoopLagMonitor
from gateway.overload.limit import ConcurrencyLimit
from gateway.requestid import assign_request_id, stamp

ShedReason = Literal["concurrency", "cpu", "in_flight", "loop_lag"]
SHED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

_REFUSALS: dict[ShedReason, str] = {
    "concurrency": "more requests in flight than it is serving without queueing",
    "cpu": "its CPU is saturated",
    "in_flight": "too many requests in flight",
    "loop_lag": "its event loop is running late",
}


class OverloadGate:
    """The in-flight count, the adaptive limit, the lag monitor, the CPU signal, and what was shed, for one
    process. Time is `clock` (the monitor's unless given); the CPU signal is `cpu` (one on the process's own
    CPU clocks unless given), sampled after each of the monitor's probes when `cpu_shedding` is true; with
    "auto" the app's lifespan turns it on (`use_cpu_signal`) once it knows every engine is remote."""

    def __init__(
        self,
        config: OverloadConfig,
        monitor: LoopLagMonitor,
        clock: Callable[[], float] | None = None,
        cpu: CpuShedder | None = None,
    ) -> None:
        self.config = config
        self.monitor = monitor
        self.clock = clock or monitor.clock
        self.limit = ConcurrencyLimit(config, self.clock) if config.adaptive else None
        self.cpu: CpuShedder | None = None
        if config.cpu_shedding is True:
            self.use_cpu_signal(cpu)
        self.in_flight = 0
        self.shed: dict[ShedReason, int] = {"concurrency": 0, "cpu": 0, "in_flight": 0, "loop_lag": 0}
        retry = retry_after_headers(config.retry_after)["Retry-After"].encode()
        # Each reason's answer, built once: a refusal is two sends.
        self._refusals = {reason: _refusal(why, retry) for reason, why in _REFUSALS.items()}

    def use_cpu_signal(self, cpu: CpuShedder | None = None) -> None:
        """Shed by the CPU signal from now on (`cpu`, else one on the process's own CPU clocks), sampled
        after each of the monitor's probes; once on, it stays on."""
        if self.cpu is None:
            self.cpu = cpu or CpuShedder(self.config, self.clock)
            self.monitor.after_probe.append(self.cpu.sample)

    def refusal(self) -> ShedReason | None:
        """Why a new generation request is shed (None: it is taken). Called once per arrival: the CPU
        signal sheds a fraction of the arrivals it is asked about."""
        if not self.config.enabled:
            return None
        if self.in_flight >= self.config.max_in_flight:
            return "in_flight"
        if self.limit is not None and self.in_flight >= self.limit.limit:
            return "concurrency"
        if 0 < self.config.max_loop_lag <= self.monitor.lag:
            return "loop_lag"
        if self.cpu is not None and self.cpu.shed():
            return "cpu"
        return None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` behind the gate: generation requests are counted, timed, and shed while overloaded."""

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or scope["path"] not in SHED_PATHS:
                await app(scope, receive, send)
                return
            reason = self.refusal()
            if reason is not None:
                self.shed[reason] += 1
                await self._refuse(reason, scope, send)
                return
            if self.limit is None:
                await self._held(app, scope, receive, send)
            else:
                await self._held(app, scope, receive, _Timed(self.limit, self.clock, self.in_flight, send))

        return gated

    async def _held(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        self.in_flight += 1
        if self.limit is not None:
            self.limit.admitted(self.in_flight)
        try:
            await app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, reason: ShedReason, scope: Scope, send: Send) -> None:
        headers, body = self._refusals[reason]
        start: HTTPResponseStartEvent = {"type": "http.response.start", "status": 503, "headers": headers}
        stamp(start, assign_request_id(scope))
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})


def _refusal(why: str, retry_after: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of a 503 `overloaded` answer, saying `why`."""
    body = msgspec.json.encode(
        ErrorResponse(
            error=ErrorBody(
                message=f"the gateway is overloaded ({why}); retry after the Retry-After delay",
                type="service_unavailable",
                code="overloaded",
            )
        )
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"retry-after", retry_after),
        (b"content-length", str(len(body)).encode()),
    ]
    return headers, body


class _Timed:
    """A request's `send`, which reports its latency to the limit once: at the first body byte of a stream
    (`text/event-stream`), at the last one of anything else."""

    __slots__ = ("_arrived", "_clock", "_company", "_limit", "_send", "_stream")

    def __init__(self, limit: ConcurrencyLimit, clock: Callable[[], float], company: int, send: Send) -> None:
        self._limit: ConcurrencyLimit | None = limit
        self._clock = clock
        self._company = company
        self._send = send
        self._stream = False
        self._arrived = clock()

    async def __call__(self, message: Message) -> None:
        await self._send(message)
        if self._limit is None:
            return
        if message["type"] == "http.response.start":
            self._stream = any(
                name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                for name, value in message.get("headers", ())
            )
        elif message["type"] == "http.response.body" and (
            (self._stream and message.get("body")) or not message.get("more_body", False)
        ):
            self._limit.completed(self._clock() - self._arrived, self._company)
            self._limit = None
