"""`lockgate bench`: options, and a run from them (the workload file first, options over it)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from ops.bench.load.report import render
from ops.bench.load.run import run, write_outputs
from ops.bench.load.workload import Tenant, Workload, WorkloadError, load_workload, with_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `lockgate bench`."""
    parser.add_argument(
        "--base-url", required=True, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument(
        "--api-key", default=None, help="key of a single tenant (or give [[tenants]] in --workload)"
    )
    parser.add_argument(
        "--workload", type=Path, default=None, help="workload TOML (see ops/bench/load/workload.py)"
    )
    parser.add_argument("--rate", type=float, default=None, help="mean arrivals per second (default 10)")
    parser.add_argument("--arrival", choices=("poisson", "bursty"), default=None, help="arrival process")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    limit.add_argument("--requests", type=int, default=None, help="number of requests (default 100)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-out"), help="directory for report.json and plots"
    )
    parser.add_argument("--model", default=None, help="model name sent in each request")
    parser.add_argument(
        "--cancel-fraction", type=float, default=None, help="share of requests the client cancels"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the arrivals, lengths and prompts")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload file (or the defaults) with the options given over it."""
    workload = load_workload(args.workload) if args.workload is not None else Workload()
    if args.api_key is not None:
        # A key on the command line replaces the file's tenants with one interactive tenant.
        workload = with_overrides(workload, tenants=[Tenant(name="default", api_key=args.api_key)])
    elif not workload.tenants:
        raise WorkloadError("give --api-key, or tenants in the workload file")
    return with_overrides(
        workload,
        rate=args.rate,
        process=args.arrival,
        duration=args.duration,
        requests=args.requests,
        model=args.model,
        cancel_fraction=args.cancel_fraction,
        seed=args.seed,
    )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; print the summary and write the outputs."""
    try:
        workload = workload_of(args)
    except WorkloadError as exc:
        print(f"lockgate bench: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_bench(workload, args))
    except KeyboardInterrupt:
        print("lockgate bench: interrupted; nothing written", file=sys.stderr)
        return 130
    return 0


async def _bench(workload: Workload, args: argparse.Namespace) -> None:
    report = await run(workload, args.base_url, progress_to=None if args.quiet else sys.stderr)
    written = await write_outputs(report, args.out, lambda line: print(f"[bench] {line}", file=sys.stderr))
    print(render(report))
    for path in written:
        print(f"wrote {path}")
