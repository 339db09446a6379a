"""Every refusal is an OpenAI-shaped error naming the offending field, and none of them reaches the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import ANY

import httpx
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.generation.prompts import PromptRenderer
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
LONG_TEXT = "word " * 3000  # well over the 2048-token context
MAX_BODY = 4096  # max_body_bytes of the app in the 413 test


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# Within the depth limit alone, past it inside the schema that tool_choice "required" builds around it.
NEARLY_TOO_DEEP = _nested(14)


@dataclass(frozen=True)
class Case:
    """One bad request and the error it must get."""

    body: Any  # a JSON value, or raw bytes sent as is
    status: int
    param: str | None
    code: Any = field(default_factory=lambda: ANY)  # ANY: not checked (cases where the gateway sets none)
    type: str = "invalid_request_error"
    path: str = CHAT
    method: str = "POST"


def chat(**fields: Any) -> dict[str, Any]:
    """A valid chat request with `fields` added or replaced."""
    return {"model": MODEL, "messages": HELLO, **fields}


def chat_without(name: str) -> dict[str, Any]:
    body = chat()
    del body[name]
    return body


def completion(**fields: Any) -> dict[str, Any]:
    """A valid legacy completion request with `fields` added or replaced."""
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def bad(param: str | None, code: Any = ANY) -> tuple[int, str | None, Any]:
    return 400, param, code


CASES = [
    # Unknown or unsupported fields are refused by name, never ignored.
    pytest.param(Case(chat(foo=1), *bad("foo", "unsupported_parameter")), id="unknown-field"),
    pytest.param(
        Case(chat(functions=[{"name": "f"}]), *bad("functions", "unsupported_parameter")), id="functions"
    ),
    pytest.param(
        Case(chat(presence_penalty=2.5), *bad("presence_penalty", "invalid_value")), id="presence_penalty"
    ),
    pytest.param(
        Case(chat(frequency_penalty=-3), *bad("frequency_penalty", "invalid_value")), id="frequency_penalty"
    ),
    pytest.param(
        Case(chat(logit_bias={"99999999": 5}), *bad("logit_bias.99999999", "invalid_value")),
        id="logit_bias-not-a-token",
    ),
    pytest.param(
        Case(chat(logit_bias={"12": 101}), *bad("logit_bias.12", "invalid_value")), id="logit_bias-range"
    ),
    pytest.param(Case(chat(top_k=-2), *bad("top_k", "invalid_value")), id="top_k"),
    pytest.param(
        Case(chat(min_tokens=20, max_tokens=10), *bad("min_tokens", "invalid_value")), id="min_tokens"
    ),
    pytest.param(Case(chat(service_tier="gold"), *bad("service_tier")), id="service_tier-value"),
    pytest.param(
        Case(chat(metadata={f"k{i}": "v" for i in range(17)}), *bad("metadata", "invalid_value")),
        id="metadata-too-many",
    ),
    pytest.param(
        Case(chat(modalities=["text", "audio"]), *bad("modalities", "unsupported_value")), id="modalities"
    ),
    # Tools and structured outputs.
    pytest.param(Case(chat(tool_choice="required"), *bad("tool_choice")), id="tool_choice-without-tools"),
    pytest.param(
        Case(chat(parallel_tool_calls=False), *bad("parallel_tool_calls")), id="parallel-without-tools"
    ),
    pytest.param(
        Case(
            chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            *bad("tool_choice"),
        ),
        id="tool_choice-unknown-function",
    ),
    pytest.param(
        Case(
            chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
            *bad("tools[0].function.name"),
        ),
        id="tool-bad-name",
    ),
    pytest.param(
        Case(
            chat(
                tools=[{"type": "function", "function": {"name": "f"}}] * 2,
            ),
            *bad("tools[1].function.name"),
        ),
        id="tool-defined-twice",
    ),
    pytest.param(
        Case(
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            *bad("response_format.json_schema.schema"),
        ),
        id="json_schema-without-schema",
    ),
    pytest.param(
        Case(
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                    },
                }
            ),
            *bad("response_format.json_schema.schema", "invalid_schema"),
        ),
        id="json_schema-unsupported-feature",
    ),
    # Size limits, checked before anything costlier than decoding (gateway/generation/bounds.py).
    pytest.param(
        Case(
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"oneOf": [{"const": i} for i in range(1600)]}},
                }
            ),
            *bad("response_format.json_schema.schema", "invalid_schema"),
        ),
        id="json_schema-too-many-branches",
    ),
    pytest.param(
        Case(
            chat(
                tools=[
                    {"type": "function", "function": {"name": "f"}},
                    {
                        "type": "function",
                        "function": {"name": "g", "parameters": {"enum": list(range(6000))}},
                    },
                ]
            ),
            *bad("tools[1].function.parameters", "invalid_schema"),
        ),
        id="tool-parameters-too-large",
    ),
    pytest.param(
        Case(
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": NEARLY_TOO_DEEP}}],
                tool_choice="required",
            ),
            *bad("tools", "invalid_schema"),
        ),
        id="required-tools-schema-too-deep",
    ),
    pytest.param(
        Case(
            chat(
                tools=[
                    {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"P": {}}}}},
                    {
                        "type": "function",
                        "function": {"name": "b", "parameters": {"$defs": {"P": {"type": "x"}}}},
                    },
                ],
                tool_choice="required",
            ),
            *bad("tools", "invalid_schema"),
        ),
        id="required-tools-conflicting-defs",
    ),
    pytest.param(Case(chat(stop="x" * 257), *bad("stop", "invalid_value")), id="stop-too-long"),
    pytest.param(Case(chat(user="u" * 257), *bad("user", "invalid_value")), id="user-too-long"),
    pytest.param(
        Case(
            chat(messages=[{"role": "user", "content": "hi", "name": "a b"}]),
            *bad("messages[0].name", "invalid_value"),
        ),
        id="message-name-pattern",
    ),
    pytest.param(
        Case(
            chat(
                response_format={"type": "json_object"},
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="required",
            ),
            *bad("response_format", "unsupported_value"),
        ),
        id="json-with-required-tool",
    ),
    pytest.param(
        Case(
            chat(
                messages=[
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ]
            ),
            *bad("messages[1].tool_calls[0].function.arguments"),
        ),
        id="history-tool-arguments-not-json",
    ),
    pytest.param(
        Case(chat(messages=[{"role": "tool", "content": "42"}]), *bad("messages[0].tool_call_id")),
        id="tool-message-without-id",
    ),
    pytest.param(
        Case(chat(messages=[{"role": "user", "content": None}]), *bad("messages[0].content")),
        id="user-content-null",
    ),
    pytest.param(
        Case(
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
                        ],
                    }
                ]
            ),
            *bad("messages[0].content[0].type", "unsupported_content"),
        ),
        id="image-part",
    ),
    pytest.param(
        Case(
            chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
            *bad("messages[0].content[0].type", "unsupported_content"),
        ),
        id="audio-part",
    ),
    pytest.param(
        Case(
            chat(messages=[{"role": "user", "content": [{"type": "file", "file": {"file_id": "f-1"}}]}]),
            *bad("messages[0].content[0].type", "unsupported_content"),
        ),
        id="file-part",
    ),
    pytest.param(
        Case(chat(messages=[{"role": "user", "content": "hi", "foo": 1}]), *bad("messages[0].foo")),
        id="nested-unknown-field",
    ),
    # Wrong types.
    pytest.param(Case(chat(max_tokens="ten"), *bad("max_tokens", "invalid_value")), id="max_tokens-type"),
    pytest.param(Case(chat(temperature="hot"), *bad("temperature")), id="temperature-type"),
    pytest.param(Case(chat(messages="hi"), *bad("messages")), id="messages-type"),
    pytest.param(
        Case(chat(messages=[{"role": "user", "content": 5}]), *bad("messages[0].content")), id="content-type"
    ),
    pytest.param(Case(chat(stream="yes"), *bad("stream")), id="stream-type"),
    # Missing required fields.
    pytest.param(Case(chat_without("messages"), *bad("messages")), id="missing-messages"),
    pytest.param(Case(chat_without("model"), *bad("model")), id="missing-model"),
    # The pattern the OpenAPI document states for `model` is the one enforced: outside it, 400 naming it.
    pytest.param(Case(chat(model="no such"), *bad("model", "invalid_value")), id="model-outside-pattern"),
    pytest.param(Case(chat(model="a@b@c"), *bad("model", "invalid_value")), id="model-ref-outside-pattern"),
    pytest.param(
        Case(chat(messages=[{"role": "robot", "content": "hi"}]), *bad("messages[0].role")), id="bad-role"
    ),
    pytest.param(Case(chat(messages=[]), *bad("messages")), id="empty-messages"),
    # Semantic checks.
    pytest.param(
        Case(chat(model="gpt-4o"), 404, "model", type="not_found_error", code="model_not_found"),
        id="model-not-served",
    ),
    pytest.param(Case(chat(n=5), *bad("n", "invalid_value")), id="n-over-max"),
    pytest.param(Case(chat(n=0), *bad("n", "invalid_value")), id="n-zero"),
    pytest.param(Case(chat(temperature=3), *bad("temperature", "invalid_value")), id="temperature-range"),
    pytest.param(Case(chat(top_p=0), *bad("top_p", "invalid_value")), id="top_p-zero"),
    pytest.param(Case(chat(seed=-1), *bad("seed", "invalid_value")), id="negative-seed"),
    pytest.param(Case(chat(stop=["a", "b", "c", "d", "e"]), *bad("stop", "invalid_value")), id="five-stops"),
    pytest.param(Case(chat(stop=""), *bad("stop", "invalid_value")), id="empty-stop"),
    pytest.param(Case(chat(max_tokens=0), *bad("max_tokens", "invalid_value")), id="max_tokens-zero"),
    pytest.param(
        Case(chat(max_tokens=4096), *bad("max_tokens", "context_length_exceeded")),
        id="max_tokens-over-context",
    ),
    pytest.param(
        Case(chat(max_completion_tokens=4096), *bad("max_completion_tokens", "context_length_exceeded")),
        id="max_completion_tokens-over-context",
    ),
    pytest.param(
        Case(
            chat(messages=[{"role": "user", "content": LONG_TEXT}]),
            *bad("messages", "context_length_exceeded"),
        ),
        id="prompt-over-context",
    ),
    pytest.param(
        Case(chat(top_logprobs=2), *bad("top_logprobs", "invalid_value")), id="top_logprobs-without-logprobs"
    ),
    pytest.param(
        Case(chat(logprobs=True, top_logprobs=21), *bad("top_logprobs")), id="top_logprobs-over-max"
    ),
    pytest.param(
        Case(chat(stream_options={"include_usage": True}), *bad("stream_options", "invalid_value")),
        id="stream_options-without-stream",
    ),
    # Bodies that are not a JSON object at all.
    pytest.param(Case(b'{"model": ', *bad(None, "invalid_json")), id="invalid-json"),
    pytest.param(Case(b"", *bad(None, "invalid_json")), id="empty-body"),
    # Legacy completions.
    pytest.param(
        Case(
            completion(prompt=["one", "two", "three"]), *bad("prompt", "unsupported_value"), path=COMPLETIONS
        ),
        id="completions-prompt-batch",
    ),
    pytest.param(
        Case(completion(prompt=[1, 2, 10**9]), *bad("prompt", "invalid_value"), path=COMPLETIONS),
        id="completions-token-out-of-vocab",
    ),
    pytest.param(
        Case(completion(prompt=""), *bad("prompt", "invalid_value"), path=COMPLETIONS),
        id="completions-empty-prompt",
    ),
    pytest.param(
        Case(completion(echo=True), *bad("echo", "unsupported_value"), path=COMPLETIONS),
        id="completions-echo",
    ),
    pytest.param(
        Case(completion(best_of=3), *bad("best_of", "unsupported_value"), path=COMPLETIONS),
        id="completions-best_of",
    ),
    pytest.param(
        Case(completion(logprobs=50), *bad("logprobs"), path=COMPLETIONS), id="completions-logprobs"
    ),
    pytest.param(
        Case(completion(prompt=LONG_TEXT), *bad("prompt", "context_length_exceeded"), path=COMPLETIONS),
        id="completions-prompt-over-context",
    ),
    pytest.param(
        Case(completion(suffix="x"), *bad("suffix", "unsupported_value"), path=COMPLETIONS),
        id="completions-suffix",
    ),
    # Routing.
    pytest.param(
        Case(chat(), 404, None, type="not_found_error", path="/v1/nothing-here"), id="unknown-route"
    ),
    pytest.param(Case(None, 405, None, method="GET"), id="get-on-chat"),
]


@asynccontextmanager
async def client_for(
    engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy, **server: int
) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client (with a consumer key) to the gateway on `engine`, served in-process."""
    app = create_app(
        make_config(**server), engine=engine, renderer=renderer, tenants=tenancy.store, sink=outcomes
    )
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, timeout=30, headers=tenancy.consumer_headers) as http,
    ):
        yield http


