"""Overload benchmark: Poisson arrivals from 0.5x to 3x capacity, an interactive/batch mix over several
tenants, through the fair `Scheduler` (bounded queues, deadlines, refusals) next to an unbounded FCFS queue
over the same simulated replicas.

    python -m ops.bench.overload [--loads 0.5 1 1.5 2 3] [--seconds 40] [--ttft 1.0] [--tpot 0.06]
                                 [--interactive 0.7] [--tenants 4] [--json PATH] [--png PATH] [--quick]

Capacity is measured first in the same run: completed requests per second of the same mix under a
saturating closed loop. Each load point then offers `load x capacity` requests per second for `--seconds`
(virtual) seconds; what is still unfinished `--grace` seconds after the last arrival counts as missed.
Figures per dispatcher and load: SLO attainment of admitted interactive requests (time to first token <=
`--ttft` and time per output token <= `--tpot`, both counted from arrival), goodput (requests of either
class meeting the SLO per second, counted after a warm-up of a quarter of the arrivals and until they stop;
batch only needs the TPOT target), refusals by reason with
their latency (arrival to refusal). Time is virtual (`ops.bench._sim`). The plot needs matplotlib; without
it only the JSON is written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.quantile import nearest_rank
from ops.bench._sim import (
    Dispatcher,
    FifoDispatcher,
    Served,
    Workload,
    now,
    router,
    run_virtual,
    serve,
    start_replicas,
    stop_replicas,
)
from routing.admission_types import AdmissionConfig, AdmissionError, QueueFullError
from routing.replicas import Replica, RoutingError
from routing.scheduler import Scheduler


def shape(workload: Workload, klass: str) -> tuple[int, int]:
    """(prompt tokens, max tokens) of a request of `klass`: short chats, longer batch jobs."""
    rng = workload.rng
    if klass == "interactive":
        return rng.randint(100, 400), rng.randint(30, 120)
    return rng.randint(400, 1200), rng.randint(100, 300)


def pick(workload: Workload, args: argparse.Namespace) -> tuple[str, str]:
    """A random tenant and class."""
    tenant = f"tenant-{workload.rng.randrange(args.tenants)}"
    klass = "interactive" if workload.rng.random() < args.interactive else "batch"
    return tenant, klass


async def capacity(args: argparse.Namespace) -> dict[str, float]:
    """Saturating throughput of the mix: a closed loop of many clients, after a warm-up."""
    replicas = await start_replicas(args.replicas)
    dispatcher = FifoDispatcher(replicas)
    workload = Workload(args.seed)
    done: list[tuple[float, int]] = []

    async def client() -> None:
        while True:
            tenant, klass = pick(workload, args)
            prompt, max_tokens = shape(workload, klass)
            ticket, route = workload.request(tenant, 1.0, klass, prompt, max_tokens, 1e9)
            served = await serve(await dispatcher.admit(ticket, route), route, Served())
            done.append((now(), served.tokens))

    tasks = [asyncio.create_task(client()) for _ in range(args.saturate_clients)]
    warmup = args.capacity_seconds / 4
    await asyncio.sleep(args.capacity_seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await stop_replicas(replicas)
    window = [d for d in done if d[0] >= warmup]
    seconds = args.capacity_seconds - warmup
    return {"requests_per_s": len(window) / seconds, "tokens_per_s": sum(n for _, n in window) / seconds}


def admission(args: argparse.Namespace, tokens_per_s: float) -> AdmissionConfig:
    """The scheduler's bounds: an interactive request is only worth dispatching within its TTFT target."""
    return AdmissionConfig(
        interactive_deadline=args.ttft,
        batch_deadline=args.grace,
        batch_max_wait=args.grace / 2,
        max_queued_per_tenant=args.max_queued_per_tenant,
        max_queued_per_class=args.max_queued_per_class,
        initial_service_rate=tokens_per_s,
    )


