"""`[overload]`: when generation requests are refused at the door."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


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
    # sustained lag by default). The CPU signal samples at each probe, so this is also how soon it reacts; a
    # probe costs a wake-up of the loop (about 2 ms of CPU a second at 100 Hz).
    lag_probe_interval: Annotated[float, msgspec.Meta(gt=0)] = 0.01
    lag_window: int = 50
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
    # `target_utilisation` (`CpuShedder`). "auto" (the default): on where the process's CPU is its requests'
    # own: every engine a remote vLLM server or the simulator (`engine.kind` or `[[engines]]`), no guard
    # engine started in this process, no engine object handed to `create_app`; off otherwise: the CPU then
    # also counts what else runs in it (an in-process vLLM engine's and guard engine's threads and processes
    # competing for the cores, a test runner sharing the event loop), which would shed requests for work that
    # is not theirs.
    cpu_shedding: bool | Literal["auto"] = "auto"
    # The utilisation held: the larger of the event-loop thread's share of one core (the time it ran or
    # waited for the core while ready to run) and the process's CPU share of the cores it may run on (capped
    # by its cgroup's CPU limit).
    target_utilisation: float = 0.85
    # Seconds the utilisation is measured over (a sliding window, sampled at each lag probe). Short: a load
    # that jumps to twice the capacity fills the queue by its whole excess until the signal has seen it.
    cpu_window: float = 0.05
    # How fast the shed fraction rises while the utilisation is at least `cpu_climb_utilisation`: by
    # `cpu_gain * (utilisation - target_utilisation)` per second.
    cpu_gain: float = 150.0
    # The utilisation over the window from which the fraction rises: a window with idle moments in it had no
    # backlog through it, however busy (between the target and this, the fraction holds). At the target
    # itself, the chance bursts of a steady load under it (a window of 50 ms holds only ~20 requests' worth
    # of CPU on a slow machine) would pump the fraction up, since it rises much faster than it falls.
    cpu_climb_utilisation: float = 0.97
    # How fast it falls back (towards 0) while under the target: `cpu_release_gain * (target_utilisation -
    # utilisation)` per second. Slower than the rise, so that the fraction settles instead of swinging
    # between 0 and the most (the utilisation lags it by about half the window).
    cpu_release_gain: float = 50.0
    # The most of the generation requests the CPU signal sheds (a shed request costs CPU too).
    max_shed_fraction: float = 0.95
    # Shed at once the share of the arrivals over the window that the CPU could not serve at the target, at
    # the CPU per request learned while nothing was shed (`CpuShedder`): a jump in load is shed as it
    # arrives, not only once the CPU shows it saturated.
    cpu_feed_forward: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.target_utilisation <= self.cpu_climb_utilisation <= 1:
            raise ValueError(
                f"`cpu_climb_utilisation` ({self.cpu_climb_utilisation}) must lie between "
                f"`target_utilisation` ({self.target_utilisation}) and 1, and the target over 0"
            )
