"""Worker scaling: requests per second of `lockgate serve --workers N` for each N, in one run.

    python -m ops.bench.workers [--workers 1 2] [--rates 200 300 ...] [--seconds 3] [--server-cores 0 1]
                                [--client-core 1] [--postgres-dsn DSN] [--out DIR] [--quick]

Each N is one gateway on the zero-delay simulated engine with what several workers need (the Redis quota
store and console sessions, PostgreSQL storage in a schema of its own, dropped after), its processes pinned
to `--server-cores`; the load generator runs here on `--client-core`. At each rate (rising), whole answers
arrive open-loop (Poisson) for `--seconds`, to each N in turn, until every N saturates (the rule of
`ops.bench.overhead`). Figures per N: the best rate served unsaturated, CPU per request (every worker and the
parent), latency p50/p99 at the rates all N served; the scaling ratio is the best rate of N over that of the
first N. The load generator shares the machine: with as many cores as workers, its own CPU is part of what
limits the figure. Written as `workers.json` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import msgspec

from ops.bench._overhead_report import Measure
from ops.bench._servers import Server, start_gateway
from ops.bench.overhead import Endpoint, measure, pinned_run, warmup


class WorkersSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One N: its best unsaturated rate and what it cost there."""

    workers: int
    max_unsaturated_per_s: float
    cpu_per_request_ms: float  # at that rate
    scaling: float  # max_unsaturated_per_s over the first N's


class WorkersReport(msgspec.Struct, frozen=True, kw_only=True):
    """The whole run."""

    seconds_per_step: float
    server_cores: list[int]
    client_core: int
    measures: list[Measure]
    summaries: list[WorkersSummary]


async def _drop_schema(dsn: str, name: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
    finally:
        await conn.close()


async def _start(n: int, args: argparse.Namespace, workdir: Path, schema: str) -> Server:
    env = {
        "LOCKGATE_STORAGE__BACKEND": "postgres",
        "LOCKGATE_STORAGE__POSTGRES_DSN": args.postgres_dsn,
        "LOCKGATE_STORAGE__POSTGRES_SCHEMA": schema,
        "LOCKGATE_CONSOLE__SESSION_STORE": "redis",
        "LOCKGATE_IDEMPOTENCY__BACKEND": "redis",
        "LOCKGATE_SESSIONS__BACKEND": "redis",
        "LOCKGATE_AUDIT__SPOOL_DIR": str(workdir / "spool"),
    }
    return await start_gateway(
        "redis", set(args.server_cores), workdir, "none", workers=n, env=env, target=f"workers-{n}"
    )


async def run(args: argparse.Namespace, workdir: Path) -> WorkersReport:
    """Each N's gateway, then every rate, the Ns interleaved."""
    schema = f"bench_{secrets.token_hex(4)}"
    servers: list[Server] = []
    targets: list[Endpoint] = []
    measures: list[Measure] = []
    try:
        for n in args.workers:
            servers.append(await _start(n, args, workdir / f"workers-{n}", schema))
            print(f"[workers] {n}: pid {servers[-1].proc.pid}, port {servers[-1].port}", flush=True)
        targets = [Endpoint(s, args.model) for s in servers]
        for target in targets:
            await measure(target, "whole", args.rates[0], warmup(args), seed=0)
        live = list(targets)
        for step, rate in enumerate(args.rates):
            seed = 1000 * (step + 1)
            step_measures = [await measure(t, "whole", rate, args, seed) for t in live]
            measures.extend(step_measures)
            print(
                f"[workers] {rate:g}/s: "
                + ", ".join(
                    f"{m.target} {m.achieved_per_s:.0f}/s p50 {1000 * m.latency.p50:.2f} ms "
                    f"cpu {m.cpu_per_request_ms:.2f} ms/req" + (" SAT" if m.saturated else "")
                    for m in step_measures
                ),
                flush=True,
            )
            live = [t for t, m in zip(live, step_measures, strict=True) if not m.saturated]
            if not live:
                break
    finally:
        for target in targets:
            await target.pool.close()
        for server in servers:
            server.stop()
        await _drop_schema(args.postgres_dsn, schema)
    return WorkersReport(
        seconds_per_step=args.seconds,
        server_cores=sorted(args.server_cores),
        client_core=args.client_core,
        measures=measures,
        summaries=summarise(args.workers, measures),
    )


def summarise(workers: Sequence[int], measures: Sequence[Measure]) -> list[WorkersSummary]:
    """Per N, its best unsaturated step; scaling against the first N."""
    best: dict[int, Measure] = {}
    for n in workers:
        served = [m for m in measures if m.target == f"workers-{n}" and not m.saturated]
        if served:
            best[n] = max(served, key=lambda m: m.offered_per_s)
    base = best[workers[0]].offered_per_s if workers[0] in best else 0.0
    return [
        WorkersSummary(
            workers=n,
            max_unsaturated_per_s=m.offered_per_s,
            cpu_per_request_ms=m.cpu_per_request_ms,
            scaling=m.offered_per_s / base if base else 0.0,
        )
        for n, m in best.items()
    ]


def format_table(report: WorkersReport) -> str:
    """The summary as a text table."""
    lines = ["workers  best rate unsaturated  CPU/request  scaling"]
    for s in report.summaries:
        lines.append(
            f"{s.workers:>7}  {s.max_unsaturated_per_s:>17.0f}/s  {s.cpu_per_request_ms:>8.2f} ms  "
            f"{s.scaling:>6.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run, print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.workers", description=__doc__.splitlines()[0])
    cores = sorted(os.sched_getaffinity(0))
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ns to compare (1 2)")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[200, 300, 400, 500, 600, 800, 1000, 1200, 1500, 2000]
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of arrivals per step (3)")
    parser.add_argument("--server-cores", type=int, nargs="+", default=cores, help="cores of the gateways")
    parser.add_argument("--client-core", type=int, default=cores[-1], help="core of the load generator")
    parser.add_argument("--postgres-dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name in requests")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    parser.add_argument("--prompt-words", type=int, default=20, help="prompt length, ~tokens (20)")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds one request may take (15)")
    parser.add_argument("--out", type=Path, default=Path("workers"), help="where to write the report")
    parser.add_argument("--quick", action="store_true", help="a smoke run: two low rates, 1 s each")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.seconds = [50.0, 100.0], 1.0
    report = pinned_run(partial(run, args), args.client_core, "lockgate-workers-", set(cores))
    print(format_table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "workers.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    print(f"wrote {args.out / 'workers.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
