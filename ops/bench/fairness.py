"""Fairness benchmark: one tenant sending 10x the load of three others, all backlogged, against simulated
replicas behind the fair `Scheduler` (and `Router`), next to a plain FCFS queue over the same replicas.

    python -m ops.bench.fairness [--seconds 60] [--replicas 3] [--clients 40] [--ratio 10] [--kv-tokens N]
                                 [--json PATH] [--quick]

Every tenant runs closed-loop clients (`--clients` each, the heavy one `--ratio` times as many): each sends a
request, streams its answer and sends the next, so every tenant always has requests queued. Service is
counted as the fair queue charges it (prompt tokens x w_in at dispatch, output tokens x w_out as they
stream) divided by the tenant's weight. Figures per dispatcher: service per tenant over time, the largest
gap in service per weight between two tenants at any sample, Jain's fairness index of the service per weight
over the run (1 = equal), and throughput. Three dispatchers: the fair scheduler; the same with the KV
budget as its only bound (`fair-kv`: every request the KV holds goes to the engine, whose own queue is first
come, first served: how the gateway dispatched before it counted sequences); and a plain FCFS queue. Each
simulated replica runs 48 sequences at once; `--kv-tokens` sets its KV cache (12,000 by default, which
binds first for most requests; 200,000 leaves only the sequence limit). Time is virtual (`ops.bench._sim`):
the figures do not depend on the machine, only the wall time of a run does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from ops.bench._sim import (
    ENGINE,
    REPLICA,
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
from routing.admission_types import AdmissionConfig
from routing.config import ReplicaConfig
from routing.replicas import Replica
from routing.scheduler import Scheduler

# Sequences an engine may queue itself in `fair-kv`: more than any run sends.
UNBOUNDED = 1_000_000
# Deadlines far away and bounds above the client count: this measures order, not refusals.
ADMISSION = AdmissionConfig(
    interactive_deadline=1e9, max_queued_per_tenant=100_000, max_queued_per_class=1_000_000
)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), in (0, 1]; 1 when every x is equal."""
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square > 0 else 1.0


def tenants(ratio: int) -> dict[str, tuple[float, int]]:
    """Tenant name -> (weight, client multiplier): one heavy tenant, three light ones, equal weights."""
    return {"heavy": (1.0, ratio), "light-1": (1.0, 1), "light-2": (1.0, 1), "light-3": (1.0, 1)}


