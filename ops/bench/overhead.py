"""Overhead benchmark: what the gateway adds to an engine, in latency and CPU, up to saturation.

    python -m ops.bench.overhead [--rates 100 200 400 ...] [--seconds 3] [--modes whole stream]
                                 [--quotas memory redis [redis-lease]] [--max-tokens 16]
                                 [--guards none [rules] [embedding]] [--storage sqlite [postgres]]
                                 [--out DIR] [--overload [--overload-rate R]] [--quick]

Three servers on the same zero-delay simulated engine, each a child process pinned to `--server-core`: the
mock OpenAI server (`ops.bench._mock_openai`, the engine alone) and `lockgate serve` with the memory and the
Redis quota store (`redis-lease`: Redis granting from leases, `[quota.lease]`). The load generator runs here,
pinned to `--client-core`. At each rate, in each mode (whole answers, streams), the same open-loop Poisson
load (`ops.bench.load.arrivals`) goes for `--seconds` to the mock and then to each gateway, so every gateway
figure has a baseline measured moments before it. Rates rise until every gateway saturates: it completes less
than 90% of the rate it was sent, more than 1% of its requests fail, or its median latency passes 50 ms
(requests queue). Figures: latency p50/p99 (the whole answer) and what the gateway adds to the mock's at the
lowest rate; server CPU per request and per streamed chunk (user + system of its process over the step, idle
work included) at the highest unsaturated rate, and per chunk beyond a whole answer; the best rate served
unsaturated. Written as `overhead.json` and `overhead.png` under `--out`. The machine is shared and has two
cores: figures are noisy, so compare within one run.

The gate (issue 44): `--guards none rules embedding` starts one gateway per default policy (for each quota
store and each `--storage`), the audit trail on as always, and reports what each gated one costs beyond its
twin with `none` in the same run: CPU per request at the same rate (and its ratio), CPU per streamed chunk
beyond the twin's, and the p50 and p99 latency beyond the twin's at the lowest rate. `embedding` is rules
then the MiniLM embedding guard on this CPU (`policy.safety.defaults.embedding_policy`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from ops.bench._http import Pool, Timed, request_head
from ops.bench._overhead_report import (
    Measure,
    Mode,
    OverheadReport,
    OverloadMeasure,
    Point,
    format_table,
    gate_costs,
    onset_bins,
    percentiles,
    plot,
    summarise,
)
from ops.bench._servers import QUOTAS, STORAGES, Server, drop_schema, start_gateway, start_mock
from ops.bench.load.arrivals import arrival_times
from ops.bench.load.plan import synthetic_prompt
from ops.bench.load.run import quiet_gc
from ops.bench.load.workload import Arrival

T = TypeVar("T")
_encoder = msgspec.json.Encoder()
SATURATED_SHARE = 0.9  # completed / sent rate below this is saturation
ERROR_SHARE = 0.01  # failed requests above this share is saturation
QUEUEING_P50_S = 0.05  # a median latency above this is queueing: saturation
# The overload step's requests sent this long after its start: its steady state, past the onset (the load
# jumps from nothing to twice saturation when the step begins).
STEADY_AFTER_S = 1.0
# ... and its start in slices: the latency of each slice's slowest request, admitted and shed.
ONSET_BIN_S, ONSET_S = 0.05, 0.5
SHED_SERIES = 'lockgate:shed_requests_total{reason="'


class Endpoint:
    """One server with its connection pool and request head."""

    def __init__(self, server: Server, model: str) -> None:
        """Bind a started server."""
        self.server = server
        self.model = model
        self.pool = Pool("127.0.0.1", server.port)
        self.head = request_head("/v1/chat/completions", f"127.0.0.1:{server.port}", server.api_key)


def body(index: int, mode: Mode, model: str, words: int, max_tokens: int, seed: int) -> bytes:
    """A chat request with a prompt of its own (no cache can answer it)."""
    payload: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": synthetic_prompt(index, words, random.Random(seed))}],
        "max_tokens": max_tokens,
    }
    if mode == "stream":
        payload["stream"] = True
    return _encoder.encode(payload)


class Offered(msgspec.Struct, frozen=True, kw_only=True):
    """What one server answered to one step of open-loop load."""

    results: list[Timed]
    sent_at: list[float]  # each request's scheduled send, seconds into the step (results' order)
    cpu_s: float
    span_s: float  # from the first send to the last answer
    sent_rate: float
    lags: list[float]


async def offer(target: Endpoint, mode: Mode, rate: float, args: argparse.Namespace, seed: int) -> Offered:
    """Offer Poisson arrivals at `rate` for `args.seconds` to one server and wait for every answer."""
    rng = random.Random(seed)
    times = arrival_times(Arrival(rate=rate), rng, duration=args.seconds)
    bodies = [
        body(i, mode, target.model, args.prompt_words, args.max_tokens, seed + i) for i, _ in enumerate(times)
    ]
    clock = time.perf_counter
    done: list[float] = []
    lags: list[float] = []

    async def one(payload: bytes) -> Timed:
        timed = await target.pool.post(target.head, payload, clock, within=args.timeout)
        done.append(clock())
        return timed

    cpu_before = target.server.cpu_s()
    with quiet_gc(collect=False):
        origin = clock()
        tasks: list[asyncio.Task[Timed]] = []
        for at, payload in zip(times, bodies, strict=True):
            delay = origin + at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(clock() - origin - at)
            tasks.append(asyncio.create_task(one(payload)))
        last_sent = clock() - origin
        results = list(await asyncio.gather(*tasks))
    return Offered(
        results=results,
        sent_at=list(times),
        cpu_s=target.server.cpu_s() - cpu_before,
        span_s=(max(done) - origin) if done else 1.0,
        sent_rate=len(results) / max(last_sent, 1e-9),
        lags=lags,
    )


async def measure(target: Endpoint, mode: Mode, rate: float, args: argparse.Namespace, seed: int) -> Measure:
    """One step of load to one server, and its figures."""
    offered = await offer(target, mode, rate, args, seed)
    results, cpu = offered.results, offered.cpu_s
    ok = [r for r in results if r.status == 200 and r.total is not None]
    failed = [r for r in results if r.status != 200 or r.total is None]
    achieved = len(ok) / offered.span_s
    chunks = sum(r.chunks for r in ok)
    latency = percentiles([r.total for r in ok if r.total is not None])
    saturated = (
        achieved < SATURATED_SHARE * min(rate, offered.sent_rate)
        or len(failed) > ERROR_SHARE * len(results)
        or latency.p50 > QUEUEING_P50_S
    )
    return Measure(
        target=target.server.target,
        offered_per_s=rate,
        sent=len(results),
        completed=len(ok),
        errors=len(failed),
        achieved_per_s=achieved,
        latency=latency,
        first_chunk=percentiles([r.first for r in ok if r.first is not None]) if mode == "stream" else None,
        chunks=chunks,
        cpu_s=cpu,
        cpu_per_request_ms=1000 * cpu / max(len(ok), 1),
        cpu_per_chunk_us=1e6 * cpu / chunks if mode == "stream" and chunks else None,
        client_lag_p99_ms=1000 * percentiles(offered.lags).p99,
        saturated=saturated,
        error_sample=failed[0].error[:200] if failed else "",
    )


async def overload(
    target: Endpoint, mock: Endpoint, rate: float, args: argparse.Namespace, seed: int
) -> OverloadMeasure:
    """Whole answers at `rate` (twice what the gateway served unsaturated): how the admitted fare against
    the mock at the same rate, and how fast the shed are told (503 `overloaded`)."""
    baseline = await measure(mock, "whole", rate, args, seed)
    before = await shed_counts(target)
    offered = await offer(target, "whole", rate, args, seed)
    after = await shed_counts(target)

    def totals(status: int, since: float = 0.0) -> list[float]:
        return [
            r.total
            for r, at in zip(offered.results, offered.sent_at, strict=True)
            if r.status == status and r.total is not None and at >= since
        ]

    admitted, shed = totals(200), totals(503)
    others: dict[str, int] = {}
    samples: dict[str, str] = {}
    for r in offered.results:
        if r.status not in (200, 503):
            others[str(r.status)] = others.get(str(r.status), 0) + 1
            samples.setdefault(str(r.status), r.error[:200])
    return OverloadMeasure(
        target=target.server.target,
        offered_per_s=rate,
        sent=len(offered.results),
        admitted=len(admitted),
        shed=len(shed),
        other=len(offered.results) - len(admitted) - len(shed),
        other_by_status=others,
        other_sample=samples,
        admitted_latency=percentiles(admitted),
        shed_latency=percentiles(shed),
        steady_after_s=STEADY_AFTER_S,
        steady_admitted_latency=percentiles(totals(200, STEADY_AFTER_S)),
        steady_shed_latency=percentiles(totals(503, STEADY_AFTER_S)),
        mock=baseline,
        shed_by_reason={reason: n - before.get(reason, 0) for reason, n in after.items()},
        onset=onset_bins(
            [(at, r.status, r.total) for r, at in zip(offered.results, offered.sent_at, strict=True)],
            ONSET_BIN_S,
            ONSET_S,
        ),
    )


async def shed_counts(target: Endpoint) -> dict[str, int]:
    """The gateway's `lockgate:shed_requests_total` by reason, from its /metrics."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{target.server.port}", timeout=30) as http:
        response = await http.get("/metrics")
        response.raise_for_status()  # a refused scrape must not read as nothing shed
        text = response.text
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith(SHED_SERIES):
            labels, _, value = line.partition("} ")
            counts[labels.removeprefix(SHED_SERIES).strip('"')] = int(float(value))
    return counts


