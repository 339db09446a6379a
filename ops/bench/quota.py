"""Quota store benchmark: reserve+reconcile throughput and latency next to a plain Redis INCR round trip.

Backends: the memory store, the Redis store, and the Redis store granting from leases (`[quota.lease]` at its
defaults: most requests never reach Redis, so it is measured against INCR like the others).

    python -m ops.bench.quota [--seconds 5] [--concurrency 16] [--host 127.0.0.1] [--port 6379]

Each backend runs for `--seconds` (half with one sequential client, half with `--concurrency` tasks) against a
loopback Redis. INCR, measured in the same run on the same client, is the floor any Redis-backed limiter pays;
the ratios say what the Lua scripts cost on top. Run by hand, not in CI: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import redis.asyncio

from gateway.quantile import nearest_rank
from policy.quota import BucketSpec, LeasedQuotaStore, MemoryQuotaStore, QuotaStore, RedisQuotaStore

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
# Effectively unlimited, so every reserve is granted: this measures the store, not the limit.
SPEC = BucketSpec(key="bench:tenant:tok", capacity=1e12, rate=1e12)

Operation = Callable[[], Awaitable[object]]


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement: an operation run for a while by `tasks` concurrent clients."""

    name: str
    tasks: int
    ops: int
    seconds: float
    p50: float
    p99: float

    @property
    def ops_per_s(self) -> float:
        """Completed operations per second of wall clock."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0


async def measure(name: str, operation: Operation, seconds: float, tasks: int) -> Row:
    """Run `operation` back to back in `tasks` tasks until `seconds` have passed."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await operation()
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(tasks)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return Row(
        name=name,
        tasks=tasks,
        ops=len(latencies),
        seconds=elapsed,
        p50=nearest_rank(latencies, 0.50),
        p99=nearest_rank(latencies, 0.99),
    )


def reserve_reconcile(store: QuotaStore) -> Operation:
    """The per-request quota work of the gateway: reserve before, reconcile after."""

    async def operation() -> None:
        now = time.time()
        reservation = await store.reserve([SPEC], [100.0], now)
        await store.reconcile(reservation, [60.0], now)

    return operation


async def both_modes(name: str, operation: Operation, seconds: float, concurrency: int) -> list[Row]:
    """The sequential single-client run, then the concurrent one."""
    return [
        await measure(name, operation, seconds / 2, 1),
        await measure(name, operation, seconds / 2, concurrency),
    ]


async def run(seconds: float, concurrency: int, host: str, port: int) -> list[Row]:
    """Measure INCR, the memory store, the Redis store and the Redis store with leases; rows in that
    order."""
    client = redis.asyncio.Redis(host=host, port=port, max_connections=concurrency)
    prefix = f"lockgate:bench:{uuid.uuid4().hex}:"
    counter = f"{prefix}incr"
    store = RedisQuotaStore(client, prefix=prefix, op_timeout=1.0)
    try:
        await client.ping()
        await store.reserve([SPEC], [1.0], time.time())  # Load the scripts outside the measurement.
        rows = await both_modes("redis INCR (baseline)", lambda: client.incr(counter), seconds, concurrency)
        memory = MemoryQuotaStore()
        rows += await both_modes("memory reserve+reconcile", reserve_reconcile(memory), seconds, concurrency)
        rows += await both_modes("redis reserve+reconcile", reserve_reconcile(store), seconds, concurrency)
        shared = redis.asyncio.Redis(host=host, port=port, max_connections=concurrency)
        leased = LeasedQuotaStore(RedisQuotaStore(shared, prefix=prefix, op_timeout=1.0), time.time)
        try:
            rows += await both_modes(
                "leased reserve+reconcile", reserve_reconcile(leased), seconds, concurrency
            )
        finally:
            await leased.close()  # every lease settled before the keys are dropped below
        return rows
    finally:
        # Every reconcile left a settled marker (EX 3600); do not leave them behind on the user's Redis.
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                await client.unlink(*batch)
                batch.clear()
        if batch:
            await client.unlink(*batch)
        await store.close()


def format_table(rows: Sequence[Row]) -> str:
    """A table of every row with latency ratios against INCR in the same mode, then one-line summaries."""
    baseline = {row.tasks: row for row in rows if "INCR" in row.name}
    header = ("operation", "clients", "ops/s", "p50 us", "p99 us", "p50/INCR", "p99/INCR")
    lines = [f"{header[0]:<26}" + "".join(f" {title:>9}" for title in header[1:])]
    summaries = []
    for row in rows:
        base = baseline.get(row.tasks)
        r50 = row.p50 / base.p50 if base and base.p50 > 0 else 0.0
        r99 = row.p99 / base.p99 if base and base.p99 > 0 else 0.0
        cells = (
            f"{row.ops_per_s:.0f}",
            f"{row.p50 * 1e6:.1f}",
            f"{row.p99 * 1e6:.1f}",
            f"{r50:.2f}x",
            f"{r99:.2f}x",
        )
        lines.append(f"{row.name:<26} {row.tasks:>9}" + "".join(f" {cell:>9}" for cell in cells))
        if "INCR" not in row.name:
            summaries.append(f"{row.name} ({row.tasks} clients) p99 = {r99:.2f}x INCR p99")
    # Reserve and reconcile are one round trip each, so 2x INCR is the floor for the Redis backend.
    return "\n".join([*lines, "", *summaries])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.quota", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="run time per backend (default 5)")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="tasks in the concurrent run (default 16)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="Redis host; loopback only")
    parser.add_argument("--port", type=int, default=6379)
    args = parser.parse_args(argv)
    if args.host not in LOOPBACK:
        # Network latency would swamp what is measured, and a benchmark must not load a shared Redis.
        parser.error(f"--host must be a loopback address, got {args.host!r}")
    rows = asyncio.run(run(args.seconds, args.concurrency, args.host, args.port))
    print(f"quota store benchmark: {args.seconds:g} s per backend, Redis at {args.host}:{args.port}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