async def measure(
    name: str,
    make: Callable[[list[Replica]], Dispatcher],
    args: argparse.Namespace,
    replica: ReplicaConfig = REPLICA,
) -> dict[str, Any]:
    """Run the closed-loop workload for `args.seconds` through one dispatcher; its figures."""
    engine = msgspec.structs.replace(ENGINE, kv_capacity_tokens=args.kv_tokens)
    replicas = await start_replicas(args.replicas, engine, replica)
    dispatcher = make(replicas)
    start_dispatcher = getattr(dispatcher, "start", None)
    if start_dispatcher is not None:
        await start_dispatcher()
    plan = tenants(args.ratio)
    config = ADMISSION
    service = dict.fromkeys(plan, 0.0)
    output = dict.fromkeys(plan, 0)
    completed = dict.fromkeys(plan, 0)
    workload = Workload(args.seed)
    start = now()
    stop = start + args.seconds

    async def client(tenant: str, weight: float) -> None:
        def on_tokens(n: int) -> None:
            service[tenant] += n * config.w_out / weight
            output[tenant] += n

        while now() < stop:
            prompt = workload.rng.randint(100, 300)
            max_tokens = workload.rng.randint(50, 150)
            ticket, route = workload.request(tenant, weight, "interactive", prompt, max_tokens, 1e9)
            lease = await dispatcher.admit(ticket, route)
            service[tenant] += prompt * config.w_in / weight
            await serve(lease, route, Served(), on_tokens)
            completed[tenant] += 1

    samples: list[dict[str, Any]] = []

    async def sampler() -> None:
        while True:
            await asyncio.sleep(args.sample)
            samples.append({"t": round(now() - start, 6), "service": dict(service)})

    # Clients start in a shuffled order, so no tenant's whole first wave is dispatched before the others'.
    starts = [(t, w) for t, (w, mult) in plan.items() for _ in range(args.clients * mult)]
    random.Random(args.seed).shuffle(starts)
    tasks = [asyncio.create_task(client(tenant, weight)) for tenant, weight in starts]
    sampling = asyncio.create_task(sampler())
    await asyncio.sleep(args.seconds)
    for task in [*tasks, sampling]:
        task.cancel()
    await asyncio.gather(*tasks, sampling, return_exceptions=True)
    close_dispatcher = getattr(dispatcher, "close", None)
    if close_dispatcher is not None:
        await close_dispatcher()
    await stop_replicas(replicas)
    gaps = [max(s["service"].values()) - min(s["service"].values()) for s in samples]
    # After the first wave (dispatched at once, before any queue forms) has finished.
    steady = [g for g, s in zip(gaps, samples, strict=True) if s["t"] >= args.warmup]
    total = sum(service.values())
    return {
        "dispatcher": name,
        "seconds": args.seconds,
        "service": service,
        "share": {t: v / total if total else 0.0 for t, v in service.items()},
        "output_tokens": output,
        "completed": completed,
        "max_gap": max(gaps, default=0.0),
        "max_gap_steady": max(steady, default=0.0),
        "final_gap": gaps[-1] if gaps else 0.0,
        "jain": jain(list(service.values())),
        "throughput_tokens_per_s": sum(output.values()) / args.seconds,
        "throughput_requests_per_s": sum(completed.values()) / args.seconds,
        "samples": samples,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fair scheduler, the same bounded by KV alone, then FCFS, on fresh replicas with the same workload
    seed."""

    def fair(replicas: list[Replica]) -> Dispatcher:
        return Scheduler(replicas, router(), ADMISSION, now)

    kv_only = msgspec.structs.replace(REPLICA, engine_queue=UNBOUNDED)
    return [
        await measure("fair", fair, args),
        await measure("fair-kv", fair, args, kv_only),
        await measure("fcfs", FifoDispatcher, args),
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per dispatcher: throughput, per-tenant share of service, max gap, Jain's index."""
    names = list(rows[0]["share"])
    header = ["dispatcher", "tok/s", "req/s", *(f"{n} %" for n in names), "max gap", "steady gap", "Jain"]
    lines = ["  ".join(f"{h:>10}" for h in header)]
    for row in rows:
        cells = [
            row["dispatcher"],
            f"{row['throughput_tokens_per_s']:.0f}",
            f"{row['throughput_requests_per_s']:.1f}",
            *(f"{100 * row['share'][n]:.1f}" for n in names),
            f"{row['max_gap']:.0f}",
            f"{row['max_gap_steady']:.0f}",
            f"{row['jain']:.3f}",
        ]
        lines.append("  ".join(f"{c:>10}" for c in cells))
    lines.append("")
    lines.append("max gap: largest difference in service per weight (weighted tokens) between two tenants")
    lines.append(
        "at any sample (steady: after the warm-up); shares are of the weighted service over the run."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.fairness", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="virtual seconds per dispatcher (60)")
    parser.add_argument("--replicas", type=int, default=3, help="simulated replicas (3)")
    parser.add_argument("--clients", type=int, default=40, help="closed-loop clients per light tenant (40)")
    parser.add_argument("--ratio", type=int, default=10, help="heavy tenant's clients per light one's (10)")
    parser.add_argument(
        "--kv-tokens", type=int, default=ENGINE.kv_capacity_tokens, help="KV cache per replica (12000)"
    )
    parser.add_argument("--sample", type=float, default=1.0, help="virtual seconds between samples (1)")
    parser.add_argument("--warmup", type=float, default=10.0, help="virtual s before the steady gap (10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("fairness.json"), help="where to write figures")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.replicas, args.clients, args.sample, args.warmup = 20.0, 2, 30, 0.5, 10.0
    started = time.perf_counter()
    rows = run_virtual(run(args))
    wall = time.perf_counter() - started
    print(
        f"fairness benchmark: {args.replicas} replicas, {args.seconds:g} virtual s per dispatcher, "
        f"tenants {args.clients * args.ratio}:{args.clients}:{args.clients}:{args.clients} clients, "
        f"{args.kv_tokens} KV tokens and {ENGINE.max_batch} sequences per replica "
        f"(wall {wall:.1f} s)"
    )
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {**vars(args), "json": str(args.json)}, "runs": rows}, indent=1))
    print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
