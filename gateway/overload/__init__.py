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
  Envoy's CPU utilisation resource monitor) so that the process's CPU utilisation stays between
  `target_utilisation` and `cpu_climb_utilisation`. A process past saturation queues work *before* the
  wrapper (socket buffers, the server's parsing, the loop's ready queue, threads competing for the core),
  where neither the in-flight count nor latency measured from the wrapper see it, and the loop's lag stays
  small; refusing enough requests to keep the CPU just below saturation keeps that queue from forming, so
  refusals are quick and the admitted do not wait.

A shed request gets 503 `overloaded` in the OpenAI error shape with `Retry-After`, from an ASGI wrapper in
front of Litestar: its body is not read, no route, auth, quota or engine is reached. Only generation routes
are shed (`SHED_PATHS`); health, metrics, admin and audit routes always pass. `OverloadGate.shed` counts
refusals by reason for the metrics.
"""

from gateway.overload.config import OverloadConfig
from gateway.overload.cpu import SCHEDSTAT, CpuShedder, cgroup_cpu_limit, thread_demand, usable_cores
from gateway.overload.gate import SHED_PATHS, OverloadGate, ShedReason
from gateway.overload.lag import LoopLagMonitor
from gateway.overload.limit import ConcurrencyLimit

__all__ = [
    "SCHEDSTAT",
    "SHED_PATHS",
    "ConcurrencyLimit",
    "CpuShedder",
    "LoopLagMonitor",
    "OverloadConfig",
    "OverloadGate",
    "ShedReason",
    "cgroup_cpu_limit",
    "thread_demand",
    "usable_cores",
]
