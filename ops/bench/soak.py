"""Soak benchmark: the gated gateway under steady load for minutes, with clients leaving mid-stream and its
engine killed and restarted, then checked for what should be back where it started.

    python -m ops.bench.soak [--minutes 10] [--rate 300] [--engine simulated|embedded]
                             [--guard rules|trained|...] [--storage sqlite|postgres]
                             [--cancel-fraction 0.05] [--kills 2] [--max-tokens 32] [--prompt-words 32]
                             [--warmup 0.2] [--server-core C] [--client-core C] [--out DIR]

One gateway (`ops.bench._soak_server`: `lockgate serve` on the zero-delay simulator, the default policy
`--guard` with its audit trail on `--storage`, memory quotas, the default overload settings) pinned to one
core, and an open-loop client on the other (raw HTTP/1.1 on keep-alive connections, as the overhead bench's:
httpx's pool scans all its connections for each request and fell behind past a few thousand in flight):
Poisson arrivals at `--rate`, every request streamed, `--cancel-fraction` of them closed by their client after
one to three chunks with text. The engine is killed `--kills` times, evenly over the run (SIGUSR1 to the
server), and its supervisor starts a new one. The server's RSS is read every second. Once the last request
has ended, the checks (each printed PASS or FAIL; exit 1 on any FAIL):

- **memory**: RSS grew less than 5% from the end of the warm-up (the first `--warmup` of the run) to the end;
- **engine**: nothing left in flight: the engine's running and waiting requests as the router counts them,
  the admission queue, the open streams and the overload gate's in-flight count all back to 0 within 30 s;
- **audit**: no "not recorded" line in the server's log (a gate decision the trail could not take);
- **quota**: every reservation settled: reservations = settlements + no-ops, none given up;
- **dead engines**: every killed engine collected once a full collection ran (SIGUSR2: the server logs how
  many are still referenced).

`--engine embedded` soaks the embedded default instead (vLLM in the process, its engine core killed with
SIGKILL; give `--guard trained` for its default policy, and its own rate, lengths and timeout).

The rate to soak at is 80% of the gateway's best unsaturated rate (`python -m ops.bench.overhead --guards
rules`, streams) on the same machine; the report says what was offered and served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec

from gateway.config import DEFAULT_MODEL_NAME
from gateway.quantile import nearest_rank
from ops.bench._http import Pool, Timed, request_head
from ops.bench._servers import Server, drop_schema, start_gateway
from ops.bench._soak_server import DEAD_LINE
from ops.bench.load.arrivals import arrival_times
from ops.bench.load.workload import Arrival
from ops.bench.overhead import body, pinned_run

# Seconds the gateway has, after the last request ended, to show nothing in flight.
QUIET_WITHIN_S = 30.0
# Gauges that are 0 when nothing is in flight (summed over their labels).
IN_FLIGHT_GAUGES = (
    "lockgate:engine_queue_depth",
    "lockgate:engine_in_flight",
    "lockgate:admission_queue_depth",
    "lockgate:active_streams",
    "lockgate:in_flight_requests",
)
RSS_GROWTH_LIMIT = 0.05


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One soak criterion and what was measured for it."""

    name: str
    ok: bool
    detail: str


class LoadSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the clients sent and got."""

    sent: int
    offered_per_s: float
    completed: int  # 200, read to the end
    closed: int  # 200, left mid-stream by the client on purpose
    by_status: dict[str, int]  # every answer by status ("0": a transport failure or timeout)
    first_text_p50_ms: float | None
    first_text_p99_ms: float | None

    def brief(self) -> str:
        """One line."""
        statuses = ", ".join(f"{n} x {status}" for status, n in sorted(self.by_status.items()))
        first = (
            f"first text p50 {self.first_text_p50_ms:.1f} ms, p99 {self.first_text_p99_ms:.1f} ms"
            if self.first_text_p50_ms is not None and self.first_text_p99_ms is not None
            else "no text"
        )
        return (
            f"{self.sent} streams at {self.offered_per_s:.1f}/s: {self.completed} completed, "
            f"{self.closed} left by their client; {statuses}; {first}"
        )


class SoakReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one soak run measured."""

    seconds: float
    rate: float
    engine: str
    guard: str
    storage: str
    kills: int
    cancel_fraction: float
    rss_mb: list[tuple[float, float]]  # (seconds into the run, RSS in MB)
    load: LoadSummary
    metrics_at_rest: dict[str, float]
    checks: list[Check]

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(c.ok for c in self.checks)


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` (any labels) in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _metrics(server: Server) -> str:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
        response = await http.get("/metrics")
        response.raise_for_status()
        return response.text


async def _at_rest(server: Server) -> dict[str, float]:
    """The in-flight gauges once all are 0, or as they were after QUIET_WITHIN_S."""
    deadline = time.monotonic() + QUIET_WITHIN_S
    while True:
        text = await _metrics(server)
        values = {name: metric_sum(text, name) for name in IN_FLIGHT_GAUGES}
        if not any(values.values()) or time.monotonic() > deadline:
            quota = ("reservations", "settlements", "settle_noops", "settle_failures")
            values.update({q: metric_sum(text, f"lockgate:quota_{q}_total") for q in quota})
            return values
        await asyncio.sleep(0.2)


async def _dead_engines(server: Server) -> str:
    """The server's own count of killed engines still referenced (its log line), after SIGUSR2."""
    assert server.log is not None
    server.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log.read_text(errors="replace").splitlines() if DEAD_LINE in line]
        if lines:
            return lines[-1].split(DEAD_LINE, 1)[1].strip()
        await asyncio.sleep(0.2)
    return "no answer"


async def _sample_rss(server: Server, origin: float, into: list[tuple[float, float]]) -> None:
    while True:
        into.append((time.monotonic() - origin, server.ps.memory_info().rss / 2**20))
        await asyncio.sleep(1.0)


async def offer(server: Server, args: argparse.Namespace, seconds: float) -> LoadSummary:
    """Poisson arrivals at `args.rate` for `seconds`, every request streamed, `args.cancel_fraction` of them
    left after one to three chunks with text; once every answer is in."""
    rng = random.Random(7)
    pool = Pool("127.0.0.1", server.port, limit=4096)
    head = request_head("/v1/chat/completions", f"127.0.0.1:{server.port}", server.api_key)
    clock = time.perf_counter
    tally: Counter[str] = Counter()
    firsts: list[float] = []
    pending: set[asyncio.Task[None]] = set()

    async def one(index: int) -> None:
        payload = body(index, "stream", DEFAULT_MODEL_NAME, args.prompt_words, args.max_tokens, index)
        leave = rng.randint(1, 3) if rng.random() < args.cancel_fraction else None
        timed: Timed = await pool.post(head, payload, clock, within=args.timeout, close_after=leave)
        tally[str(timed.status)] += 1
        if timed.status == 200:
            tally["closed" if timed.closed else "completed"] += 1
        if timed.first is not None:
            firsts.append(timed.first)

    times = arrival_times(Arrival(rate=args.rate), rng, duration=seconds)
    origin = clock()
    for index, at in enumerate(times):
        delay = origin + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(index))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)
    await pool.close()
    return LoadSummary(
        sent=len(times),
        offered_per_s=len(times) / seconds,
        completed=tally.pop("completed", 0),
        closed=tally.pop("closed", 0),
        by_status=dict(tally),
        first_text_p50_ms=1000 * nearest_rank(firsts, 0.5) if firsts else None,
        first_text_p99_ms=1000 * nearest_rank(firsts, 0.99) if firsts else None,
    )


async def _kill_engine(server: Server, at: float) -> None:
    await asyncio.sleep(at)
    server.proc.send_signal(signal.SIGUSR1)


def checks(
    rss: list[tuple[float, float]], warmup_s: float, rest: dict[str, float], unrecorded: int, dead: str
) -> list[Check]:
    """The soak's criteria from what was measured (module docstring)."""
    after = [mb for at, mb in rss if at >= warmup_s]
    base, last = (after[0], after[-1]) if after else (0.0, 0.0)
    growth = (last - base) / base if base else 0.0
    left = {name: value for name, value in rest.items() if name in IN_FLIGHT_GAUGES and value}
    open_reservations = rest["reservations"] - rest["settlements"] - rest["settle_noops"]
    return [
        Check(
            name="memory",
            ok=bool(after) and growth < RSS_GROWTH_LIMIT,
            detail=f"RSS {base:.1f} MB after warm-up, {last:.1f} MB at the end ({100 * growth:+.1f}%)",
        ),
        Check(
            name="engine",
            ok=not left,
            detail="nothing in flight" if not left else ", ".join(f"{k} {v:g}" for k, v in left.items()),
        ),
        Check(name="audit", ok=unrecorded == 0, detail=f"{unrecorded} decisions not recorded"),
        Check(
            name="quota",
            ok=open_reservations == 0 and rest["settle_failures"] == 0 and rest["reservations"] > 0,
            detail=(
                f"{rest['reservations']:g} reservations, {rest['settlements']:g} settled, "
                f"{rest['settle_noops']:g} no-ops, {rest['settle_failures']:g} given up"
            ),
        ),
        Check(name="dead engines", ok=dead.startswith("0 of"), detail=f"still referenced: {dead}"),
    ]


async def soak(args: argparse.Namespace, workdir: Path) -> SoakReport:
    """Start the gateway, load it, kill its engine, and check it at rest."""
    seconds = 60 * args.minutes
    server = await start_gateway(
        "memory",
        # vLLM's engine core (a child process) takes every core the gateway may use, as `make serve` would.
        set(args.cores) if args.engine == "embedded" else {args.server_core},
        workdir,
        args.guard,
        storage=args.storage,
        # The embedded default: vLLM in the process (its core in a child process), the model prepared.
        env={"LOCKGATE_ENGINE__KIND": "vllm_local"} if args.engine == "embedded" else None,
        command=["-m", "ops.bench._soak_server"],
    )
    try:
        rss: list[tuple[float, float]] = []
        origin = time.monotonic()
        sampler = asyncio.create_task(_sample_rss(server, origin, rss))
        killers = [
            asyncio.create_task(_kill_engine(server, seconds * (k + 1) / (args.kills + 1)))
            for k in range(args.kills)
        ]
        try:
            load = await offer(server, args, seconds)
        finally:
            for task in (sampler, *killers):
                task.cancel()
            await asyncio.gather(sampler, *killers, return_exceptions=True)
        rest = await _at_rest(server)
        rss.append((time.monotonic() - origin, server.ps.memory_info().rss / 2**20))
        dead = await _dead_engines(server)
        unrecorded = server.unrecorded()
    finally:
        server.stop()
        if server.schema:
            await drop_schema(server.schema)
    return SoakReport(
        seconds=seconds,
        rate=args.rate,
        engine=args.engine,
        guard=args.guard,
        storage=args.storage,
        kills=args.kills,
        cancel_fraction=args.cancel_fraction,
        rss_mb=rss,
        load=load,
        metrics_at_rest=rest,
        checks=checks(rss, args.warmup * seconds, rest, unrecorded, dead),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one soak; print the load summary and each check; exit 1 on a failed check."""
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.soak", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=300.0, help="requests per second (300)")
    parser.add_argument(
        "--engine",
        choices=("simulated", "embedded"),
        default="simulated",
        help="the zero-delay simulator, or the embedded default's vLLM (`lockgate models prepare` first)",
    )
    parser.add_argument("--guard", choices=("none", "rules", "embedding", "trained"), default="rules")
    parser.add_argument("--storage", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--cancel-fraction", type=float, default=0.05)
    parser.add_argument("--kills", type=int, default=2, help="engine kills, evenly over the run (2)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=32, help="prompt length, ~tokens (32)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without progress (60)")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS counts")
    cores = sorted(os.sched_getaffinity(0))
    parser.add_argument("--server-core", type=int, default=cores[0])
    parser.add_argument("--client-core", type=int, default=cores[-1])
    parser.add_argument("--out", type=Path, default=None, help="write soak.json here")
    args = parser.parse_args(argv)
    args.cores = cores
    report = pinned_run(lambda tmp: soak(args, tmp), args.client_core, "lockgate-soak-", set(cores))
    print(report.load.brief())
    for check in report.checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_bytes(json.dumps(msgspec.to_builtins(report), indent=1).encode())
        print(f"wrote {args.out / 'soak.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
