"""Virtual token counters shared by gateway processes: fleet-wide tenant fairness.

Each process keeps its own fair queue (`routing.fair_queue`) and charges its tenants' counters locally, on
the hot path, without a round trip. Every `admission.fleet_sync_interval` it sends, per tenant it served or
holds active, what it charged since the last sync (`delta`, weighted tokens / weight) and the counter it
holds (`floor`: a tenant lifted to the local virtual time when it became active there), and the store
returns the fleet's counter: `max(counter + delta, floor)`, summed over every process's charges. The process
then holds that counter plus what it charged during the round trip. So a tenant served by one gateway is
behind the others at every gateway within one sync interval.

Bound. Within one process, two backlogged tenants' service per weight differs by at most M + (k - 1) x O
(`routing.fair_queue`). Across a fleet a process orders tenants by counters that miss at most what the other
processes charged in the last sync interval and round trip, Δ: at most R x Δ / w_min weighted tokens, where
R is the fleet's service rate. So the fleet-wide gap stays within M + (k - 1) x O + R x Δ / w_min
(`ops.bench.fairness --gateways 2` measures it against this bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec


class CounterUpdate(msgspec.Struct, frozen=True):
    """One tenant's part of a sync (module docstring)."""

    tenant: str
    delta: float
    floor: float


class CountersUnavailableError(Exception):
    """The shared counters could not be reached; the process goes on with its own until the next sync."""


class SharedCounters(Protocol):
    """The fleet's virtual token counters, one set per fair queue (per model weights)."""

    async def sync(self, queue: str, updates: Sequence[CounterUpdate]) -> list[float]:
        """Apply `updates` to `queue`'s counters; the fleet's counter of each update's tenant, in order.
        Raises CountersUnavailableError."""
        ...

    async def close(self) -> None:
        """Release the store's connections."""
        ...
