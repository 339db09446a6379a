"""The gateway at its saturation rate on the Redis quota store meters every request (issue 7).

A gateway served in-process on the simulated engine (fast steps), with a Redis quota store built like
production (`RedisQuotaStore.from_url`, a blocking pool) but deliberately small, so that most operations wait
for a connection, is driven by many concurrent clients, streaming and not. Quotas are far too large to deny
and the tenant fails open: a request the meter wrongly took for "Redis unreachable" would be admitted
unmetered, and would show in the counters and in the bucket level. The clock is injected and frozen, and the
store uses the caller's time (`server_time=False`), so no bucket refills during the test and the final level
is an exact sum of the usage the responses reported.

Needs Redis on 127.0.0.1:6379 (fails, never skips, without it); its keys live under a fresh prefix that is
dropped afterwards. Rates and pool waits are printed, never asserted: only hang guards are timed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from policy.quota import BucketSpec, RedisQuotaStore, Reservation
from policy.quota.meter import applicable
from policy.tenants.models import Limits, Quotas, Tenant
from policy.tenants.sqlite import SqliteTenantStore
from tests.backends import REDIS_URL, FakeClock
from tests.conftest import MODEL, OutcomeLog, add_key, billed, make_config, serving

REQUESTS = 300
CLIENTS = 64
POOL_SIZE = 2
# A healthy Redis answers far within these, even on a loaded one-core machine where every slot's turn also
# waits for the event loop: neither may ever fire here (a busy pool would be a 503 quota_busy).
POOL_TIMEOUT = 30.0
OP_TIMEOUT = 5.0
# Far more than the test asks for, and no refill (the clock stands still): quotas never deny here.
REQUEST_BURST = 10.0 * REQUESTS
TOKEN_BURST = 10_000_000.0
LIMITS = Limits(
    requests_per_second=1.0, request_burst=REQUEST_BURST, tokens_per_second=1.0, token_burst=TOKEN_BURST
)
# Hang guards only, generous for a slow machine pinned to one core; never a measure of speed.
REQUEST_BOUND = 120.0
RUN_BOUND = 600.0
DRAIN_BOUND = 120.0


class CountingStore(RedisQuotaStore):
    """The production store, counting the operations that found every pool slot taken and had to wait.

    From entering `reserve`/`reconcile` to taking a slot nothing awaits, so an operation that enters while
    `POOL_SIZE` are already in flight is exactly one that waits for a slot (`levels` is not counted: the test
    calls it only once everything else has finished)."""

    in_flight = 0
    most_in_flight = 0
    waited = 0
    operations = 0
    longest = 0.0  # seconds, wait for a slot included

    def _enter(self) -> float:
        self.operations += 1
        if self.in_flight >= POOL_SIZE:
            self.waited += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return time.perf_counter()

    def _leave(self, entered: float) -> None:
        self.in_flight -= 1
        self.longest = max(self.longest, time.perf_counter() - entered)

    async def reserve(
        self,
        buckets: Sequence[BucketSpec],
        amounts: Sequence[float],
        now: float,
        reservation_id: str | None = None,
    ) -> Reservation:
        entered = self._enter()
        try:
            return await super().reserve(buckets, amounts, now, reservation_id)
        finally:
            self._leave(entered)

    async def reconcile(self, reservation: Reservation, actual: Sequence[float], now: float) -> bool:
        entered = self._enter()
        try:
            return await super().reconcile(reservation, actual, now)
        finally:
            self._leave(entered)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A fresh key prefix on the shared Redis; every key under it is dropped afterwards."""
    name = f"lockgate:test:{uuid.uuid4().hex}:"
    yield name
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{name}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def record_states(prefix: str) -> Counter[str]:
    """States of the reservation records under `prefix`: r = granted and unsettled, x = settled."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    states: Counter[str] = Counter()
    try:
        async for key in client.scan_iter(match=f"{prefix}res:*"):
            state = await client.hget(key, "s")
            states[state.decode() if isinstance(state, bytes) else str(state)] += 1
    finally:
        await client.aclose()
    return states


def body(i: int) -> dict[str, Any]:
    """Request `i`: prompts and lengths vary so that usage does; every third one streams (with usage)."""
    words = " ".join(["please"] * (i % 7))
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Question {i}: {words} say something."}],
        "max_tokens": 1 + i % 12,
    }
    if i % 3 == 0:
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
    return request


@dataclass(frozen=True)
class Answer:
    """What one request got: its status and id, whether it was metered (RateLimit headers), the usage it was
    told (prompt + completion tokens)."""

    index: int
    status: int
    request_id: str
    metered: bool
    used: int | None
    code: str | None = None  # the error code of a refusal


async def one(http: httpx.AsyncClient, key: str, i: int) -> Answer:
    """Send request `i`; read the usage from the JSON body, or from the last chunk of the stream."""
    request = body(i)
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/chat/completions", json=request, headers=headers) as response:
        rid = response.headers.get("x-request-id", "")
        metered = "RateLimit" in response.headers
        if response.status_code != 200:
            try:
                code = json.loads(await response.aread())["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
            return Answer(i, response.status_code, rid, metered, None, code)
        used: int | None = None
        if request.get("stream"):
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    usage = json.loads(line[len("data: ") :]).get("usage")
                    if usage:
                        used = billed(usage)
        else:
            usage = json.loads(await response.aread())["usage"]
            used = billed(usage)
        return Answer(i, response.status_code, rid, metered, used)


async def test_saturating_the_gateway_on_a_small_redis_pool_meters_every_request_exactly(
    tmp_path: Path,
    prefix: str,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> None:
    clock = FakeClock()  # Frozen: no refill, so the final levels are exact sums.
    tenants = await SqliteTenantStore.open(tmp_path / "tenants.sqlite3")
    tenant = await tenants.create_tenant(
        Tenant(tenant_id="acme", display_name="Acme", quotas=Quotas(tenant=LIMITS, fail_mode="open")),
        actor="test",
        now=clock(),
    )
    key = await add_key(tenants, "acme", ("consumer",), now=clock())
    store = CountingStore.from_url(
        REDIS_URL,
        pool_size=POOL_SIZE,
        pool_timeout=POOL_TIMEOUT,
        op_timeout=OP_TIMEOUT,
        prefix=prefix,
        server_time=False,
    )
    assert isinstance(store, CountingStore)
    app = create_app(
        make_config(),
        engine=sim_engine,
        renderer=renderer,
        tenants=tenants,
        quota=store,
        clock=clock,
        sink=outcomes,
    )
    answers: list[Answer] = []
    try:
        async with serving(app) as url:
            meter = app.state.services.meter
            numbers = itertools.count()

            async def client(http: httpx.AsyncClient) -> None:
                # A bounded loop: each client takes the next request number until all REQUESTS are sent.
                while (i := next(numbers)) < REQUESTS:
                    answers.append(await one(http, key, i))

            async with AsyncExitStack() as clients:
                # Made before the clock starts, sharing one TLS context: httpx loads the CA bundle for every
                # client it makes otherwise, which blocks the loop for longer than the whole load takes.
                tls = ssl.create_default_context()
                https = [
                    await clients.enter_async_context(
                        httpx.AsyncClient(base_url=url, timeout=REQUEST_BOUND, verify=tls)
                    )
                    for _ in range(CLIENTS)
                ]
                started, cpu = time.perf_counter(), time.process_time()
                async with asyncio.timeout(RUN_BOUND):
                    await asyncio.gather(*(client(http) for http in https))
                elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            # Every request that ran reported its outcome (which submits its settlement; a refused one never
            # ran and reports none, and the checks below say so), then every settlement ran.
            await outcomes.wait_count(sum(a.status == 200 for a in answers), within=DRAIN_BOUND)
            await meter.drain(DRAIN_BOUND)
            counters = Counter(meter.counters)
            stored = await tenants.get_key(key.split("-")[1])
            buckets = {name: b for name, b, _ in applicable(tenant, stored.key)}
            request_level, token_level = await store.levels(
                [buckets["tenant-requests"], buckets["tenant-tokens"]], clock()
            )
        states = await record_states(prefix)
    finally:
        await store.close()
        await tenants.close()

    print(
        f"\n{REQUESTS} requests from {CLIENTS} clients, Redis pool of {POOL_SIZE}: "
        f"{REQUESTS / elapsed:.0f} requests/s ({elapsed:.2f} s wall, {cpu:.2f} s CPU of this one process, "
        f"which runs both the gateway and its clients); "
        f"{store.waited} of {store.operations} quota operations waited for a pool slot "
        f"(most in flight or waiting at once: {store.most_in_flight}; "
        f"longest wait plus round trip {store.longest:.3f} s); counters {dict(counters)}"
    )

    # Every request was answered, 200, and metered (no 5xx, no quota_busy, nothing admitted unmetered).
    assert len(answers) == REQUESTS
    assert sorted(a.index for a in answers) == list(range(REQUESTS))
    wrong = [a for a in answers if (a.status, a.metered) != (200, True) or a.used is None]
    assert not wrong, wrong
    # The usage each client was told is the usage the gateway recorded (and settled) for its request.
    by_id = {o.request_id: o for o in outcomes.items}
    assert len(by_id) == REQUESTS
    for answer in answers:
        usage = by_id[answer.request_id].usage
        assert answer.used == billed(usage), answer

    # The meter granted every reservation and never took our own pool for an unreachable Redis ...
    assert counters["reserved"] == REQUESTS
    assert counters["reserve_unknown"] == 0
    assert counters["fail_open"] == 0
    assert counters["fail_closed"] == 0
    assert counters["pool_exhausted"] == 0
    # ... and every reservation settled, first time, none given up.
    assert counters["settled"] == counters["reserved"]
    assert counters["settle_noop"] == 0
    assert counters["settle_given_up"] == 0
    assert counters["settle_retried"] == 0
    assert states == Counter({"x": REQUESTS})

    # The buckets hold exactly what was used: one request each, and the tokens every response reported.
    used = sum(a.used for a in answers if a.used is not None)
    assert request_level == REQUEST_BURST - REQUESTS
    assert token_level == TOKEN_BURST - used
