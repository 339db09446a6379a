"""`POST /v1/chat/completions` and `POST /v1/completions`: the generation routes (OpenAI tag `openai`).

The fast path (`gateway.edge.fastpath`, which also holds `generate`, what both run) answers them before
Litestar's request cycle; these handlers document the routes in the OpenAPI document and answer only where
the fast path is not in front (behind a root path).
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example
from litestar.status_codes import HTTP_200_OK

from gateway.api.openapi import (
    ChatStreamingOperation,
    CompletionStreamingOperation,
    errors,
    request_body,
    secured,
)
from gateway.edge.adapter import body_limit
from gateway.edge.fastpath import generate
from gateway.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from gateway.services import Services
from policy.auth import Principal

# What generation can answer besides 401/403/503: invalid fields, unknown model, body too large, quota,
# a failed engine.
_GENERATION_ERRORS = (400, 404, 413, 429, 502)


@post(
    "/v1/chat/completions",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        ChatCompletionRequest,
        {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
        },
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ChatCompletion,
            generate_examples=False,
            description="The whole completion (JSON), or with `stream: true` server-sent events.",
            examples=[
                Example(
                    summary="whole",
                    value={
                        "id": "chatcmpl-1",
                        "created": 1767225600,
                        "model": "SmolLM2-135M-Instruct",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "Paris."},
                                "finish_reason": "stop",
                                "logprobs": None,
                            }
                        ],
                        "usage": {"prompt_tokens": 36, "completion_tokens": 3, "total_tokens": 39},
                        "object": "chat.completion",
                    },
                )
            ],
        ),
        **errors(*_GENERATION_ERRORS),
    },
    operation_class=ChatStreamingOperation,
)
async def chat_completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI chat completions, whole or streamed (served by `gateway.edge.fastpath`; this handler documents
    the route and answers only if the fast path is not in front, e.g. behind a root path)."""
    return await generate("chat", services, request, principal, body_limit(request.route_handler))


@post(
    "/v1/completions",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        CompletionRequest,
        {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8},
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            Completion,
            generate_examples=False,
            description="The whole completion (JSON), or with `stream: true` server-sent events.",
        ),
        **errors(*_GENERATION_ERRORS),
    },
    operation_class=CompletionStreamingOperation,
)
async def completions(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """OpenAI legacy completions, whole or streamed (served by `gateway.edge.fastpath`, as chat is)."""
    return await generate("completion", services, request, principal, body_limit(request.route_handler))


ROUTES = [secured("openai", [chat_completions, completions])]
