"""Guard calls are salted per tenant, as generation is: no tenant shares an engine prefix cache with another,
through the guard either.

The attack kept here: tenant B sends the prompt it suspects tenant A sent and times the input guard; a guard
scoring request that hit A's cached prefix would answer faster. Every engine request made for a tenant, its
generation and its guard checks alike, carries that tenant's `cache_salt`, and the salt is keyed by the
server secret, so B cannot compute A's salt either (it was a hash of the public tenant id).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.base import EngineDelta, EngineRequest, SamplingSpec
from engines.simulated import SimulatedEngine, SimulatorConfig
from engines.vllm_local import VllmLocalEngine
from gateway.app import create_app
from gateway.config import GuardConfig, RegistryConfig
from gateway.generation.prompts import PromptRenderer
from gateway.secret import ServerSecret
from policy.tenants.models import Tenant
from registry.models import GuardModelSpec
from registry.service import Registry
from tests.backends import FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, add_key, make_config, serving
from tests.gateway.test_guard_http import QUOTAS, policy, publish_judge

SECRET = "guard-salt-test-secret-0123456789"
QUESTION = "What is the capital of France?"


class Recording(SimulatedEngine):
    """A simulator that records the salt of every generation request and every guard scoring call."""

    def __init__(self, name: str) -> None:
        super().__init__(SimulatorConfig(decode_step_s=0.002, decode_step_s_per_seq=0.0), model_name=name)
        self.generated: list[EngineRequest] = []
        self.scored: list[str | None] = []

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        self.generated.append(req)
        return super().generate(req)

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        self.scored.append(cache_salt)
        return await super().score_next_token(
            prompt_token_ids, token_ids, priority=priority, cache_salt=cache_salt
        )


class Bed:
    """Tenants `acme` and `beta`, both bound to policy alias `guarded`; the served engine and the guard pool
    `guard` record what they were asked."""

    def __init__(self, http: httpx.AsyncClient, app: Any, served: Recording, judge: Recording) -> None:
        self.http = http
        self.app = app
        self.served = served
        self.judge = judge
        self.keys: dict[str, str] = {}

    @property
    def registry(self) -> Registry:
        registry: Registry = self.app.state.services.registry
        return registry

    async def bind(self, guard: str) -> None:
        """Point `guarded` at the test policy whose model stage runs guard version `guard`."""
        spec = policy()
        stages = (spec.stages[0], msgspec.structs.replace(spec.stages[1], guard=guard))
        version = guard.replace("@", "-")
        await self.registry.publish(
            "policy", "guarded", version, msgspec.structs.replace(spec, stages=stages), actor="t"
        )
        await self.registry.set_alias("policy", "guarded", version, actor="t")

    async def chat(self, tenant_id: str, stream: bool = False) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 6,
            "stream": stream,
        }
        headers = {"authorization": f"Bearer {self.keys[tenant_id]}"}
        response = await self.http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        # Both directions went through the judge: its calls are what this file is about.
        assert response.headers["x-lockgate-guard"].startswith("input=model; output=")
        return response


@pytest.fixture
async def bed(tmp_path: Path, renderer: PromptRenderer, outcomes: OutcomeLog) -> AsyncIterator[Bed]:
    clock = FakeClock()
    served, judge = Recording(MODEL), Recording("judge@1")
    await served.start()
    await judge.start()
    config = msgspec.structs.replace(
        make_config(),
        guard=GuardConfig(default_policy="rules", min_label_mass=0.0),
        registry=RegistryConfig(secret=SECRET),
    )
    async with deployment("memory+sqlite", tmp_path) as backends:
        keys = {}
        for tenant_id in ("acme", "beta"):
            await backends.tenants.create_tenant(
                Tenant(tenant_id=tenant_id, display_name=tenant_id, quotas=QUOTAS, policy="guarded"),
                actor="test",
                now=clock(),
            )
            keys[tenant_id] = await add_key(backends.tenants, tenant_id, ("consumer",), now=clock())
        app = create_app(
            config,
            engine=served,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
            sink=outcomes,
            guard_pools={"guard": judge},
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            test_bed = Bed(http, app, served, judge)
            test_bed.keys = keys
            await publish_judge(test_bed.registry)
            yield test_bed
    await served.shutdown()
    await judge.shutdown()


def salts_of(secret: str) -> dict[str, str]:
    keyed = ServerSecret(secret)
    return {t: keyed.cache_salt(t) for t in ("acme", "beta")}


@pytest.mark.parametrize("stream", [False, True])
async def test_generation_and_guard_calls_carry_the_tenants_salt(bed: Bed, stream: bool) -> None:
    await bed.bind("judge@1")  # a guard on a pool of its own
    salts = salts_of(SECRET)
    assert salts["acme"] != salts["beta"]
    for tenant_id in ("acme", "beta"):
        bed.served.generated.clear()
        bed.judge.scored.clear()
        await bed.chat(tenant_id, stream=stream)
        [generation] = bed.served.generated
        assert generation.cache_salt == salts[tenant_id]
        # The input check and at least one output check, each salted like the generation it guards.
        assert len(bed.judge.scored) >= 2
        assert set(bed.judge.scored) == {salts[tenant_id]}


async def test_a_guard_on_the_generation_fleets_pool_is_salted_too(bed: Bed) -> None:
    # A zero-shot judge on the served model itself: its calls go through the fleet's replicas.
    served = bed.registry.view.resolve_model(MODEL, key="")
    judge = bed.registry.view.spec("guard_model", "judge", "1", GuardModelSpec)
    await bed.registry.publish(
        "guard_model", "inpool", "1", msgspec.structs.replace(judge, model=served.ref), actor="t"
    )
    await bed.bind("inpool@1")
    salts = salts_of(SECRET)
    for tenant_id in ("acme", "beta"):
        bed.served.scored.clear()
        await bed.chat(tenant_id)
        assert len(bed.served.scored) >= 2
        assert set(bed.served.scored) == {salts[tenant_id]}
    assert bed.judge.scored == []


def test_a_salt_cannot_be_computed_from_the_tenant_id() -> None:
    salts = salts_of(SECRET)
    # Not the public hash of the tenant id it used to be, and another secret gives other salts.
    public = hashlib.sha256(b"lockgate-cache-salt:acme").hexdigest()[:32]
    assert salts["acme"] != public
    assert salts_of("another-deployment-secret") != salts
    # Stable: every replica with the same secret salts a tenant the same (their prefix caches agree).
    assert salts_of(SECRET) == salts
    assert all(len(s) == 32 for s in salts.values())


async def test_a_real_engine_caches_a_guard_calls_prompt_under_its_salt_only(
    vllm_engine: VllmLocalEngine,
) -> None:
    """vLLM itself: the prefix a salted scoring call leaves in the cache is found by a request with the same
    salt (it reached the engine), and by none with another salt or none."""
    prompt = tuple(1000 + (i * 37) % 20000 for i in range(min(400, vllm_engine.max_model_len - 64)))
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    await vllm_engine.score_next_token(prompt, [5, 9], priority=-10, cache_salt=mine)

    async def cached(salt: str | None) -> int:
        req = EngineRequest(
            request_id=f"probe-{uuid.uuid4().hex}",
            prompt_token_ids=(*prompt, 7),
            sampling=SamplingSpec(max_tokens=1, temperature=0.0),
            cache_salt=salt,
        )
        usage = [d.usage async for d in vllm_engine.generate(req) if d.usage is not None]
        return usage[-1].cached_tokens

    # Another tenant's salt, or none, finds nothing of it (asked first: each probe caches under its own).
    assert await cached(other) == 0
    assert await cached(None) == 0
    assert await cached(mine) > 0


def test_remembered_digests_are_the_ones_computed_afresh() -> None:
    keyed = ServerSecret(SECRET)
    salt = keyed.cache_salt("acme")
    assert keyed.cache_salt("acme") == salt == ServerSecret(SECRET).cache_salt("acme")
    # The purposes stay apart in the memory as in the digest.
    assert keyed.policy_key("acme") not in (salt, keyed.model_key("acme", "k"))
    # Past the memory's bound it starts over, and answers the same.
    models = [keyed.model_key("acme", f"key-{i}") for i in range(10_000)]
    assert keyed.cache_salt("acme") == salt
    assert keyed.model_key("acme", "key-0") == models[0] == ServerSecret(SECRET).model_key("acme", "key-0")
    assert ServerSecret("another secret").cache_salt("acme") != salt
