"""A guard model on the served pool: its calls are spread over the fleet's replicas, not sent to the first."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import httpx
import msgspec

from gateway.app import ZERO_SHOT_JUDGE, create_app
from gateway.generation.prompts import PromptRenderer
from policy.tenants.models import Tenant
from registry.models import CascadeStage, PolicyCategory, PolicySpec
from tests.conftest import MODEL, OutcomeLog, Tenancy, add_key, serving
from tests.gateway.test_metrics import config


def judged(judge: str) -> PolicySpec:
    """Rules (unsure about anything harmless), then the zero-shot judge, which allows anything below 1."""
    return PolicySpec(
        categories=(PolicyCategory(name="violence", severity="high"),),
        stages=(
            CascadeStage(kind="rules", allow_below=0.25, block_above=0.75),
            CascadeStage(guard=judge, allow_below=1.0, block_above=1.0, timeout_s=10.0),
        ),
        past_last_stage="escalate",
        fail_modes={"violence": "open"},
        hold_back_tokens=4,
        retention="hash",
        guard_output=False,
    )


CONCURRENT = 4


async def test_guard_calls_on_the_served_pool_reach_every_replica(
    renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> None:
    cfg = config()
    # The simulated engines score the tokenizer's ids; their label masses are arbitrary: any is an answer.
    simulator = msgspec.structs.replace(cfg.engine.simulator, vocab_size=renderer.vocab_size)
    cfg = msgspec.structs.replace(
        cfg,
        engine=msgspec.structs.replace(cfg.engine, simulator=simulator),
        guard=msgspec.structs.replace(cfg.guard, min_label_mass=0.0),
    )
    app = create_app(cfg, renderer=renderer, tenants=tenancy.store, sink=outcomes)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        services = app.state.services
        calls: Counter[str] = Counter()
        # The first CONCURRENT calls are held until all of them arrived: they are in flight together.
        together = asyncio.Event()
        replicas = services.scheduler.replicas
        assert len(replicas) == 2
        for replica in replicas:
            score = replica.engine.score_next_token

            async def counted(
                prompt: Sequence[int],
                ids: Sequence[int],
                *,
                priority: int = 0,
                cache_salt: str | None = None,
                _id: str = replica.replica_id,
                _score: Callable[..., Awaitable[dict[int, float]]] = score,
            ) -> dict[int, float]:
                calls[_id] += 1
                if calls.total() >= CONCURRENT:
                    together.set()
                await together.wait()
                return await _score(prompt, ids, priority=priority, cache_salt=cache_salt)

            replica.engine.score_next_token = counted
        served = services.registry.view.resolve_model(MODEL, key="")
        await services.registry.publish(
            "policy", "judged", "1", judged(f"{ZERO_SHOT_JUDGE}@{served.model.version}"), actor="test"
        )
        await services.registry.set_alias("policy", "judged", "1", actor="test")
        await tenancy.store.create_tenant(
            Tenant(tenant_id="judged", display_name="Judged", policy="judged"), actor="test", now=0.0
        )
        key = await add_key(tenancy.store, "judged", ("consumer",))

        async def ask(i: int) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 4}
            response = await http.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-lockgate-guard"] == "input=model"  # the judge answered

        await asyncio.gather(*(ask(i) for i in range(CONCURRENT)))
        # In flight together they spread (the judge's template, cached on the first replica asked, keeps
        # two there: the router's prefix affinity against one more call of load).
        assert sorted(calls.values()) == [2, 2]
        # One after another, with nothing in flight, they stay on one replica (both hold the template now).
        before = dict(calls)
        for i in range(3):
            await ask(CONCURRENT + i)
        moved = {r: calls[r] - before.get(r, 0) for r in calls}
        assert sorted(moved.values()) == [0, 3]