@pytest.fixture
async def client(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(sim_engine, renderer, outcomes, tenancy) as http:
        yield http


@pytest.fixture
async def small_body_client(
    sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog, tenancy: Tenancy
) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(sim_engine, renderer, outcomes, tenancy, max_body_bytes=MAX_BODY) as http:
        yield http


async def send(client: httpx.AsyncClient, case: Case) -> httpx.Response:
    if case.body is None:
        return await client.request(case.method, case.path)
    if isinstance(case.body, bytes):
        headers = {"content-type": "application/json"}
        return await client.request(case.method, case.path, content=case.body, headers=headers)
    return await client.request(case.method, case.path, json=case.body)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The inner error object, after checking the whole body has exactly the OpenAI error shape."""
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id"), "every response, errors included, carries x-request-id"
    body = response.json()
    assert isinstance(body, dict)
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["code"], str)  # every error carries a machine-readable code
    assert error["code"]
    return error


async def assert_engine_untouched(engine: SimulatedEngine, outcomes: OutcomeLog) -> None:
    assert outcomes.items == []
    load = await engine.load()
    assert (load.running, load.waiting) == (0, 0)


@pytest.mark.parametrize("case", CASES)
async def test_refusal(
    case: Case, client: httpx.AsyncClient, sim_engine: SimulatedEngine, outcomes: OutcomeLog
) -> None:
    response = await send(client, case)
    assert response.status_code == case.status, response.text
    error = error_of(response)
    assert error["type"] == case.type
    assert error["param"] == case.param
    assert error["code"] == case.code
    if case.status == 405:
        assert "POST" in response.headers["allow"]
    await assert_engine_untouched(sim_engine, outcomes)


async def _chunks(data: bytes, size: int = 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("with_length", [True, False], ids=["content-length", "chunked"])
async def test_body_over_limit_is_413(
    with_length: bool, small_body_client: httpx.AsyncClient, sim_engine: SimulatedEngine, outcomes: OutcomeLog
) -> None:
    client = small_body_client
    # A valid request, padded past max_body_bytes with a long message.
    raw = httpx.Request("POST", "/", json=chat(messages=[{"role": "user", "content": "x" * 10_000}])).read()
    assert len(raw) > 2 * MAX_BODY
    headers = {"content-type": "application/json"}
    if with_length:
        response = await client.post(CHAT, content=raw, headers=headers)
    else:
        # An async iterator body has no known length: httpx sends it chunked, without content-length.
        response = await client.post(CHAT, content=_chunks(raw), headers=headers)
        assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert error["code"] == "body_too_large"
    await assert_engine_untouched(sim_engine, outcomes)


GARBAGE = [
    b"[]",
    b"null",
    b'"str"',
    b"42",
    b'{"model": null}',
    b'{"messages": [{}]}',
    b'{"model": "x", "messages": [1]}',
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_garbage_bodies_are_4xx_never_500(
    path: str, client: httpx.AsyncClient, sim_engine: SimulatedEngine, outcomes: OutcomeLog
) -> None:
    for raw in GARBAGE:
        response = await client.post(path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (raw, response.status_code, response.text)
        error_of(response)
    await assert_engine_untouched(sim_engine, outcomes)


async def test_handlers_and_headers_share_one_request_id(
    client: httpx.AsyncClient, outcomes: OutcomeLog
) -> None:
    # The id middleware wraps the whole app (router errors get an id too); handlers must still see that id.
    response = await client.post(CHAT, json=chat(max_tokens=3))
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == f"chatcmpl-{request_id}"
    assert (await outcomes.wait_for(request_id)).request_id == request_id
