"""`POST /v1/responses`: the OpenAI Responses API, served by the chat completions pipeline (OpenAPI tag
`openai`).

The request becomes a chat completion (`gateway.responses_api.requests`: what the chat route cannot do is a
400 naming the field), which runs the whole pipeline (quota, input guard over every input item, admission,
engine, output guard, audit); its answer is re-told as a response object or as the Responses API's event
stream (`gateway.responses_api.output`). Errors before the answer are the chat route's, in the OpenAI shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.enums import MediaType
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from gateway.api.openapi import errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow
from gateway.generation.pipeline import run_chat
from gateway.responses_api.output import events, whole
from gateway.responses_api.requests import chat_request
from gateway.responses_api.schemas import ResponseCreateRequest, ResponseObject
from gateway.schemas import ChatCompletion
from gateway.services import Services
from policy.auth import Principal

_REQUEST = Decoder(ResponseCreateRequest)


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
    answer = await run_chat(services.generation, chat_request(body), request, principal)
    if (answer.status_code or 200) != 200:
        return answer
    if isinstance(answer.content, AsyncIterator):
        answer.content = events(body, answer.content)
        return answer
    if isinstance(answer.content, (bytes, ChatCompletion)):
        return Response(
            content=whole(body, answer.content), media_type=MediaType.JSON, headers=answer.headers
        )
    return answer


ROUTES = [secured("openai", [create_response])]
