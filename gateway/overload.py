"""Load shedding before work queues up: generation requests are refused at the door, in microseconds, while
the process is overloaded (as Envoy's overload manager and adaptive concurrency filter do).

Four signals, any of which sheds:

- **concurrency** (`overload.adaptive`): generation requests in flight at the adaptive limit
  (`ConcurrencyLimit`), a gradient controller after Envoy's adaptive concurrency filter and Netflix's
  gradient2: every `sample_interval` s the limit is scaled by how the recent latency compares with the
  baseline, so that it settles where requests stop queueing inside the process;
- **in flight**: generation requests this process holds (from arrival to the response's last byte) at
  `overload.max_in_flight`, the static ceiling of the adaptive limit;
- **event-loop lag**: how late the loop runs a callback scheduled `overload.lag_probe_interval` seconds ahead
  (`LoopLagMonitor`), at or above `overload.max_loop_lag` on each of the last `lag_window` probes. A loop
  that late delays every stream the process serves, so taking more work only makes all of it late. Lag that
  persists through the window is overload; one late probe (another process took the core for a moment) is
  not, and sheds nothing;
- **CPU** (`overload.cpu_shedding`): a fraction of new generation requests, set by `CpuShedder` (after
  Envoy's CPU utilisation resource monitor) so that the process's CPU utilisation stays at
  `target_utilisation`. A process past saturation queues work *before* the wrapper (socket buffers, the
  server's parsing, the loop's ready queue, threads competing for the core), where neither the in-flight
  count nor latency measured from the wrapper see it, and the loop's lag stays small; refusing enough
  requests to keep the CPU just below saturation keeps that queue from forming, so refusals are quick and
  the admitted do not wait.

A shed request gets 503 `overloaded` in the OpenAI error shape with `Retry-After`, from an ASGI wrapper in
front of Litestar: its body is not read, no route, auth, quota or engine is reached. Only generation routes
are shed (`SHED_PATHS`); health, metrics, admin and audit routes always pass. `OverloadGate.shed` counts
refusals by reason for the metrics.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ErrorBody, ErrorResponse

ShedReason = Literal["concurrency", "cpu", "in_flight", "loop_lag"]
SHED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# How far one update may move the adaptive limit (Envoy's bounds): at most halved, at most doubled.
MIN_GRADIENT = 0.5
MAX_GRADIENT = 2.0


class OverloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[overload]`: when generation requests are refused at the door."""

    # Off: nothing is shed (requests still queue in admission, bounded by its own limits).
    enabled: bool = True
    # Generation requests one process holds at once (arrival to last byte); the next one is shed. The
    # ceiling of the adaptive limit.
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
    # The adaptive concurrency limit (`ConcurrencyLimit`); off: only `max_in_flight` bounds what is held. Off
    # by default: a whole answer is timed to its end, so in front of a real engine the length of what is
    # generated, not congestion, would drive the limit.
    adaptive: bool = False
    # The floor of the adaptive limit, and the company that makes a request "uncontended": one that arrived
    # with fewer than this many others in flight is a baseline sample.
    min_limit: int = 4
    # How much above the baseline the recent latency may be before the limit falls (1.0: twice the baseline).
    latency_tolerance: float = 1.0
    # The percentile of latency compared (the recent sample and the baseline alike).
    latency_percentile: float = 0.9
    # Seconds between two updates of the limit: the recent sample is the requests that completed in one.
    sample_interval: float = 0.1
    # Seconds between two measurements of the baseline, and how many uncontended requests make one.
    min_rtt_interval: float = 10.0
    min_rtt_requests: int = 20
    # Shed a fraction of generation requests that keeps the process's CPU utilisation at
    # `target_utilisation` (`CpuShedder`). Off by default: the process's CPU also counts what else runs in
    # it (an in-process vLLM engine's threads, a test runner sharing the event loop), which would shed
    # requests for work that is not theirs.
    cpu_shedding: bool = False
    # The utilisation held: the larger of the event-loop thread's share of one core (the time it ran or
    # waited for the core while ready to run) and the process's CPU share of the cores it may run on.
    target_utilisation: float = 0.85
    # Seconds the utilisation is measured over (a sliding window, sampled at each lag probe).
    cpu_window: float = 0.25
    # How fast the shed fraction rises while the utilisation is over the target: by `cpu_gain * (utilisation -
    # target_utilisation)` per second.
    cpu_gain: float = 40.0
    # How fast it falls back (towards 0) while under the target: `cpu_release_gain * (target_utilisation -
    # utilisation)` per second. Slower than the rise, so that the fraction settles instead of swinging
    # between 0 and the most (the utilisation lags it by about half the window).
    cpu_release_gain: float = 5.0
    # The most of the generation requests the CPU signal sheds (a shed request costs CPU too).
    max_shed_fraction: float = 0.95


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile `q` (0-1) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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
            self.min_rtt = percentile(self._uncontended, config.latency_percentile)
            self._uncontended.clear()
            self._next_min_rtt = now + config.min_rtt_interval
        if self.min_rtt is not None:
            sample = percentile(self._samples, config.latency_percentile)
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


SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_demand() -> float:
    """Seconds the calling thread has run or been ready to run while waiting for a core (Linux schedstat:
    the run queue's wait counts), where the kernel tells; else its CPU time (`time.thread_time`)."""
    try:
        run, wait, _ = SCHEDSTAT.read_bytes().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(run) + int(wait)) / 1e9


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - no affinity API (macOS)


class CpuShedder:
    """The CPU signal: the process's CPU utilisation, and the fraction of generation requests shed to hold it
    at `target_utilisation`.

    `sample()` runs on the event loop after each lag probe. Utilisation over the last `cpu_window` s of
    `wall` time is the larger of

        loop = d thread_clock / d wall                  (the loop thread's share of one core)
        process = d process_clock / (d wall * cores)    (the process's share of the cores it may use)

    `thread_clock` is read on the loop thread, and by default (`thread_demand`) counts the time the loop
    was ready to run but waited for its core as well as the time it ran: a loop that never idles is
    saturated whether it got all of its core or shared it with the process's worker threads (tokenizers)
    or with other processes, which its CPU time alone would not show. The loop share sees a loop that is
    the bottleneck while other cores idle; the process share sees worker threads filling the cores. Each
    sample then moves the shed fraction by

        fraction = clamp(fraction + gain * (utilisation - target_utilisation) * d wall, 0, max_shed)

    with `gain` = `cpu_gain` over the target and `cpu_release_gain` under it: an integral controller. While
    the process is saturated the utilisation cannot show by how much, so the fraction keeps rising (fast)
    until the CPU has room again (the queue in front of the wrapper has drained); it falls back slowly,
    settling where the utilisation meets the target, and to 0 while the load stays under it. `shed()`
    refuses that fraction of arrivals deterministically by error diffusion: each arrival adds the fraction
    to a credit, and one whose credit reaches 1 is shed.
    """

    def __init__(
        self,
        config: OverloadConfig,
        wall: Callable[[], float],
        thread_clock: Callable[[], float] = thread_demand,
        process_clock: Callable[[], float] = time.process_time,
        cores: int | None = None,
    ) -> None:
        self._config = config
        self._wall = wall
        self._thread_clock = thread_clock
        self._process_clock = process_clock
        self.cores = max(1, cores if cores is not None else usable_cores())
        self._max_fraction = min(1.0, max(0.0, config.max_shed_fraction))
        self.utilisation = 0.0
        self.fraction = 0.0
        self._credit = 0.0
        # (wall, thread, process) readings; the first is the newest at or before the window's start.
        self._samples: deque[tuple[float, float, float]] = deque()

    def sample(self) -> None:
        """Read the clocks, update the utilisation over the window and the shed fraction."""
        now = (self._wall(), self._thread_clock(), self._process_clock())
        samples = self._samples
        previous = samples[-1][0] if samples else now[0]
        samples.append(now)
        while len(samples) > 2 and samples[1][0] <= now[0] - self._config.cpu_window:
            samples.popleft()
        wall, thread, process = (b - a for a, b in zip(samples[0], now, strict=True))
        if wall <= 0:
            return
        self.utilisation = min(1.0, max(thread / wall, process / (wall * self.cores)))
        config = self._config
        error = self.utilisation - config.target_utilisation
        step = (config.cpu_gain if error > 0 else config.cpu_release_gain) * error * (now[0] - previous)
        # Invariant: 0 <= fraction <= min(1, max_shed_fraction) after every sample.
        self.fraction = min(self._max_fraction, max(0.0, self.fraction + step))

    def shed(self) -> bool:
        """Whether this arriving generation request is shed (a `fraction` of arrivals are)."""
        # Invariant: 0 <= credit < 1 after every arrival (as fraction <= 1).
        self._credit += self.fraction
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False


_REFUSALS: dict[ShedReason, str] = {
    "concurrency": "more requests in flight than it is serving without queueing",
    "cpu": "its CPU is saturated",
    "in_flight": "too many requests in flight",
    "loop_lag": "its event loop is running late",
}


class OverloadGate:
    """The in-flight count, the adaptive limit, the lag monitor, the CPU signal, and what was shed, for one
    process. Time is `clock` (the monitor's unless given); the CPU signal is `cpu` (one on the process's own
    CPU clocks unless given), sampled after each of the monitor's probes when `cpu_shedding` is on."""

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
        if config.cpu_shedding:
            self.cpu = cpu or CpuShedder(config, self.clock)
            monitor.after_probe.append(self.cpu.sample)
        self.in_flight = 0
        self.shed: dict[ShedReason, int] = {"concurrency": 0, "cpu": 0, "in_flight": 0, "loop_lag": 0}
        retry = str(max(1, math.ceil(config.retry_after)))
        self._headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", retry.encode()),
        ]

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
                await self._refuse(reason, send)
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

    async def _refuse(self, reason: ShedReason, send: Send) -> None:
        body = msgspec.json.encode(
            ErrorResponse(
                error=ErrorBody(
                    message=f"the gateway is overloaded ({_REFUSALS[reason]}); retry after the Retry-After "
                    "delay",
                    type="service_unavailable",
                    code="overloaded",
                )
            )
        )
        headers = [*self._headers, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


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
