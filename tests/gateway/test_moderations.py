"""`POST /v1/moderations` over HTTP with the official `openai` SDK: answered by the tenant's own policy
cascade (the real gate, rules stage and one-token guard on a simulated guard engine), metered, audited, and
never generating. LangChain's OpenAI moderation middleware runs against it too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langchain_openai.middleware import OpenAIModerationMiddleware
from openai.types import ModerationMultiModalInputParam
from pydantic import SecretStr

from gateway.api.moderations import OPENAI_CATEGORIES, moderation_result
from gateway.generation.prompts import PromptRenderer
from policy.safety.decision import GuardDecision
from policy.safety.records import audit_draft
from registry.models import CascadeStage, PolicyCategory, PolicySpec, RulePattern, RulesSpec
from tests.conftest import MODEL, CountingEngine, OutcomeLog
from tests.gateway.test_guard_http import (
    BLOCKED_INPUT,
    CRAFTED_INPUT,
    TOKEN_BURST,
    Bed,
    guarded,
    policy,
)

BENIGN = "What is the capital of France?"


@pytest.fixture
async def bed(tmp_path: Path, renderer: PromptRenderer, outcomes: OutcomeLog) -> AsyncIterator[Bed]:
    async with guarded(tmp_path, renderer, outcomes, CountingEngine()) as test_bed:
        await test_bed.bind(policy())
        yield test_bed


@pytest.fixture
async def client(bed: Bed) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{bed.http.base_url}/v1", api_key=bed.key, max_retries=0) as sdk:
        yield sdk


async def moderate(bed: Bed, body: Any, key: str | None = None) -> Any:
    return await bed.http.post(
        "/v1/moderations", json=body, headers={"authorization": f"Bearer {key or bed.key}"}
    )


async def test_a_blocked_phrase_is_flagged_for_its_category(bed: Bed, client: openai.AsyncOpenAI) -> None:
    raw = await client.moderations.with_raw_response.create(input=BLOCKED_INPUT)
    answer = raw.parse()
    assert answer.id.startswith("modr-")
    assert answer.model == "lockgate-policy:guarded@1"
    [result] = answer.results
    assert result.flagged
    assert result.categories.violence is True
    assert result.category_scores.violence == 1.0
    # Every other OpenAI category: present, false, 0.0; the policy's own `spam` under its name.
    assert result.categories.hate is False
    assert result.categories.self_harm is False
    assert result.category_scores.sexual_minors == 0.0
    assert result.category_applied_input_types.violence == ["text"]
    body = raw.http_response.json()["results"][0]
    assert set(body["categories"]) == {*OPENAI_CATEGORIES, "spam"}
    assert body["categories"]["spam"] is False
    assert body["category_applied_input_types"]["self-harm"] == ["text"]
    assert body["lockgate"] == {"action": "block", "source": "rules", "category": "violence", "review": False}
    assert raw.headers["x-lockgate-guard"] == "input=rules"
    # Checked, never generated from.
    assert bed.engine.requests == []


async def test_a_benign_text_is_not_flagged(bed: Bed, client: openai.AsyncOpenAI) -> None:
    [result] = (await client.moderations.create(input=BENIGN, model="omni-moderation-latest")).results
    assert not result.flagged
    assert not any(result.categories.model_dump().values())
    assert (result.model_extra or {})["lockgate"]["source"] == "model"  # the judge allowed it
    assert bed.engine.requests == []


async def test_a_list_gets_one_result_per_item_in_order(client: openai.AsyncOpenAI) -> None:
    strings = await client.moderations.create(input=[BENIGN, BLOCKED_INPUT, "hello there"])
    assert [r.flagged for r in strings.results] == [False, True, False]
    texts: list[ModerationMultiModalInputParam] = [
        {"type": "text", "text": BLOCKED_INPUT},
        {"type": "text", "text": BENIGN},
    ]
    parts = await client.moderations.create(input=texts)
    assert [r.flagged for r in parts.results] == [True, False]


async def test_quota_is_charged_the_tokens_checked(bed: Bed, renderer: PromptRenderer) -> None:
    texts = [BENIGN, BLOCKED_INPUT]
    response = await moderate(bed, {"input": texts})
    assert response.status_code == 200, response.text
    assert "ratelimit" in response.headers
    tokens = sum([len(await renderer.text(t)) for t in texts])
    assert tokens > 0
    assert await bed.tokens_level() == pytest.approx(TOKEN_BURST - tokens)


async def test_each_check_is_recorded_as_a_moderation(bed: Bed, client: openai.AsyncOpenAI) -> None:
    answer = await client.moderations.create(input=[BENIGN, BLOCKED_INPUT])
    first, second = bed.records.items
    assert (first.action, second.action) == ("allow", "block")
    assert {r.direction for r in bed.records.items} == {"input"}
    assert {r.purpose for r in bed.records.items} == {"moderation"}
    assert {f"modr-{r.request_id}" for r in bed.records.items} == {answer.id}
    assert second.policy == "guarded@1"
    assert second.category == "violence"
    # The audit trail tells it from a chat request's input check.
    assert audit_draft(second).detail == "purpose=moderation"
    await bed.chat(BENIGN)
    assert audit_draft(bed.records.items[-2]).detail == ""  # the chat's input record


async def test_an_escalation_is_flagged_only_when_a_model_scored_it_in_its_band(bed: Bed) -> None:
    # The judge unsure about everything (band 0-1): past the last stage, escalated for review.
    unsure = policy()
    judge = CascadeStage(
        guard="judge@1", allow_below=0.0, block_above=1.0, categories=("spam",), timeout_s=2.0
    )
    await bed.bind(PolicySpec(**{**_fields(unsure), "stages": (unsure.stages[0], judge)}))
    [result] = (await moderate(bed, {"input": BENIGN})).json()["results"]
    assert result["flagged"] is True
    assert (result["lockgate"]["source"], result["lockgate"]["review"]) == ("band", True)
    # Flagged as OpenAI's results are: with the category that its model score was for.
    assert [name for name, on in result["categories"].items() if on] == ["spam"]
    # The rules stage alone: its 0.5 says no rule matched, which is no reason to flag.
    await bed.bind(PolicySpec(**{**_fields(unsure), "stages": (unsure.stages[0],)}))
    [result] = (await moderate(bed, {"input": BENIGN})).json()["results"]
    assert result["flagged"] is False
    assert (result["lockgate"]["source"], result["lockgate"]["review"]) == ("band", True)


async def test_a_policy_that_cannot_check_and_fails_closed_refuses_and_refunds(bed: Bed) -> None:
    await bed.bind(policy(fail_mode="closed"))
    bed.judge.kill("guard pool down")
    response = await moderate(bed, {"input": BENIGN})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "guard_unavailable"
    assert await bed.tokens_level() == pytest.approx(TOKEN_BURST)


async def test_an_input_the_guard_cannot_read_is_the_clients_400_naming_input(bed: Bed) -> None:
    # The guard model talked out of answering by the text itself: retrying cannot help, and the field at
    # fault is the moderation's `input` (not chat's `messages`).
    await bed.bind(policy(fail_mode="closed"))
    response = await moderate(bed, {"input": CRAFTED_INPUT})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("content_unverifiable", "input")
    assert await bed.tokens_level() == pytest.approx(TOKEN_BURST)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", 4]}, "input[1]"),
        ({"input": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}, "input[0]"),
        ({"input": [{"type": "text"}]}, "input[0].text"),
        ({"input": [{"type": "audio", "text": "x"}]}, "input[0].type"),
        ({"input": ["x"] * 33}, "input"),
        ({}, "input"),
        ({"input": "x", "temperature": 1}, "temperature"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(bed: Bed, body: Any, param: str) -> None:
    response = await moderate(bed, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert bed.records.items == []
    assert await bed.tokens_level() == pytest.approx(TOKEN_BURST)


async def test_an_image_through_the_sdk_is_refused_by_name(client: openai.AsyncOpenAI) -> None:
    mixed: list[ModerationMultiModalInputParam] = [
        {"type": "text", "text": BENIGN},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.moderations.create(input=mixed)
    assert refused.value.param == "input[1]"
    assert refused.value.code == "unsupported_content"


async def test_a_body_over_the_limit_is_413(bed: Bed) -> None:
    limit = bed.app.state.services.config.server.max_body_bytes
    response = await moderate(bed, {"input": "a" * (limit + 1)})
    assert response.status_code == 413, response.text


async def test_no_key_is_401(bed: Bed) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{bed.http.base_url}/v1", api_key="lg-nope-nope", max_retries=0
    ) as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.moderations.create(input=BLOCKED_INPUT)
    assert (await bed.http.post("/v1/moderations", json={"input": "x"})).status_code == 401
    assert bed.records.items == []


async def test_each_tenant_is_answered_by_its_own_policy(bed: Bed) -> None:
    other = PolicySpec(
        **{
            **_fields(policy()),
            "categories": (PolicyCategory(name="hate", severity="medium"),),
            "stages": (CascadeStage(kind="rules", allow_below=0.25, block_above=0.75),),
            "fail_modes": {"hate": "closed"},
            "rules": RulesSpec(block=(RulePattern(category="hate", pattern="other phrase"),)),
        }
    )
    globex = await bed.other_tenant(other)
    texts = {"input": [BLOCKED_INPUT, "say the other phrase"]}
    mine = (await moderate(bed, texts)).json()
    theirs = (await moderate(bed, texts, key=globex)).json()
    assert (mine["model"], theirs["model"]) == ("lockgate-policy:guarded@1", "lockgate-policy:other@1")
    assert [r["flagged"] for r in mine["results"]] == [True, False]
    assert [r["flagged"] for r in theirs["results"]] == [False, True]
    assert theirs["results"][1]["categories"]["hate"] is True
    assert "spam" not in theirs["results"][0]["categories"]  # acme's own category is not globex's
    assert {r.tenant for r in bed.records.items if r.policy == "other@1"} == {"globex"}


def test_policy_categories_map_to_openai_names() -> None:
    decision = GuardDecision(direction="input", action="block", source="rules", category="self_harm")
    result = moderation_result(decision, ("self_harm", "weapons", "malware", "prompt_injection"))
    assert result.categories["self-harm"] is True
    assert "self_harm" not in result.categories
    assert "weapons" not in result.categories
    assert result.categories["prompt_injection"] is False  # no OpenAI name: its own
    assert list(result.categories) == [*OPENAI_CATEGORIES, "prompt_injection"]


async def test_langchain_moderation_middleware_ends_a_flagged_conversation(
    bed: Bed, client: openai.AsyncOpenAI
) -> None:
    model = ChatOpenAI(
        model=MODEL,
        base_url=f"{bed.http.base_url}/v1",
        api_key=SecretStr(bed.key),
        max_completion_tokens=8,
        max_retries=0,
    )
    agent = create_agent(
        model, middleware=[OpenAIModerationMiddleware(async_client=client, exit_behavior="end")]
    )
    ended = await agent.ainvoke({"messages": [HumanMessage(BLOCKED_INPUT)]})
    last = ended["messages"][-1]
    assert isinstance(last, AIMessage)
    assert "flagged for violence" in str(last.content)
    assert bed.engine.requests == []  # the model was never called
    served = await agent.ainvoke({"messages": [HumanMessage(BENIGN)]})
    assert isinstance(served["messages"][-1], AIMessage)
    assert len(bed.engine.requests) == 1
    purposes = [r.purpose for r in bed.records.items]
    # The blocked input; the benign input, the chat's own input and output checks, the answer moderated.
    assert purposes.count("moderation") == 3
    assert purposes.count("request") == 2


def _fields(spec: PolicySpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__struct_fields__}
