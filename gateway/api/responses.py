"""`/v1/responses`: the OpenAI Responses API, served by the chat completions pipeline (OpenAPI tag `openai`).

    POST   /v1/responses          a response, whole or streamed; `store` (default true) keeps it for the
                                  tenant policy's `stored_response_ttl`, and `previous_response_id`
                                  continues a stored one
    GET    /v1/responses/{id}     a stored response, as it was answered
    GET    /v1/responses/{id}/input_items   the input items it was made from, a page at a time
    DELETE /v1/responses/{id}     forget it

The request becomes a chat completion (`gateway.responses_api.requests`: what the chat route cannot do is a
400 naming the field), which runs the whole pipeline (quota, input guard over every input item, admission,
engine, output guard, audit); its answer is re-told as a response object or as the Responses API's event
stream (`gateway.responses_api.output`), and kept as it was sent where the response is stored
(`gateway.responses_api.stored`, in the session store). Errors before the answer are the chat route's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.enums import MediaType
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK

from gateway.api.openapi import errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow
from gateway.errors import InvalidRequestError
from gateway.generation.pipeline import run_chat
from gateway.generation.resolution import policy_for
from gateway.keeping import StoredAnswer, kept
from gateway.responses_api.output import events, final, whole
from gateway.responses_api.requests import chat_request, input_messages
from gateway.responses_api.schemas import ResponseCreateRequest, ResponseObject
from gateway.responses_api.stored import ROOT, StoredResponses, input_items, new_id, request_of
from gateway.schemas import ChatCompletion
from gateway.services import Services
from gateway.sessions.history import messages_of
from policy.auth import Principal

_REQUEST = Decoder(ResponseCreateRequest)


class InputItemList(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/responses/{id}/input_items`: one page of a stored response's input items."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class ResponseDeleted(msgspec.Struct, frozen=True, kw_only=True):
    """`DELETE /v1/responses/{id}`."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


def _stored(services: Services, param: str) -> StoredResponses:
    if services.sessions is None:
        raise InvalidRequestError(
            "responses are not stored on this gateway (`[sessions] enabled` is false)",
            param=param,
            code="unsupported_parameter",
        )
    return StoredResponses(services.sessions)


@post(
    "/v1/responses",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        ResponseCreateRequest,
        {
            "model": "SmolLM2-135M-Instruct",
            "input": "What is the capital of France?",
            "max_output_tokens": 16,
        },
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ResponseObject,
            generate_examples=False,
            description="The response (JSON), or with `stream: true` the Responses API's server-sent events "
            "(`response.created` ... `response.completed`, `response.incomplete` or `response.failed`).",
        ),
        **errors(400, 404, 413, 429, 502),
    },
)
async def create_response(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """A model response, whole or streamed, from text or input items, with function tools and structured
    output, through the same gate as chat completions."""
    allow(principal, "consumer")
    body = _REQUEST.decode(await read_body(request))
    messages = input_messages(body)
    rid = new_id()
    store = body.store is not False and services.sessions is not None
    stored = _stored(services, "previous_response_id") if body.previous_response_id or store else None
    previous = None
    if stored is not None and body.previous_response_id:
        previous = await stored.load(principal, body.previous_response_id, "previous_response_id")
    history = messages_of(previous) if previous else None
    chat = chat_request(body, messages, history)
    binding = None
    ttl = 0.0
    if stored is not None:
        bound = previous.bound if previous else stored.bound(services.generation, principal, body)
        root = previous.metadata.get(ROOT, previous.id) if previous else rid
        binding = stored.binding(bound, principal.tenant.tenant_id, root)
        # Kept as long as the policy the response runs under says (0: not at all).
        policy = policy_for(services.generation, principal, binding).spec
        ttl = policy.stored_response_ttl_or(services.config.sessions.ttl) if store else 0.0
        store = ttl > 0
    body = msgspec.structs.replace(body, store=store)
    answer = await run_chat(services.generation, chat, request, principal, binding)
    if (answer.status_code or 200) != 200:
        return answer
    if store and stored is not None:
        keeper = stored

        async def keep(sent: StoredAnswer | None) -> None:
            if sent is not None:
                await keeper.keep(principal, rid, body, bound, previous, messages, sent, ttl)

        state = request.scope.setdefault("state", {})
        answer = await kept(answer, keep, state, services.config.sessions.max_answer_bytes)
    if isinstance(answer.content, AsyncIterator):
        answer.content = events(body, answer.content, rid)
        return answer
    if isinstance(answer.content, (bytes, ChatCompletion)):
        content = whole(body, answer.content, rid)
        return Response(content=content, media_type=MediaType.JSON, headers=answer.headers)
    return answer


@get("/v1/responses/{response_id:str}", responses=errors(400, 404))
async def get_response(
    response_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ResponseObject:
    """A stored response, as it was answered."""
    allow(principal, "consumer")
    record = await _stored(services, "response_id").load(principal, response_id, "response_id")
    answer = record.steps[-1].answer
    streamed = answer.media_type.startswith("text/event-stream")
    return await final(request_of(record), answer.body, streamed, record.id)


@get("/v1/responses/{response_id:str}/input_items", responses=errors(400, 404))
async def list_input_items(
    response_id: FromPath[str],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
    limit: FromQuery[int] = 20,
    order: FromQuery[str] = "desc",
    after: FromQuery[str | None] = None,
) -> InputItemList:
    """The input items a stored response was made from (not the earlier turns it continued), a page at a
    time: `order` desc (newest first, OpenAI's default) or asc, `after` an item id."""
    allow(principal, "consumer")
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be in 1..100", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be asc or desc", param="order", code="invalid_value")
    record = await _stored(services, "response_id").load(principal, response_id, "response_id")
    items = input_items(record)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"no input item `{after}` in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return InputItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(items) > limit,
    )


@delete("/v1/responses/{response_id:str}", status_code=HTTP_200_OK, responses=errors(400, 404))
async def delete_response(
    response_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> ResponseDeleted:
    """Forget a stored response (the responses that continued it keep their own copies)."""
    allow(principal, "consumer")
    await _stored(services, "response_id").delete(principal, response_id)
    return ResponseDeleted(id=response_id)


ROUTES = [secured("openai", [create_response, get_response, list_input_items, delete_response])]
