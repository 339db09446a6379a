"""Four gateway processes (`ops.deploy.local`, the manifests' config: Redis quota store, capacity leases
"auto") in front of two engine replicas with a KV budget of 1,000 tokens each (stand-ins,
`tests.fake_vllm_server`, that count what they run), driven past saturation through all four gateways at
once: what the gateways admit to each engine together never exceeds its budget, and every request is
served (the excess waits in the gateways' queues)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from ops.deploy.local import LocalFleet
from tests.backends import PG_DSN
from tests.conftest import DATA_DIR, MODEL
from tests.ops.test_local_fleet import TEST_ENV, clients, consumer_key

KV_TOKENS = 1000
MAX_TOKENS = 32


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalFleet]:
    def stand_in(index: int, port: int) -> list[str]:
        del index
        argv = ["-m", "tests.fake_vllm_server", f"--port={port}", f"--kv-tokens={KV_TOKENS}"]
        return [sys.executable, *argv, "--token-interval=0.02"]

    started = LocalFleet(
        tmp_path_factory.mktemp("capacity"),
        gateways=4,
        postgres_dsn=PG_DSN,
        data_dir=str(DATA_DIR),
        extra_env=TEST_ENV,
        engine_command=stand_in,
    )
    try:
        await started.start()
        yield started
    finally:
        await started.stop()


async def test_four_gateways_never_admit_more_than_an_engines_kv_budget(fleet: LocalFleet) -> None:
    sdks = clients(fleet, await consumer_key(fleet, "saturate"))
    assert len(sdks) == 4
    errors: list[BaseException] = []
    answered = 0

    async def client(worker: int) -> None:
        nonlocal answered
        for step in range(6):
            try:
                answer = await sdks[(worker + step) % 4].chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Client {worker} asks question {step}, please."}],
                    max_tokens=MAX_TOKENS,
                )
            except openai.APIError as exc:
                errors.append(exc)
                return
            assert answer.usage is not None
            assert answer.usage.completion_tokens == MAX_TOKENS
            answered += 1

    # 48 clients: each request holds about 60 tokens of prompt + 32 of output, so each engine's budget
    # admits about ten at once and the rest wait.
    await asyncio.gather(*(client(w) for w in range(48)))
    assert not errors, errors[:3]
    assert answered == 48 * 6
    async with httpx.AsyncClient(timeout=10) as http:
        stats = [(await http.get(f"{url}/stats")).json() for url in fleet.engine_urls]
    for engine in stats:
        assert engine["most_held"] <= KV_TOKENS, stats
        # Saturated: the gateways filled most of it (they leave room a whole request does not fit in).
        assert engine["most_held"] >= KV_TOKENS * 0.7, stats
    assert sum(engine["served"] for engine in stats) == answered
