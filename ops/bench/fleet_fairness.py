"""Fleet fairness benchmark: two gateway processes (schedulers) in front of the same simulated engines, one
heavy tenant (10x the clients) and three light ones, with the virtual token counters shared by the fleet
(`routing.fairness`), without (`islands`: each gateway fair on its own), and one FCFS queue, in one run.

    python -m ops.bench.fleet_fairness [--gateways 2] [--replicas 2]
        [--placement round-robin|sticky-heavy] [--sync-interval 0.1] [--seconds 60]
        [--json PATH] [--png PATH] [--quick]

`--placement round-robin`: every client alternates between the gateways, request by request (the issue's
setting; each gateway then sees every tenant in proportion, so islands are nearly fair too);
`sticky-heavy`: the heavy tenant's clients all reach the first gateway (a sticky load balancer, one pooled
connection), the light tenants alternate; there each gateway alone cannot see what the other served.
Both gateways lease the engines' capacity from one ledger (`routing.capacity`). Figures as
`ops.bench.fairness` (service per weight per tenant, the largest gap between two tenants, Jain's index,
throughput), plus the fleet bound M + (k - 1) x O + R x Δ / w_min with R the measured service rate and Δ the
sync interval (`routing.fairness.base`). Time is virtual (`ops.bench._sim`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ops.bench._sim import ENGINE, REPLICA, FifoDispatcher, router, run_virtual
from ops.bench.fairness import ADMISSION, format_table, measure
from routing.admission_types import Ticket
from routing.capacity.memory import MemoryLedger
from routing.fairness.memory import MemoryCounters
from routing.replicas import Replica
from routing.router import RouteRequest
from routing.scheduler import Lease, Scheduler

# Largest request of the workload (`ops.bench.fairness`): prompt 300 x w_in + output 150 x w_out.
MAX_COST = 300 * ADMISSION.w_in + 150 * ADMISSION.w_out
MAX_OUTPUT = 150 * ADMISSION.w_out


class Fleet:
    """`gateways` schedulers over the same engines, each with its own view of every replica, sharing one
    capacity ledger and, when `shared`, the tenants' counters; requests reach them by `placement`."""

    def __init__(
        self, replicas: Sequence[Replica], gateways: int, *, shared: bool, sync: float, placement: str
    ) -> None:
        loop = asyncio.get_running_loop()
        ledger = MemoryLedger()
        self._counters = MemoryCounters() if shared else None
        self._sync = sync
        self._placement = placement
        self.schedulers = []
        for g in range(gateways):
            views = [
                Replica(
                    r.engine,
                    pool=r.pool,
                    weights_sha256=r.weights_sha256,
                    config=REPLICA,
                    clock=loop.time,
                    kv_budget_tokens=r.kv_budget_tokens,
                    shared_by=gateways,
                )
                for r in replicas
            ]
            self.schedulers.append(
                Scheduler(
                    views,
                    router(),
                    ADMISSION,
                    loop.time,
                    ledger=ledger,
                    holder=f"gateway-{g}",
                    counters=self._counters,
                )
            )
        self._turns = itertools.cycle(self.schedulers)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for scheduler in self.schedulers:
            await scheduler.refresh()
            self._tasks.append(asyncio.create_task(scheduler.run()))
            if self._counters is not None:
                self._tasks.append(asyncio.create_task(scheduler.run_counter_sync(self._sync)))

    async def admit(self, ticket: Ticket, route: RouteRequest) -> Lease:
        if self._placement == "sticky-heavy" and ticket.tenant == "heavy":
            return await self.schedulers[0].admit(ticket, route)
        return await next(self._turns).admit(ticket, route)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The shared-counter fleet, the islands, then FCFS, on fresh replicas with the same workload seed."""

    def fleet(shared: bool) -> Any:
        return lambda replicas: Fleet(
            replicas, args.gateways, shared=shared, sync=args.sync_interval, placement=args.placement
        )

    return [
        await measure("fleet", fleet(True), args),
        await measure("islands", fleet(False), args),
        await measure("fcfs", FifoDispatcher, args),
    ]


def bound(row: dict[str, Any], args: argparse.Namespace, in_flight: int) -> float:
    """M + (k - 1) x O + R x Δ / w_min for the run (weights are 1)."""
    rate = float(sum(row["service"].values())) / float(row["seconds"])
    return MAX_COST + (in_flight - 1) * MAX_OUTPUT + rate * float(args.sync_interval)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Service per weight over time per tenant, one panel per dispatcher; False without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), sharey=True)
    for axis, row in zip(axes, rows, strict=True):
        times = [s["t"] for s in row["samples"]]
        for tenant in row["service"]:
            axis.plot(times, [s["service"][tenant] for s in row["samples"]], label=tenant)
        axis.set(
            title=f"{row['dispatcher']}: steady gap {row['max_gap_steady']:.0f}, Jain {row['jain']:.3f}",
            xlabel="virtual seconds",
        )
        axis.grid(True)
    axes[0].set(ylabel="service per weight (weighted tokens)")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table, write the JSON and the plot."""
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.fleet_fairness", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes (2)")
    parser.add_argument("--replicas", type=int, default=2, help="simulated engines (2)")
    parser.add_argument("--placement", choices=["round-robin", "sticky-heavy"], default="round-robin")
    parser.add_argument("--sync-interval", type=float, default=0.1, help="seconds between counter syncs")
    parser.add_argument("--seconds", type=float, default=60.0, help="virtual seconds per dispatcher (60)")
    parser.add_argument("--clients", type=int, default=40, help="closed-loop clients per light tenant (40)")
    parser.add_argument("--ratio", type=int, default=10, help="heavy tenant's clients per light one's (10)")
    parser.add_argument("--kv-tokens", type=int, default=12_000, help="KV cache per engine (12000)")
    parser.add_argument("--sample", type=float, default=1.0, help="virtual seconds between samples (1)")
    parser.add_argument("--warmup", type=float, default=10.0, help="virtual s before the steady gap (10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--json", type=Path, default=Path("fleet_fairness.json"), help="where to write figures"
    )
    parser.add_argument(
        "--png", type=Path, default=Path("fleet_fairness.png"), help="where to write the plot"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        # Light tenants keep 40 clients: fewer could not fill their share of two engines' 96 sequences
        # (their share would go to the heavy tenant, as work conservation wants, and read as unfairness).
        args.seconds, args.sample, args.warmup = 20.0, 0.5, 10.0
    started = time.perf_counter()
    rows = run_virtual(run(args))
    wall = time.perf_counter() - started
    # k: the most requests of one tenant in flight at once: at most what the engines run and queue.
    in_flight = args.replicas * (ENGINE.max_batch + REPLICA.engine_queue)
    print(
        f"fleet fairness benchmark: {args.gateways} gateways ({args.placement}), {args.replicas} engines, "
        f"sync every {args.sync_interval:g} s, {args.seconds:g} virtual s per dispatcher (wall {wall:.1f} s)"
    )
    print(format_table(rows))
    sync_term = {
        r["dispatcher"]: sum(r["service"].values()) / r["seconds"] * args.sync_interval for r in rows
    }
    print(
        f"fleet bound M + (k - 1) x O + R x Δ: M = {MAX_COST:g}, O = {MAX_OUTPUT:g}, k <= {in_flight} "
        f"(the engines' sequences), R x Δ = {sync_term['fleet']:.0f}: at most "
        f"{bound(rows[0], args, in_flight):.0f}; fleet steady gap {rows[0]['max_gap_steady']:.0f}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "json": str(args.json), "png": str(args.png)}
    figures = {
        "args": settings,
        "runs": rows,
        "sync_term": sync_term,
        "bound": bound(rows[0], args, in_flight),
    }
    args.json.write_text(json.dumps(figures, indent=1))
    print(f"figures written to {args.json}")
    if plot(rows, args.png):
        print(f"plot written to {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
