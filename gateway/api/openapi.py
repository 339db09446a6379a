"""The API contract: the OpenAPI 3.1 document Litestar generates from the route handlers, at
`/schema/openapi.json`, and its docs page at `/schema` (gateway/api/docs.py). What every handler declares
the same way lives here, once:

- Security: one scheme, `bearer` (an API key in `Authorization: Bearer lg-...`), on every route but the
  health probes. `secured(tag, handlers)` groups the handlers of one API area under its tag and the scheme.
- Errors: every error answer is the OpenAI shape (`ErrorResponse`); `errors(...)` declares an operation's,
  with an example each. It always includes the answers any authenticated route can give: 401 (no valid key),
  403 (the key lacks the role) and 503 (a store that cannot answer now).
- Request bodies: handlers read and decode the raw body themselves (gateway/edge/decoding.py: errors in the
  OpenAI shape that name the field, checked after authentication), so Litestar cannot see the type.
  `request_body(T)` declares it through Litestar's own rule that the `data` parameter of a handler's
  dependency is the operation's request body; that dependency is never resolved (no handler parameter asks
  for it), so it documents the body without decoding it.
- Streaming: `StreamingOperation` adds the `text/event-stream` answer of `stream: true` to the JSON one.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Final

import msgspec
from litestar import Router
from litestar.di import Provide
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    Components,
    Example,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Parameter,
    Schema,
    SecurityRequirement,
    SecurityScheme,
    Tag,
)
from litestar.params import Body
from litestar.types import ControllerRouterHandler

from gateway.api.docs import DocsPagePlugin
from gateway.errors import ErrorBody, ErrorResponse
from gateway.generation.admission import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    QUEUE_WAIT_HEADER,
    SESSION_HEADER,
)
from gateway.generation.caching import CACHE_HEADER
from gateway.generation.guarding import GUARD_HEADER
from gateway.generation.pipeline import MODEL_HEADER
from gateway.idempotency.replay import REPLAYED_HEADER

SCHEME: Final = "bearer"
BEARER: Final[Sequence[SecurityRequirement]] = ({SCHEME: []},)
# The dependency that carries a handler's request-body type for the document (never resolved).
BODY_DEPENDENCY: Final = "openapi_request_body"
SCHEMA_PATH: Final = "/schema"

TAGS: Final = (
    Tag(name="openai", description="The OpenAI-compatible API (role `consumer`)."),
    Tag(
        name="sessions",
        description="Server-side sessions bound to the model, template and policy versions they started on "
        "(role `consumer`).",
    ),
    Tag(name="appeals", description="Appeals of gate decisions: filed by consumers, decided by reviewers."),
    Tag(name="audit", description="The audit trail of gate decisions (role `reviewer`)."),
    Tag(name="admin", description="Tenants, quotas and API keys (role `policy_admin`)."),
    Tag(
        name="registry", description="Versioned models, templates, guards and policies (role `policy_admin`)."
    ),
    Tag(
        name="health",
        description="Liveness and readiness probes (no key; an `operator` key gets readiness in detail), and "
        "the metrics (a `metrics` or `operator` key, unless `[metrics] require_key` is off).",
    ),
)

# Every authenticated operation can answer these.
AUTH_STATUSES: Final = (401, 403, 503)

# status -> (when, an example body).
_ERRORS: Final[Mapping[int, tuple[str, ErrorBody]]] = MappingProxyType(
    {
        400: (
            "The request is invalid; `param` names the field.",
            ErrorBody(
                message="Expected `int`, got `str`",
                type="invalid_request_error",
                param="max_tokens",
                code="invalid_value",
            ),
        ),
        401: (
            "No valid API key (missing, unknown, expired or revoked); with `WWW-Authenticate: Bearer`.",
            ErrorBody(message="invalid API key", type="authentication_error", code="invalid_api_key"),
        ),
        403: (
            "The key lacks the role this operation needs, or names another tenant.",
            ErrorBody(
                message="this API key lacks the `policy_admin` role",
                type="permission_error",
                code="missing_role",
            ),
        ),
        404: (
            "The named object does not exist (or belongs to another tenant).",
            ErrorBody(message="no tenant globex", type="not_found_error", code="not_found"),
        ),
        409: (
            "The object exists already, or the step conflicts with its state.",
            ErrorBody(message="tenant acme exists", type="conflict_error", code="already_exists"),
        ),
        410: (
            "The session has ended; `code` says why (expired, evicted_capacity, deleted, "
            "model_version_retired). Start a new session.",
            ErrorBody(
                message="this session has ended (expired); start a new session",
                type="invalid_request_error",
                param="session_id",
                code="expired",
            ),
        ),
        413: (
            "The body is larger than `server.max_body_bytes`.",
            ErrorBody(
                message="request body is larger than the configured limit",
                type="invalid_request_error",
                code="body_too_large",
            ),
        ),
        429: (
            "A quota bucket is short; `Retry-After` says in how many seconds the request fits, rounded "
            "up, and `retry-after-ms` in milliseconds (a tenant's own backlog, `queue_full`: `Retry-After` "
            "only).",
            ErrorBody(
                message="rate limit reached on `tenant.tokens`; this request fits again in 1.50 s",
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
            ),
        ),
        502: (
            "The engine failed while serving the request.",
            ErrorBody(message="the engine failed this request", type="engine_error", code="engine_error"),
        ),
        503: (
            "Cannot answer now (a store, the engines, or a guard whose policy fails closed); with "
            "`Retry-After` where a retry can help.",
            ErrorBody(
                message="the tenant store is unavailable; try again shortly",
                type="service_unavailable",
                code="store_unavailable",
            ),
        ),
    }
)


def error_spec(status: int) -> ResponseSpec:
    """The OpenAI-shaped error answer of `status`, with its example."""
    when, example = _ERRORS[status]
    return ResponseSpec(
        data_container=ErrorResponse,
        generate_examples=False,
        description=when,
        examples=[Example(summary=example.code, value=msgspec.to_builtins(ErrorResponse(error=example)))],
    )


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """The error answers of an authenticated operation: 401, 403 and 503, and `statuses`."""
    return {status: error_spec(status) for status in sorted({*AUTH_STATUSES, *statuses})}


def request_body(
    struct: type[Any], *examples: Any, description: str | None = None, component: str | None = None
) -> dict[str, Provide]:
    """The dependencies that document a handler's JSON request body as `struct` (see the module docstring).

    `examples` are request bodies as JSON values. `component`: the body's own schema name, for a struct that
    responses return too. Litestar keeps the first schema it meets under a name, and the order in which it
    meets a path's methods follows string hashing: without a name of its own, the request body's description
    and examples would be in the document or not depending on `PYTHONHASHSEED`."""

    def documentation_only(data: Any) -> None:
        raise RuntimeError("this dependency documents a request body and is never resolved")

    # Set at run time: the annotation names the type passed in.
    documentation_only.__annotations__ = {
        "data": Annotated[
            struct,
            Body(
                description=description or struct.__doc__,
                examples=[Example(value=e) for e in examples],
                schema_component_key=component,
            ),
        ],
        "return": None,
    }
    return {BODY_DEPENDENCY: Provide(documentation_only, sync_to_thread=False)}


def secured(tag: str, handlers: Sequence[ControllerRouterHandler]) -> Router:
    """The handlers of one API area, under its OpenAPI tag and behind the bearer key scheme."""
    return Router("/", route_handlers=list(handlers), tags=[tag], security=list(BEARER))


def public(tag: str, handlers: Sequence[ControllerRouterHandler]) -> Router:
    """Handlers that need no key, under their OpenAPI tag."""
    return Router("/", route_handlers=list(handlers), tags=[tag])


_SSE_DESCRIPTION: Final = (
    "With `stream: true`: server-sent events. The `data` of each event is one chunk as JSON "
    "(`chat.completion.chunk` objects for chat, `text_completion` objects for completions); an error after "
    'the stream started is an event whose data is `{"error": {...}}` in the OpenAI shape; the last event '
    "is `data: [DONE]`."
)


_TEXT: Final = Schema(type=OpenAPIType.STRING)
# The request headers the generation routes read (README "Idempotent retries", "Result cache", "Engine fleet
# and fair admission").
GENERATION_HEADERS: Final = (
    (
        "Idempotency-Key",
        "1 to 255 printable ASCII characters: a retry with the same key and body gets the "
        "first answer back (`idempotent-replayed: true`), with no second engine call or charge.",
    ),
    (
        "Cache-Control",
        "`no-cache`: generate afresh (the result cache keeps the new answer); `no-store`: "
        "neither look up nor keep.",
    ),
    (PRIORITY_HEADER, "`interactive` or `batch`: the admission class, never above the tenant's."),
    (
        DEADLINE_HEADER,
        "Seconds the request may wait in the admission queue; it only lowers the class's default.",
    ),
    (SESSION_HEADER, "Keeps a conversation on one engine replica (its prefix cache); default: `user`."),
)
# The headers of a 200 answer.
GENERATION_ANSWER_HEADERS: Final = (
    (MODEL_HEADER, "The exact model version (name@version) that served the answer."),
    (GUARD_HEADER, "What decided the input and output guard checks (`input=rules`, `input=model`, ...)."),
    (QUEUE_WAIT_HEADER, "Seconds the request waited for admission."),
    (CACHE_HEADER, "`hit` or `miss`, on a request the result cache may answer."),
    (REPLAYED_HEADER, "`true` on an answer replayed for an `Idempotency-Key` retry."),
)


@dataclass
class StreamingOperation(Operation):
    """An operation whose 200 answer is JSON, or server-sent events when the request has `stream: true`; the
    generation routes' request and answer headers documented."""

    sse_example: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.parameters = [
            *(self.parameters or []),
            *(
                Parameter(name=name, param_in="header", schema=_TEXT, description=text, required=False)
                for name, text in GENERATION_HEADERS
            ),
        ]
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            ok.content = {
                **(ok.content or {}),
                "text/event-stream": OpenAPIMediaType(
                    schema=Schema(type=OpenAPIType.STRING, description=_SSE_DESCRIPTION),
                    example=self.sse_example,
                ),
            }
            ok.headers = {
                **(ok.headers or {}),
                **{
                    name: OpenAPIHeader(schema=_TEXT, description=text)
                    for name, text in GENERATION_ANSWER_HEADERS
                },
            }