async def run(args: argparse.Namespace, workdir: Path) -> OverheadReport:
    """Start the servers, then every mode and rate, the mock and the gateways interleaved."""
    servers: list[Server] = []
    targets: list[Endpoint] = []
    pools: list[Pool] = []
    baselines: dict[str, str] = {}  # a gated gateway -> the same without a gate
    unrecorded: dict[str, int] = {}  # a gateway -> decisions its audit trail could not take
    try:
        servers.append(await start_mock(args.server_core, workdir / "mock"))
        for quota, storage, guard in itertools.product(args.quotas, args.storage, args.guards):
            name = target_name(args, quota, storage, guard)
            if guard != "none" and "none" in args.guards:
                baselines[name] = target_name(args, quota, storage, "none")
            servers.append(
                await start_gateway(
                    quota,
                    {args.server_core},
                    workdir / name.replace("/", "-"),
                    guard,
                    target=name,
                    storage=storage,
                )
            )
        for server in servers:
            print(f"[overhead] {server.target}: pid {server.proc.pid}, port {server.port}", flush=True)
        targets = [Endpoint(s, args.model) for s in servers]
        pools = [t.pool for t in targets]
        for target in targets:  # connections, caches and first-call imports, outside any figure
            for mode in args.modes:
                await measure(target, mode, args.rates[0], warmup(args), seed=0)
        points: list[Point] = []
        for mode in args.modes:
            live = targets[1:]
            for step, rate in enumerate(args.rates):
                seed = 1000 * (step + 1)
                mock = await measure(targets[0], mode, rate, args, seed)
                gateways = [await measure(t, mode, rate, args, seed) for t in live]
                points.append(Point(mode=mode, rate=rate, mock=mock, gateways=gateways))
                print(f"[overhead] {mode} {rate:g}/s: " + _brief([mock, *gateways]), flush=True)
                live = [t for t, m in zip(live, gateways, strict=True) if not m.saturated]
                if not live:
                    break
        summaries = summarise(points)
        overloads = []
        if args.overload:
            for target in targets[1:]:
                best = next(
                    (
                        s.max_unsaturated_per_s
                        for s in summaries
                        if s.mode == "whole" and s.quota == target.server.target
                    ),
                    0.0,
                )
                rate = args.overload_rate or 2 * best
                if rate > 0:
                    measured = await overload(target, targets[0], rate, args, seed=99)
                    overloads.append(measured)
                    print(
                        f"[overhead] overload {target.server.target} {rate:.0f}/s: {measured.brief()}",
                        flush=True,
                    )
    finally:
        for pool in pools:
            await pool.close()
        for server in servers:
            server.stop()
            if server.target != "mock":
                unrecorded[server.target] = server.unrecorded()
            if server.schema:
                await drop_schema(server.schema)
    return OverheadReport(
        seconds_per_step=args.seconds,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        guards=args.guards,
        storages=args.storage,
        server_core=args.server_core,
        client_core=args.client_core,
        points=points,
        summaries=summaries,
        overloads=overloads,
        gate_costs=gate_costs(points, baselines),
        unrecorded=unrecorded,
    )


