"""No client picks its gate: while a policy alias splits between versions, which version checks a request is
keyed by the tenant under the server secret, never by anything the client sends per request.

(A policy's stages name guard model versions pinned, `name@version`, so those follow the policy version; a
model alias in canary is picked per API key: tests/registry/test_registry_http.py.)

The attack kept here: a consumer whose prompt the strict version blocks retries it under many `x-request-id`s
(and with another of its tenant's keys), hoping one lands on the lenient version. Before, the pick hashed a
public salt with the client's own request id, so the consumer could even precompute such ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import ConfigError, GuardConfig, RegistryConfig, load_config
from gateway.generation.prompts import PromptRenderer
from gateway.secret import ServerSecret
from policy.safety.defaults import rules_policy
from policy.tenants.models import Tenant
from registry.hashing import canary_pick
from registry.models import AliasTarget, PolicySpec, RulePattern, RulesSpec
from registry.service import Registry
from tests.backends import FakeClock, deployment
from tests.conftest import MODEL, OutcomeLog, add_key, make_config, serving
from tests.gateway.test_guard_http import BLOCKED_INPUT, Records

# Fixed, so the statistical checks below are the same on every run (a random secret would make them flaky).
SECRET = "canary-key-test-secret-0123456789"
TENANTS = tuple(f"t{i:02d}" for i in range(40))


def strict() -> PolicySpec:
    """Version 1 of `split`: the rules stage refuses BLOCKED_INPUT."""
    spec = rules_policy()
    rule = RulePattern(category=spec.categories[0].name, pattern="forbidden phrase", applies_to="input")
    return msgspec.structs.replace(spec, rules=RulesSpec(block=(rule,)))


def lenient() -> PolicySpec:
    """Version 2 of `split`: the rules stage with nothing to block (what an attacker would want)."""
    return msgspec.structs.replace(rules_policy(), rules=RulesSpec(block=()))


class Gateway:
    """A gateway whose tenants are all bound to policy alias `split`: a 50/50 canary of strict, lenient."""

    def __init__(
        self, http: httpx.AsyncClient, app: Any, records: Records, keys: dict[str, list[str]]
    ) -> None:
        self.http = http
        self.app = app
        self.records = records
        self.keys = keys

    @property
    def registry(self) -> Registry:
        registry: Registry = self.app.state.services.registry
        return registry

    async def chat(self, key: str, content: str, request_id: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return await self.http.post("/v1/chat/completions", json=body, headers=headers)

    def policy_of(self, response: httpx.Response) -> str:
        """The policy version that checked the request (its input decision record's name@version; the last
        one of its id: a client may send an id again)."""
        request_id = response.headers["x-request-id"]
        found = [r for r in self.records.items if r.request_id == request_id and r.direction == "input"]
        return found[-1].policy


@pytest.fixture
async def gateway(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> AsyncIterator[Gateway]:
    clock = FakeClock()
    records = Records()
    config = msgspec.structs.replace(
        make_config(),
        guard=GuardConfig(default_policy="rules"),
        registry=RegistryConfig(secret=SECRET),
    )
    async with deployment("memory+sqlite", tmp_path) as backends:
        keys: dict[str, list[str]] = {}
        for tenant_id in ("acme", *TENANTS):
            await backends.tenants.create_tenant(
                Tenant(tenant_id=tenant_id, display_name=tenant_id, policy="split"), actor="test", now=clock()
            )
            keys[tenant_id] = [await add_key(backends.tenants, tenant_id, ("consumer",), now=clock())]
        keys["acme"] += [
            await add_key(backends.tenants, "acme", ("consumer",), now=clock()) for _ in range(3)
        ]
        app = create_app(
            config,
            engine=sim_engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
            sink=outcomes,
            guard_sink=records,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            bed = Gateway(http, app, records, keys)
            await bed.registry.publish("policy", "split", "1", strict(), actor="test")
            await bed.registry.publish("policy", "split", "2", lenient(), actor="test")
            await bed.registry.set_alias(
                "policy",
                "split",
                [AliasTarget(version="1", weight=0.5), AliasTarget(version="2", weight=0.5)],
                actor="test",
            )
            yield bed


async def test_no_request_id_or_key_of_a_tenant_moves_its_blocked_prompt_to_the_other_version(
    gateway: Gateway,
) -> None:
    outcomes: set[tuple[int, str, str]] = set()
    for key in gateway.keys["acme"]:
        # Ids an attacker would try: many random-looking ones, and a retry of the same id.
        for request_id in [f"attempt-{i}" for i in range(20)] + ["retry", "retry"]:
            response = await gateway.chat(key, BLOCKED_INPUT, request_id)
            assert response.headers["x-request-id"] == request_id  # still echoed: logs and appeals use it
            outcomes.add(
                (response.status_code, response.headers["x-lockgate-guard"], gateway.policy_of(response))
            )
    # One outcome for all 88 tries: one version decided every one of them.
    [(status, guard, policy)] = outcomes
    assert policy in ("split@1", "split@2")
    if policy == "split@1":
        assert (status, guard) == (400, "input=rules")
    else:
        assert status == 200


async def test_the_split_across_tenants_follows_the_weights(gateway: Gateway) -> None:
    decided: dict[str, str] = {}
    for tenant_id in TENANTS:
        response = await gateway.chat(gateway.keys[tenant_id][0], BLOCKED_INPUT)
        decided[tenant_id] = gateway.policy_of(response)
        # What a tenant's version decides is what it enforces.
        assert response.status_code == (400 if decided[tenant_id] == "split@1" else 200), response.text
    strict_share = sum(v == "split@1" for v in decided.values()) / len(decided)
    # 40 tenants at 50/50: 3 standard deviations is +-0.24 (the secret is fixed: this run is every run).
    assert 0.26 <= strict_share <= 0.74, decided
    # Moving the canary's weight moves tenants onto it, and only onto it (the stable version listed first).
    await gateway.registry.set_alias(
        "policy",
        "split",
        [AliasTarget(version="1", weight=0.2), AliasTarget(version="2", weight=0.8)],
        actor="test",
    )
    later = {t: gateway.policy_of(await gateway.chat(gateway.keys[t][0], BLOCKED_INPUT)) for t in TENANTS}
    assert {t for t, v in later.items() if v == "split@2"} >= {
        t for t, v in decided.items() if v == "split@2"
    }


def test_picks_follow_the_weights_and_differ_by_secret() -> None:
    targets = [AliasTarget(version="stable", weight=0.9), AliasTarget(version="canary", weight=0.1)]
    tenants = [f"tenant-{i}" for i in range(4000)]
    ours, theirs = ServerSecret(SECRET), ServerSecret("another-deployment-secret")
    picks = {t: canary_pick(ours.policy_key(t), targets, salt="policy:split") for t in tenants}
    share = sum(v == "canary" for v in picks.values()) / len(picks)
    assert abs(share - 0.1) < 0.02, share
    # Without the secret the pick cannot be computed: another secret gives another split.
    other = {t: canary_pick(theirs.policy_key(t), targets, salt="policy:split") for t in tenants}
    assert other != picks
    # The keys are digests of who asks, apart per purpose: a model pick key is per API key, a policy's is not.
    assert ours.policy_key("acme") != ours.policy_key("acme2")
    assert ours.model_key("acme", "k1") != ours.model_key("acme", "k2")
    assert ours.policy_key("acme") not in (ours.model_key("acme", ""), ours.cache_salt("acme"))
    assert SECRET not in repr(ours)


def test_a_configured_secret_must_not_be_short() -> None:
    with pytest.raises(ConfigError, match=r"registry\.secret"):
        load_config(env={"LOCKGATE_REGISTRY__SECRET": "short"})
    assert load_config(env={"LOCKGATE_REGISTRY__SECRET": SECRET}).registry.secret == SECRET
    assert load_config(env={}).registry.secret == ""
