"""The CPU signal: the serving process's CPU utilisation and the fraction of requests shed to hold it."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gateway.overload.config import OverloadConfig

SCHEDSTAT = Path("/proc/thread-self/schedstat")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_MEMBERSHIP = Path("/proc/self/cgroup")
# The cost per request is learned from windows with at least this many admitted arrivals, each sample moving
# it this far towards the window's own figure.
_MIN_ADMITTED = 4
_COST_WEIGHT = 0.02
# The last probe interval's arrivals set the floor only past this many times what the whole CPU could serve: a
# jump, not a chance count of a few milliseconds.
_JUMP = 1.2
# ... over an interval of at least a probe interval and this many requests' worth of CPU at the learned cost:
# on a slow machine a probe interval holds only a few requests, and arrivals reach the gate in batches (those
# read in one turn of a busy loop), so a count of 5 in 10 ms would often look like a jump.
_JUMP_REQUESTS = 10
# One reading of the clocks and counts: (wall, thread, process, arrived, admitted).
_Sample = tuple[float, float, float, int, int]


def thread_demand() -> float:
    """Seconds the calling thread has run or been ready to run while waiting for a core (Linux schedstat:
    the run queue's wait counts), where the kernel tells; else its CPU time (`time.thread_time`)."""
    try:
        run, wait, _ = SCHEDSTAT.read_bytes().split()
    except (OSError, ValueError):
        return time.thread_time()
    return (int(run) + int(wait)) / 1e9


def usable_cores(cgroup_root: Path = CGROUP_ROOT, membership: Path = CGROUP_MEMBERSHIP) -> float:
    """The cores' worth of CPU this process may use: the cores it may run on, or its cgroup's CPU bandwidth
    limit where that is less (a container's CPU limit: a process throttled by its quota is saturated at
    that share of the machine)."""
    if hasattr(os, "sched_getaffinity"):
        cores = float(len(os.sched_getaffinity(0)))
    else:  # pragma: no cover - no affinity API (macOS)
        cores = float(os.cpu_count() or 1)
    limit = cgroup_cpu_limit(cgroup_root, membership)
    return cores if limit is None else min(cores, limit)


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, membership: Path = CGROUP_MEMBERSHIP) -> float | None:
    """The smallest CPU bandwidth limit (quota / period, in cores) on this process's cgroup and its
    ancestors, cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); None where none is set or readable."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            limits += _limits_up(cgroup_root, cgroup_root / path.lstrip("/"), _v2_limit)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            mount = cgroup_root / controllers
            if not mount.is_dir():
                mount = cgroup_root / "cpu"
            limits += _limits_up(mount, mount / path.lstrip("/"), _v1_limit)
    return min(limits) if limits else None


def _limits_up(top: Path, group: Path, read: Callable[[Path], float | None]) -> list[float]:
    """The limits `read` finds in `group` and each directory above it, up to `top`."""
    limits = []
    while True:
        limit = read(group)
        if limit is not None:
            limits.append(limit)
        if group == top or top not in group.parents:
            return limits
        group = group.parent


def _v2_limit(group: Path) -> float | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


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

    with `gain` = `cpu_release_gain` under the target, `cpu_gain` from `cpu_climb_utilisation` on, and 0
    between them: an integral controller with a dead band. While the process is saturated the utilisation
    cannot show by how much, so the fraction keeps rising (fast) until the CPU has room again (the queue in
    front of the wrapper has drained); it falls back more slowly, settling where the utilisation is between
    the target and the climb, and to 0 while the load stays under the target. The climb is not the target
    itself because the window holds few requests where each costs much (50 ms is ~20 requests of 2.6 ms):
    a steady load well under the target has windows at 90-100% by chance, and a fraction that rises much
    faster than it falls would turn those into shedding (a queueing model of Poisson arrivals, 2.6 ms each,
    tests/gateway/test_overload_queueing.py, shed 11% at 70% load and 21% at 80% with the climb at the
    target and a release gain of 5; 3% and 7% with the climb at 0.97 and 50).

    The controller climbs at `cpu_gain` per second once the window shows the CPU over the target, and
    meanwhile arrivals are taken: at twice the capacity the first tenths of a second queue. With
    `cpu_feed_forward`, the arrivals over the window set a floor under the fraction at once:

        cost = utilisation * d wall / admitted          (learned while nothing is shed, below the target)
        predicted = arrivals * cost / d wall            (the utilisation taking every arrival would need)
        floor = 1 - target_utilisation / predicted      (when predicted > 1 and utilisation >= target)

    `cost` is an exponential average over the samples with at least `_MIN_ADMITTED` admitted arrivals in the
    window, taken while the utilisation is under the target (a rising load's CPU, not yet in the window when
    its arrivals are, pulls it down for the few samples until the CPU shows the rise; each moves it 2%).
    Under the whole CPU the floor
    is 0, since the count of one window varies by chance and the controller decides there; and under the
    target, since an arrival's CPU may be spread over more than the window (a long stream), so a burst is no
    overload until the CPU shows it. From there the floor jumps where the controller would climb at `cpu_gain`
    per second. The window's utilisation reaches the target only once the CPU has been saturated for most of
    the window, and at a jump from idle the requests taken until then would queue: so the last probe
    interval's arrivals and utilisation (since the newest sample at least `lag_probe_interval` and
    `_JUMP_REQUESTS` requests' worth of CPU old, at most the window) set the same floor at once where they
    predict more than `_JUMP` times the whole CPU (a jump, not a chance count of a few requests) and that
    interval's CPU is over the target. The floor ignores what a refusal
    costs, so in steady overload the controller's own fraction is above it; it matters while the controller
    catches up, and falls with the arrivals. `shed()` refuses the larger of the two (`shed_fraction`)
    deterministically by error diffusion: each arrival adds it to a credit, and one whose credit reaches 1
    is shed.
    """

    def __init__(
        self,
        config: OverloadConfig,
        wall: Callable[[], float],
        thread_clock: Callable[[], float] = thread_demand,
        process_clock: Callable[[], float] = time.process_time,
        cores: float | None = None,
    ) -> None:
        self._config = config
        self._wall = wall
        self._thread_clock = thread_clock
        self._process_clock = process_clock
        self.cores = cores if cores is not None and cores > 0 else usable_cores()
        self._max_fraction = min(1.0, max(0.0, config.max_shed_fraction))
        self.utilisation = 0.0
        # The controller's fraction, and the floor the window's arrivals set under it.
        self.fraction = 0.0
        self.floor = 0.0
        # CPU (as a share of the utilisation's unit, in seconds) per admitted arrival; 0 until learned.
        self.cost = 0.0
        self._credit = 0.0
        self._arrived = 0
        self._admitted = 0
        # Readings; the first is the newest at or before the window's start.
        self._samples: deque[_Sample] = deque()

    @property
    def shed_fraction(self) -> float:
        """The share of arrivals shed now: the controller's fraction, or the arrivals' floor if higher."""
        return max(self.fraction, self.floor)

    def sample(self) -> None:
        """Read the clocks, update the utilisation over the window, the shed fraction and its floor."""
        now = (self._wall(), self._thread_clock(), self._process_clock(), self._arrived, self._admitted)
        samples = self._samples
        previous = samples[-1][0] if samples else now[0]
        samples.append(now)
        while len(samples) > 2 and samples[1][0] <= now[0] - self._config.cpu_window:
            samples.popleft()
        first = samples[0]
        wall = now[0] - first[0]
        if wall <= 0:
            return
        self.utilisation = self._busy(first, now)
        config = self._config
        error = self.utilisation - config.target_utilisation
        if error <= 0:
            gain = config.cpu_release_gain
        else:  # over the target: rises only while the window had no idle moment (a backlog), else holds
            gain = config.cpu_gain if self.utilisation >= config.cpu_climb_utilisation else 0.0
        step = gain * error * (now[0] - previous)
        if config.cpu_feed_forward:
            self._learn_cost(wall, now[4] - first[4])
            # Only arrivals past what the whole CPU could serve (a floor set by a window's chance count would
            # shed below saturation), and only while the CPU is over the target too: a request's CPU may be
            # spread over more than the window (a long stream), and a burst of such arrivals is no overload
            # until the CPU shows it.
            self.floor = self._floor(first, now, self.utilisation, past=1.0)
            last = self._probe_interval_before(now[0])
            if last is not None:  # a jump, before the window shows it
                self.floor = max(self.floor, self._floor(last, now, self._busy(last, now), past=_JUMP))
        # Invariant: 0 <= fraction <= min(1, max_shed_fraction) after every sample (and so is the floor).
        self.fraction = min(self._max_fraction, max(0.0, self.fraction + step))

    def _busy(self, since: _Sample, now: _Sample) -> float:
        """The utilisation from sample `since` to sample `now` (a later one)."""
        wall = now[0] - since[0]
        return min(1.0, max((now[1] - since[1]) / wall, (now[2] - since[2]) / (wall * self.cores)))

    def _learn_cost(self, wall: float, admitted: int) -> None:
        if (
            self.shed_fraction == 0
            and admitted >= _MIN_ADMITTED
            and self.utilisation < self._config.target_utilisation
        ):
            # Under the target: the window's CPU is its arrivals'. (Not also "while the arrivals predict less
            # than the target": that prediction is made with the cost itself, so a cost learned too high
            # (at a low rate, where the process's own background work is a larger share) would stop its own
            # correction.)
            cost = self.utilisation * wall / admitted
            self.cost = cost if self.cost == 0 else self.cost + _COST_WEIGHT * (cost - self.cost)

    def _floor(self, since: _Sample, now: _Sample, utilisation: float, *, past: float) -> float:
        """The floor the arrivals from sample `since` to `now` set: `1 - target / predicted` where they
        predict more than `past` times the whole CPU and `utilisation` is over the target, else 0."""
        target = self._config.target_utilisation
        predicted = (now[3] - since[3]) * self.cost / (now[0] - since[0])
        if predicted > past and utilisation >= target:
            return min(self._max_fraction, 1.0 - target / predicted)
        return 0.0

    def _probe_interval_before(self, now: float) -> _Sample | None:
        """The newest sample at least a probe interval, and `_JUMP_REQUESTS` requests' worth of CPU, before
        `now` (samples come after each probe and from arrivals, so two may be a fraction of a millisecond
        apart, and one arrival between them would look like a jump); None before there is one."""
        bound = now - max(self._config.lag_probe_interval, _JUMP_REQUESTS * self.cost)
        for sample in reversed(self._samples):
            if sample[0] <= bound:
                return sample
        return None

    def shed(self) -> bool:
        """Whether this arriving generation request is shed (`shed_fraction` of arrivals are). The signal
        samples first when its last sample is a probe interval old: a loop working through a backlog runs its
        probes late, just when the fraction must rise, but the arrivals it works through keep updating it."""
        if self._samples and self._wall() - self._samples[-1][0] >= self._config.lag_probe_interval:
            self.sample()
        self._arrived += 1
        # Invariant: 0 <= credit < 1 after every arrival (as shed_fraction <= 1).
        self._credit += self.shed_fraction
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        self._admitted += 1
        return False
