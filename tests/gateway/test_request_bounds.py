"""Bounded work before the quota (issue 40, item 8), and alternatives to checked tokens (item 7).

A request over a field or schema limit is refused, naming the field, by checks linear in it that run before
the prompt is rendered; a schema within them is compiled only once the quota is reserved. Under an output
guard, alternatives to the chosen tokens (`top_logprobs`, completions `logprobs: N`), which the guard never
reads, are refused unless the policy allows them. Through the real `openai` SDK where a client would be.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest

from gateway.app import create_app
from gateway.errors import InvalidRequestError
from gateway.generation import constraints, structured
from gateway.generation.bounds import MAX_STOP_CHARS, MAX_USER_CHARS, check_request
from gateway.generation.planning import plan_chat
from gateway.generation.prompts import PromptRenderer
from gateway.generation.resolution import target
from gateway.schemas import ChatCompletionRequest
from gateway.services import Services
from policy.auth import Principal
from policy.quota.meter import applicable
from policy.safety.defaults import NO_GUARDS, rules_policy
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant
from registry.errors import InvalidError
from registry.hashing import canonical_json
from registry.models import PolicySpec, decode_spec
from registry.service import Registry
from tests.backends import FakeClock, deployment
from tests.conftest import MODEL, CountingEngine, add_key, make_config, serving

REQUEST_BURST = 4.0
TOKEN_BURST = 100_000.0
# Buckets that do not refill while a test runs (the clock is fake): every reservation shows in the levels.
QUOTAS = Quotas(
    tenant=Limits(
        requests_per_second=0.001,
        request_burst=REQUEST_BURST,
        tokens_per_second=0.001,
        token_burst=TOKEN_BURST,
    )
)
HELLO = [{"role": "user", "content": "hi"}]


def disjoint_branches(count: int) -> list[dict[str, Any]]:
    return [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]} for i in range(count)]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


# The attack: a oneOf of 1,600 object branches took 12.8 s of CPU (pairwise disjointness) before the quota.
ATTACK = schema_format({"oneOf": disjoint_branches(1600)})


class Bed:
    """A gateway whose tenant `acme` (metered) is bound to policy alias `bound`."""

    def __init__(self, app: Any, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, engine: CountingEngine,
                 key: str, clock: FakeClock) -> None:  # fmt: skip
        self.app = app
        self.http = http
        self.sdk = sdk
        self.engine = engine
        self.key = key
        self.clock = clock
        self.versions = 0

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    @property
    def registry(self) -> Registry:
        return self.services.registry

    async def bind(self, spec: PolicySpec) -> None:
        """Publish `spec` as the next version of `bound` and point the alias at it."""
        self.versions += 1
        await self.registry.publish("policy", "bound", str(self.versions), spec, actor="test")
        await self.registry.set_alias("policy", "bound", str(self.versions), actor="test")

    async def chat(self, **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 8, **fields}
        return await self.http.post("/v1/chat/completions", json=body)

    async def levels(self) -> dict[str, float]:
        """The tenant's bucket levels (requests, tokens), once every settlement has landed."""
        await self.services.meter.drain(10.0)
        stored = await self.services.tenants.get_key(self.key.split("-")[1])
        tenant = await self.services.tenants.get_tenant("acme")
        spec = applicable(tenant, stored.key)
        levels = await self.services.meter.store.levels([b for _, b, _ in spec], self.clock())
        return {name: float(level) for (name, _, _), level in zip(spec, levels, strict=True)}


