"""`/v1/sessions`: server-side sessions (OpenAPI tag `sessions`; `gateway.sessions`).

    POST   /v1/sessions                      create: bound to the versions its model and policy resolve to now
    GET    /v1/sessions/{id}                 the session: bound versions, history, usage, migrations
    DELETE /v1/sessions/{id}                 end it (`deleted`: 410 from then on)
    POST   /v1/sessions/{id}/messages        one step: its messages appended, the reply as a chat completion

The chat route joins a session with the `x-lockgate-session` header instead (`gateway.edge.fastpath`).
Consumers only; a tenant never reads another tenant's session (404, as for an unknown id).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK
from msgspec.structs import asdict

from gateway.api.openapi import ChatStreamingOperation, errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow
from gateway.edge.sessions import session_chat, sessions_of
from gateway.schemas import ChatCompletion, ChatCompletionRequest, ChatMessage, ModelName
from gateway.services import Services
from gateway.sessions.base import Bound, Migration, OnRetire, SessionRecord, Usage
from policy.auth import Principal

_Key = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_Value = Annotated[str, msgspec.Meta(max_length=512)]


class SessionCreateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/sessions`."""

    model: ModelName
    # The tenant's own policy (its name, or the version it resolves to now): a pin, never another policy.
    policy: str | None = None
    # One of the tenant's registry prompts (the tenant's or this key's, or a version of one); default: the
    # prompt this key's requests get.
    system_prompt: str | None = None
    # Seconds from creation to absolute expiry, and without a step to idle expiry (at most the configured).
    ttl: float | None = None
    idle_timeout: float | None = None
    metadata: Annotated[dict[_Key, _Value], msgspec.Meta(max_length=16)] | None = None
    # What happens when the bound model version is no longer served: `fail` (410 model_version_retired), or
    # `migrate` where the bound policy allows it.
    on_retire: OnRetire = "fail"


class SessionStepRequest(ChatCompletionRequest, frozen=True, kw_only=True):
    """`POST /v1/sessions/{id}/messages`: a chat completion request whose `messages` are this step's only
    (the history is the session's), with the step's number; `model` may be left out."""

    model: str = ""
    # 1 for the first step; None: the next one (no retry safety).
    step: Annotated[int, msgspec.Meta(ge=1)] | None = None


class SessionStep(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded step."""

    step: int
    messages: list[ChatMessage]
    reply: ChatMessage
    usage: Usage
    created_at: float


class SessionObject(msgspec.Struct, frozen=True, kw_only=True):
    """A session as `GET /v1/sessions/{id}` shows it."""

    id: str
    object: Literal["session"] = "session"
    model: str
    bound: Bound
    created_at: float
    expires_at: float
    idle_expires_at: float
    on_retire: OnRetire
    metadata: dict[str, str]
    steps: list[SessionStep]
    history_tokens: int
    migrations: list[Migration]


class SessionDeleted(msgspec.Struct, frozen=True, kw_only=True):
    """`DELETE /v1/sessions/{id}`."""

    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


_CREATE = Decoder(SessionCreateRequest)
_STEP = Decoder(SessionStepRequest)
_CHAT_FIELDS = tuple(f for f in ChatCompletionRequest.__struct_fields__)


def session_object(record: SessionRecord) -> SessionObject:
    """What the API shows of `record`."""
    return SessionObject(
        id=record.id,
        model=record.model,
        bound=record.bound,
        created_at=record.created_at,
        expires_at=record.expires_at,
        idle_expires_at=min(record.expires_at, record.last_used + record.idle_timeout),
        on_retire=record.on_retire,
        metadata=record.metadata,
        steps=[
            SessionStep(step=s.step, messages=s.messages, reply=s.reply, usage=s.usage, created_at=s.at)
            for s in record.steps
        ],
        history_tokens=record.history_tokens,
        migrations=record.migrations,
    )


@post(
    "/v1/sessions",
    status_code=HTTP_200_OK,
    dependencies=request_body(SessionCreateRequest, {"model": "SmolLM2-135M-Instruct", "ttl": 3600}),
    responses=errors(400, 404, 413),
)
async def create_session(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> SessionObject:
    """Start a session bound to the versions its model, the tenant's policy and system prompt resolve to."""
    allow(principal, "consumer")
    body = _CREATE.decode(await read_body(request))
    record = await sessions_of(services).create(
        services.generation,
        principal,
        model=body.model,
        policy=body.policy,
        system_prompt=body.system_prompt,
        ttl=body.ttl,
        idle_timeout=body.idle_timeout,
        metadata=body.metadata,
        on_retire=body.on_retire,
    )
    return session_object(record)


@get("/v1/sessions/{session_id:str}", responses=errors(400, 404, 410))
async def get_session(
    session_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> SessionObject:
    """The caller's session: bound versions and history."""
    allow(principal, "consumer")
    return session_object(await sessions_of(services).get(principal, session_id))


@delete("/v1/sessions/{session_id:str}", status_code=HTTP_200_OK, responses=errors(400, 404, 410))
async def delete_session(
    session_id: FromPath[str], services: NamedDependency[Services], principal: NamedDependency[Principal]
) -> SessionDeleted:
    """End the caller's session: its history is dropped and it answers 410 `deleted` from then on."""
    allow(principal, "consumer")
    await sessions_of(services).delete(principal, session_id)
    return SessionDeleted(id=session_id)


@post(
    "/v1/sessions/{session_id:str}/messages",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        SessionStepRequest, {"step": 1, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            ChatCompletion,
            generate_examples=False,
            description="The step's reply as a chat completion (JSON), or with `stream: true` server-sent "
            "events; headers `x-lockgate-session` and `x-lockgate-session-step`.",
        ),
        **errors(400, 404, 409, 410, 413, 429, 502),
    },
    operation_class=ChatStreamingOperation,
)
async def session_messages(
    session_id: FromPath[str],
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[Any]:
    """Append one step and answer with the assistant's reply, as a chat completion (whole or streamed)."""
    allow(principal, "consumer")
    body = _STEP.decode(await read_body(request))
    fields = asdict(body)
    req = ChatCompletionRequest(**{name: fields[name] for name in _CHAT_FIELDS})
    return await session_chat(services, request, principal, session_id, body.step, req)


ROUTES = [secured("sessions", [create_session, get_session, delete_session, session_messages])]
