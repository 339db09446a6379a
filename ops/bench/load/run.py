"""The open-loop driver: every planned request starts at its arrival time whether or not earlier ones have
finished (a closed loop would slow down with the server and hide its queueing), each in its own task."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

import httpx

from ops.bench.load import plots
from ops.bench.load.client import Sample, request_body, send
from ops.bench.load.plan import Planned, make_plan
from ops.bench.load.report import Report, build_report, encode
from ops.bench.load.workload import Workload


class Progress:
    """Counters of a run in progress, for the progress line."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0
        self.done = 0
        self.rejected = 0
        self.errors = 0

    def line(self, elapsed: float) -> str:
        """One progress line."""
        # Invariant: done <= sent <= total; in flight = sent - done.
        return (
            f"[bench] {elapsed:6.1f} s  sent {self.sent}/{self.total}  done {self.done}  "
            f"in flight {self.sent - self.done}  rejected {self.rejected}  errors {self.errors}"
        )

    def record(self, sample: Sample) -> None:
        """Count a finished request."""
        self.done += 1
        self.rejected += sample.status == "rejected"
        self.errors += sample.status == "error"


def chat_url(base_url: str) -> str:
    """`{base_url}/v1/chat/completions`; a base URL that already ends in /v1 (as OpenAI clients take it)
    is accepted too."""
    base = base_url.rstrip("/")
    return f"{base.removesuffix('/v1')}/v1/chat/completions"


async def _show(progress: Progress, clock: Callable[[], float], origin: float, out: TextIO) -> None:
    while True:
        await asyncio.sleep(1.0)
        print(progress.line(clock() - origin), file=out, flush=True)


@contextlib.contextmanager
def quiet_gc(*, collect: bool = True) -> Iterator[None]:
    """The load generator's heap as it is now (imports, the plan's prompts, earlier results) out of every
    garbage collection's walk while it offers load, or with `collect=False` no collection at all (a short
    step): a full collection stopped it for 250-370 ms on a slow machine, and the requests it was sending or
    reading then counted that as the server's latency."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    if not collect:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        if not frozen:  # a caller that had frozen its own heap (a test session) keeps it frozen
            gc.unfreeze()


async def _launch(
    http: httpx.AsyncClient,
    url: str,
    plan: Sequence[Planned],
    workload: Workload,
    progress: Progress,
    clock: Callable[[], float],
    origin: float,
) -> list[Sample]:
    async def one(planned: Planned, body: bytes) -> Sample:
        progress.sent += 1
        sample = await send(http, url, planned, body, clock, origin)
        progress.record(sample)
        return sample

    tasks: list[asyncio.Task[Sample]] = []
    try:
        for planned in plan:
            # The body is built before the wait, so building a long prompt never delays the send.
            body = request_body(planned, workload.model, workload.extra_body)
            delay = origin + planned.at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(planned, body)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run(
    workload: Workload,
    base_url: str,
    *,
    progress_to: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Report:
    """Send the workload's requests to `base_url` at their arrival times; the report once all have ended.
    A progress line goes to `progress_to` once a second."""
    plan = make_plan(workload)
    progress = Progress(len(plan))
    # No pool limit: a bounded pool would queue requests in the client and close the loop.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(workload.timeout, connect=min(10.0, workload.timeout))
    with quiet_gc():
        async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as http:
            started_at, origin = time.time(), clock()
            show = None if progress_to is None else _show(progress, clock, origin, progress_to)
            shower = None if show is None else asyncio.create_task(show)
            try:
                samples = await _launch(http, chat_url(base_url), plan, workload, progress, clock, origin)
            finally:
                if shower is not None:
                    shower.cancel()
                    await asyncio.gather(shower, return_exceptions=True)
            duration = clock() - origin
    if progress_to is not None:
        print(progress.line(duration), file=progress_to, flush=True)
    return build_report(samples, workload, target=base_url, started_at=started_at, duration_s=duration)


async def write_outputs(report: Report, out_dir: Path, say: Callable[[str], None]) -> list[Path]:
    """`report.json` and, with matplotlib installed, the PNG plots, into `out_dir` (off the event loop)."""
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    path = out_dir / "report.json"
    await asyncio.to_thread(path.write_bytes, encode(report))
    written = [path]
    if plots.available():
        written += await asyncio.to_thread(plots.write_plots, report, out_dir)
    else:
        say("matplotlib is not installed: no plots (install the dev extra: pip install -e '.[dev]')")
    return written