@dataclass
class ChatStreamingOperation(StreamingOperation):
    """`POST /v1/chat/completions`: JSON or a stream of `chat.completion.chunk` events."""

    sse_example: ClassVar[str] = (
        'data: {"id":"chatcmpl-1","created":1767225600,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
        '"delta":{"role":"assistant","content":"Paris"},"finish_reason":null}],'
        '"object":"chat.completion.chunk"}\n\n'
        'data: {"id":"chatcmpl-1","created":1767225600,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
        '"delta":{},"finish_reason":"stop"}],"object":"chat.completion.chunk"}\n\n'
        "data: [DONE]\n\n"
    )


@dataclass
class CompletionStreamingOperation(StreamingOperation):
    """`POST /v1/completions`: JSON or a stream of `text_completion` events."""

    sse_example: ClassVar[str] = (
        'data: {"id":"cmpl-1","created":1767225600,"model":"SmolLM2-135M-Instruct","choices":[{"index":0,'
        '"text":" Paris","finish_reason":null}],"object":"text_completion"}\n\ndata: [DONE]\n\n'
    )


def query_parameters(*parameters: Parameter) -> type[Operation]:
    """An Operation class that adds `parameters` (for handlers that read their query string themselves)."""

    @dataclass
    class WithQuery(Operation):
        def __post_init__(self) -> None:
            self.parameters = [*(self.parameters or []), *parameters]

    return WithQuery


def query(name: str, schema: Schema, description: str) -> Parameter:
    """An optional query parameter."""
    return Parameter(name=name, param_in="query", schema=schema, description=description, required=False)


def _version() -> str:
    try:
        return importlib.metadata.version("lockgate")
    except importlib.metadata.PackageNotFoundError:
        # Run from a checkout that was never installed.
        return "0.0.0"


def openapi_config() -> OpenAPIConfig:
    """The document's configuration: info, the bearer scheme, the tags, and where it is served."""
    return OpenAPIConfig(
        title="Lockgate",
        version=_version(),
        description=(
            "A safety-gated, multi-tenant, OpenAI-compatible gateway in front of LLM engines. Every error is "
            'the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`.'
        ),
        components=Components(
            security_schemes={
                SCHEME: SecurityScheme(
                    type="http",
                    scheme="bearer",
                    bearer_format="lg-<key id>-<secret>",
                    description=(
                        "An API key, issued by `POST /admin/tenants/{tenant_id}/keys` or "
                        "`lockgate admin create-key`."
                    ),
                )
            }
        ),
        tags=list(TAGS),
        use_handler_docstrings=True,
        path=SCHEMA_PATH,
        render_plugins=[DocsPagePlugin()],
    )