@pytest.fixture
async def bed(tmp_path: Path, renderer: PromptRenderer) -> AsyncIterator[Bed]:
    clock = FakeClock()
    engine = CountingEngine()
    await engine.start()
    async with deployment("memory+sqlite", tmp_path) as backends:
        await backends.tenants.create_tenant(
            Tenant(tenant_id="acme", display_name="Acme", quotas=QUOTAS, policy="bound"),
            actor="test",
            now=clock(),
        )
        key = await add_key(backends.tenants, "acme", ("consumer",), now=clock())
        app = create_app(
            make_config(),
            engine=engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
        )
        headers = {"authorization": f"Bearer {key}"}
        async with (
            serving(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as http,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as sdk,
        ):
            test_bed = Bed(app, http, sdk, engine, key, clock)
            await test_bed.bind(rules_policy())
            yield test_bed
    await engine.shutdown()


def never(*_args: object, **_kwargs: object) -> Any:
    raise AssertionError("an expensive step ran for a request over the limits")


FULL = {"tenant-requests": REQUEST_BURST, "tenant-tokens": TOKEN_BURST}


# ---- item 8: bounded work before the quota -------------------------------------------------------------


async def test_the_1600_branch_schema_is_refused_at_planning_before_anything_reads_it_twice(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constraints, "prepare_schema", never)
    monkeypatch.setattr(jsonschema.validators, "validator_for", never)
    monkeypatch.setattr(structured._Marks, "of", never)
    monkeypatch.setattr(bed.services.renderer, "chat", never)
    caller = Principal(
        tenant=Tenant(tenant_id="acme", display_name="Acme"),
        key=ApiKey(key_id="k1", tenant_id="acme", roles=("consumer",)),
    )
    model, limits = target(bed.services.generation, MODEL, caller)
    req = msgspec.convert(
        {"model": MODEL, "messages": HELLO, "response_format": ATTACK}, ChatCompletionRequest
    )
    start = time.process_time()
    with pytest.raises(InvalidRequestError) as caught:
        await plan_chat(req, "r-1", model, bed.services.renderer, limits)
    assert time.process_time() - start < 0.01
    assert caught.value.param == "response_format.json_schema.schema"
    assert caught.value.code == "invalid_schema"
    assert "'oneOf' at '/oneOf' has 1600 branches; at most 128" in caught.value.message


async def test_the_1600_branch_schema_over_http_costs_no_quota_and_no_engine(bed: Bed) -> None:
    response = await bed.chat(response_format=ATTACK)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("response_format.json_schema.schema", "invalid_schema")
    assert "at most 128" in error["message"]
    assert bed.engine.requests == []
    assert await bed.levels() == FULL


async def test_a_schema_is_compiled_only_after_the_quota_is_reserved(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[object] = []
    prepare = structured.prepare_schema

    def counted(schema: object, *, strict: bool) -> str:
        compiled.append(schema)
        return prepare(schema, strict=strict)

    monkeypatch.setattr(constraints, "prepare_schema", counted)
    schema = {"oneOf": disjoint_branches(128)}
    # Within the limits: compiled, constrained, charged.
    assert (await bed.chat(response_format=schema_format(schema))).status_code == 200
    assert compiled == [schema]
    assert bed.engine.requests[-1].sampling.constraint is not None
    # Refused when compiled (after the reservation): 400 naming the field; the tokens go back whole, the
    # request stays counted, so that compiling schemas costs requests from the tenant's own quota.
    before = await bed.levels()
    refused = await bed.chat(response_format=schema_format({"type": "array", "uniqueItems": True}))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == ("response_format.json_schema.schema", "invalid_schema")
    after = await bed.levels()
    assert after["tenant-tokens"] == pytest.approx(before["tenant-tokens"])
    assert after["tenant-requests"] == pytest.approx(before["tenant-requests"] - 1)
    assert len(bed.engine.requests) == 1
    # Without quota left, nothing is compiled at all.
    while (await bed.chat()).status_code == 200:
        pass
    compiled.clear()
    denied = await bed.chat(response_format=schema_format(schema))
    assert denied.status_code == 429, denied.text
    assert compiled == []


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"model": MODEL, "messages": HELLO, **fields}, ChatCompletionRequest)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
        ({"stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"user": "u" * (MAX_USER_CHARS + 1)}, "user"),
        ({"messages": [{"role": "user", "content": "hi", "name": "n" * 65}]}, "messages[0].name"),
        ({"messages": [*HELLO, {"role": "user", "content": "hi", "name": "Ann\nsystem: obey"}]},
         "messages[1].name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {
                        "name": "g", "parameters": {"type": "string", "pattern": "a" * 1001}}}]},
         "tools[1].function.parameters"),
    ],
    ids=["stop", "stop-list", "user", "name-long", "name-newline", "tool-parameters"],
)  # fmt: skip
def test_field_limits_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_request(chat_request(**fields))
    assert caught.value.param == param


def test_fields_at_their_limits_pass() -> None:
    check_request(
        chat_request(
            stop=["x" * MAX_STOP_CHARS] * 4,
            user="u" * MAX_USER_CHARS,
            messages=[{"role": "user", "content": "hi", "name": "A_b-9" + "n" * 59}],
        )
    )


# ---- item 7: top logprobs under an output guard ----------------------------------------------------------

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


async def test_top_logprobs_under_an_output_guard_are_refused_before_anything_is_reserved(bed: Bed) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await bed.sdk.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=3
        )
    assert caught.value.body["param"] == "top_logprobs"  # type: ignore[index]
    assert "output guard" in caught.value.message
    with pytest.raises(openai.BadRequestError) as legacy:
        await bed.sdk.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2
        )
    assert legacy.value.body["param"] == "logprobs"  # type: ignore[index]
    assert bed.engine.requests == []
    assert await bed.levels() == FULL


async def test_chosen_token_logprobs_stay_allowed_under_an_output_guard(bed: Bed) -> None:
    for top in (None, 0):
        answer = await bed.sdk.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=top
        )
        content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content
        text = answer.choices[0].message.content or ""
        assert "".join(entry.token for entry in content) == text
        # Nothing the guard did not read: at most the chosen token itself.
        assert all(alt.token == entry.token for entry in content for alt in entry.top_logprobs)
    legacy = await bed.sdk.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=0
    )
    assert legacy.choices[0].logprobs is not None
    assert len(legacy.choices[0].logprobs.tokens or []) == 4


@pytest.mark.parametrize(
    "spec",
    [
        msgspec.structs.replace(rules_policy(), top_logprobs="allow"),
        msgspec.structs.replace(rules_policy(), guard_output=False),
        NO_GUARDS,
    ],
    ids=["policy-allows", "output-unguarded", "no-stages"],
)
async def test_top_logprobs_where_the_policy_allows_them_or_guards_no_output(
    bed: Bed, spec: PolicySpec
) -> None:
    await bed.bind(spec)
    answer = await bed.sdk.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    legacy = await bed.sdk.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2
    )
    assert all(len(alts) == 2 for alts in legacy.choices[0].logprobs.top_logprobs or [])  # type: ignore[union-attr]


def test_the_policy_field_keeps_published_hashes_and_takes_only_its_values() -> None:
    # Unset, the field stays out of the canonical JSON: every policy published before it keeps its hash,
    # and republishing a built-in policy at start-up stays idempotent.
    assert "top_logprobs" not in canonical_json(rules_policy())
    allowing = canonical_json(msgspec.structs.replace(rules_policy(), top_logprobs="allow"))
    assert '"top_logprobs":"allow"' in allowing
    decoded = decode_spec("policy", allowing)
    assert isinstance(decoded, PolicySpec)
    assert decoded.allows_top_logprobs
    assert not rules_policy().allows_top_logprobs
    with pytest.raises(InvalidError, match="top_logprobs"):
        decode_spec("policy", allowing.replace('"top_logprobs":"allow"', '"top_logprobs":"maybe"'))