async def load_point(
    name: str, make: Callable[[list[Replica]], Dispatcher], rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Offer Poisson arrivals at `rate` per second through one dispatcher; its figures."""
    replicas = await start_replicas(args.replicas)
    dispatcher = make(replicas)
    runner = asyncio.create_task(dispatcher.run()) if isinstance(dispatcher, Scheduler) else None
    workload = Workload(args.seed)
    outcomes: list[dict[str, Any]] = []

    async def request(tenant: str, klass: str) -> None:
        prompt, max_tokens = shape(workload, klass)
        deadline = args.ttft if klass == "interactive" else args.grace
        ticket, route = workload.request(tenant, 1.0, klass, prompt, max_tokens, deadline)
        outcome: dict[str, Any] = {"klass": klass, "arrival": ticket.arrival, "admitted": False, "met": False}
        outcomes.append(outcome)
        try:
            lease = await dispatcher.admit(ticket, route)
        except (AdmissionError, RoutingError) as exc:
            reason = exc.reason if isinstance(exc, QueueFullError) else exc.code
            outcome["refused"], outcome["refusal_latency"] = reason, now() - ticket.arrival
            return
        outcome["admitted"] = True
        served = await serve(lease, route, Served())
        if served.first is None or served.done is None:
            return
        ttft = served.first - ticket.arrival
        tpot = (served.done - served.first) / max(served.tokens - 1, 1)
        outcome["ttft"], outcome["tpot"], outcome["done"] = ttft, tpot, served.done
        outcome["met"] = tpot <= args.tpot and (klass == "batch" or ttft <= args.ttft)

    tasks: list[asyncio.Task[None]] = []
    start = now()
    end = start + args.seconds
    while True:
        await asyncio.sleep(workload.rng.expovariate(rate))
        if now() >= end:
            break
        tasks.append(asyncio.create_task(request(*pick(workload, args))))
    if tasks:
        await asyncio.wait(tasks, timeout=args.grace)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if runner is not None:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    await stop_replicas(replicas)
    return summarise(name, outcomes, (start + args.seconds / 4, end), args)


def summarise(
    name: str, outcomes: Sequence[dict[str, Any]], window: tuple[float, float], args: argparse.Namespace
) -> dict[str, Any]:
    """The figures of one load point from its per-request outcomes. Goodput counts SLO-meeting completions
    inside `window` (after a warm-up, before arrivals stop: the steady state, not the drain)."""
    first, last = window
    good = [o for o in outcomes if o["met"] and first <= o["done"] <= last]
    interactive = [o for o in outcomes if o["klass"] == "interactive"]
    admitted = [o for o in interactive if o["admitted"]]
    refused: dict[str, list[float]] = {}
    for o in outcomes:
        if "refused" in o:
            refused.setdefault(o["refused"], []).append(o["refusal_latency"])
    ttfts = [o["ttft"] for o in admitted if "ttft" in o]
    return {
        "dispatcher": name,
        "offered": len(outcomes),
        "offered_interactive": len(interactive),
        "admitted_interactive": len(admitted),
        "slo_attainment_admitted": sum(o["met"] for o in admitted) / len(admitted) if admitted else 0.0,
        "slo_attainment_offered": sum(o["met"] for o in interactive) / len(interactive)
        if interactive
        else 0.0,
        "goodput_per_s": len(good) / (last - first),
        "goodput_interactive_per_s": sum(o["klass"] == "interactive" for o in good) / (last - first),
        "ttft_p50": nearest_rank(ttfts, 0.5),
        "ttft_p99": nearest_rank(ttfts, 0.99),
        "refused": {reason: len(lat) for reason, lat in sorted(refused.items())},
        "refusal_latency_p50": {r: nearest_rank(lat, 0.5) for r, lat in sorted(refused.items())},
        "refusal_latency_p99": {r: nearest_rank(lat, 0.99) for r, lat in sorted(refused.items())},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Capacity, then every load point through the scheduler and FCFS."""
    cap = await capacity(args)
    config = admission(args, cap["tokens_per_s"])
    points = []
    for load in args.loads:
        rate = load * cap["requests_per_s"]

        def fair(replicas: list[Replica]) -> Dispatcher:
            return Scheduler(replicas, router(), config, now, refresh_interval=1.0)

        fair_row = await load_point("fair", fair, rate, args)
        fcfs_row = await load_point("fcfs", FifoDispatcher, rate, args)
        points.append({"load": load, "rate_per_s": rate, "fair": fair_row, "fcfs": fcfs_row})
    return {"capacity": cap, "points": points}


def format_table(result: dict[str, Any]) -> str:
    """One line per load point and dispatcher."""
    header = [
        "load",
        "disp",
        "offered",
        "SLO adm %",
        "SLO off %",
        "goodput/s",
        "TTFT p99",
        "refused",
        "ref p99",
    ]
    lines = ["  ".join(f"{h:>9}" for h in header)]
    for point in result["points"]:
        for name in ("fair", "fcfs"):
            row = point[name]
            worst = max(row["refusal_latency_p99"].values(), default=0.0)
            refused = ",".join(f"{r}={n}" for r, n in row["refused"].items()) or "-"
            cells = [
                f"{point['load']:g}x",
                name,
                str(row["offered"]),
                f"{100 * row['slo_attainment_admitted']:.1f}",
                f"{100 * row['slo_attainment_offered']:.1f}",
                f"{row['goodput_per_s']:.1f}",
                f"{row['ttft_p99']:.2f}",
                refused,
                f"{worst * 1000:.1f}ms",
            ]
            lines.append("  ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """SLO attainment and goodput against offered load; False when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    loads = [p["load"] for p in result["points"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("fair", "fcfs"):
        left.plot(
            loads, [100 * p[name]["slo_attainment_admitted"] for p in result["points"]], "o-", label=name
        )
        right.plot(loads, [p[name]["goodput_per_s"] for p in result["points"]], "o-", label=name)
    left.set(xlabel="offered load (x capacity)", ylabel="interactive SLO attainment, admitted (%)")
    right.set(xlabel="offered load (x capacity)", ylabel="goodput (requests meeting SLO / s)")
    for axis in (left, right):
        axis.grid(True)
        axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table, write the JSON and the plot."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.overload", description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--seconds", type=float, default=40.0, help="virtual seconds of arrivals (40)")
    parser.add_argument("--grace", type=float, default=30.0, help="virtual s to finish after the last (30)")
    parser.add_argument("--capacity-seconds", type=float, default=20.0, help="capacity run, virtual s (20)")
    parser.add_argument("--saturate-clients", type=int, default=200, help="clients of the capacity run")
    parser.add_argument("--replicas", type=int, default=3, help="simulated replicas (3)")
    parser.add_argument("--tenants", type=int, default=4, help="tenants, equal weights (4)")
    parser.add_argument("--interactive", type=float, default=0.7, help="interactive fraction (0.7)")
    parser.add_argument("--ttft", type=float, default=1.0, help="TTFT target, s, and interactive deadline")
    parser.add_argument("--tpot", type=float, default=0.06, help="time per output token target, s (0.06)")
    parser.add_argument("--max-queued-per-tenant", type=int, default=64)
    parser.add_argument("--max-queued-per-class", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("overload.json"), help="where to write figures")
    parser.add_argument("--png", type=Path, default=Path("overload.png"), help="where to write the plot")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.loads, args.seconds, args.grace, args.capacity_seconds = [0.5, 2.0], 8.0, 10.0, 8.0
        args.replicas, args.saturate_clients = 2, 120
    started = time.perf_counter()
    result = run_virtual(run(args))
    wall = time.perf_counter() - started
    cap = result["capacity"]
    print(
        f"overload benchmark: {args.replicas} replicas, capacity {cap['requests_per_s']:.1f} req/s "
        f"({cap['tokens_per_s']:.0f} output tok/s), {args.seconds:g} virtual s per point, "
        f"SLO TTFT <= {args.ttft:g} s, TPOT <= {args.tpot:g} s (wall {wall:.1f} s)"
    )
    print(format_table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "json": str(args.json), "png": str(args.png)}
    args.json.write_text(json.dumps({"args": settings, **result}, indent=1))
    print(f"figures written to {args.json}")
    if plot(result, args.png):
        print(f"plot written to {args.png}")
    else:
        print("matplotlib is not installed: no plot written (the JSON has every figure)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