def target_name(args: argparse.Namespace, quota: str, storage: str, guard: str) -> str:
    """A gateway's name in the report: its quota store, then its policy and storage where the run varies
    them or they are not the defaults (`none`, `sqlite`)."""
    parts = [quota]
    if args.guards != ["none"]:
        parts.append(guard)
    if args.storage != ["sqlite"]:
        parts.append(storage)
    return "/".join(parts)


def warmup(args: argparse.Namespace) -> argparse.Namespace:
    """`args` for a warm-up step: at most a second of load."""
    return argparse.Namespace(**{**vars(args), "seconds": min(args.seconds, 1.0)})


def _brief(measures: Sequence[Measure]) -> str:
    return ", ".join(
        f"{m.target} {m.achieved_per_s:.0f}/s p50 {1000 * m.latency.p50:.2f} ms"
        + (" SAT" if m.saturated else "")
        for m in measures
    )


def pinned_run(
    work: Callable[[Path], Coroutine[Any, Any, T]], client_core: int, prefix: str, cores: set[int]
) -> T:
    """Run `work` (given a scratch directory, removed after) on a uvloop event loop with this process pinned
    to `client_core`; its CPU affinity is `cores` again afterwards."""
    import uvloop

    os.sched_setaffinity(0, {client_core})
    try:
        with (
            tempfile.TemporaryDirectory(prefix=prefix) as tmp,
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
        ):
            return runner.run(work(Path(tmp)))
    finally:
        os.sched_setaffinity(0, cores)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the table, write the JSON and the plot."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[100, 200, 300, 400, 500, 700, 1000, 1500, 2000]
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of arrivals per step (3)")
    parser.add_argument("--modes", nargs="+", choices=["whole", "stream"], default=["whole", "stream"])
    parser.add_argument("--quotas", nargs="+", choices=QUOTAS, default=["memory", "redis"])
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (16)")
    parser.add_argument("--prompt-words", type=int, default=20, help="prompt length, ~tokens (20)")
    parser.add_argument(
        "--guards",
        nargs="+",
        choices=["none", "rules", "embedding"],
        default=["none"],
        help="the gateways' default policies (guard.default_policy); each gated one is compared with `none` "
        "when that runs too. `embedding` needs the prepared guards (`lockgate models prepare`)",
    )
    parser.add_argument(
        "--storage",
        nargs="+",
        choices=STORAGES,
        default=["sqlite"],
        help="where the gateways keep tenants, registry and the audit trail",
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name in requests")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds one request may take (15)")
    cores = sorted(os.sched_getaffinity(0))
    parser.add_argument("--server-core", type=int, default=cores[0], help="core of the servers")
    parser.add_argument("--client-core", type=int, default=cores[-1], help="core of the load generator")
    parser.add_argument("--out", type=Path, default=Path("overhead"), help="where to write the report")
    parser.add_argument(
        "--overload",
        action="store_true",
        help="after the sweep, whole answers at twice each gateway's best unsaturated rate: the admitted "
        "requests' latency and how fast the shed are refused",
    )
    parser.add_argument(
        "--overload-rate",
        type=float,
        default=0.0,
        help="the rate of the --overload step instead of twice the best unsaturated one (to compare runs)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: two low rates, 1 s each, memory")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.seconds, args.quotas = [50.0, 100.0], 1.0, ["memory"]
    report = pinned_run(partial(run, args), args.client_core, "lockgate-overhead-", set(cores))
    print(format_table(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    if plot(report, args.out / "overhead.png"):
        print(f"wrote {args.out / 'overhead.json'} and {args.out / 'overhead.png'}")
    else:
        print(f"wrote {args.out / 'overhead.json'} (no matplotlib: no plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
