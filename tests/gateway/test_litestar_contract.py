"""What `gateway.edge.adapter` and `gateway.edge.stack` rely on in Litestar beyond its public API, checked
against the installed Litestar: these tests fail, naming the part, when an upgrade changes one of them. The
fix is in `gateway/edge/` (adapter.py or stack.py) and nowhere else; the parity tests
(`tests/gateway/test_edge_parity.py`) then say whether both paths still answer alike."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any

import pytest
from litestar import Litestar, Request, Response, get, post
from litestar.config.compression import CompressionConfig
from litestar.config.cors import CORSConfig
from litestar.config.csrf import CSRFConfig
from litestar.handlers import HTTPRouteHandler
from litestar.middleware._internal.exceptions.middleware import get_exception_handler

from gateway.app import create_app
from gateway.edge import adapter
from gateway.edge.fastpath import fast_generation
from gateway.edge.stack import Gateway
from tests.conftest import make_config

VERSION = importlib.metadata.version("litestar")

# (module, attribute path, parameter names in order): every callable the adapter and the stack call by name.
SIGNATURES = [
    ("litestar._asgi.asgi_router", "ASGIRouter._handle_routing", ["self", "path", "method"]),
    (
        "litestar.middleware._internal.exceptions.middleware",
        "get_exception_handler",
        ["exception_handlers", "exc"],
    ),
    ("litestar.handlers", "HTTPRouteHandler.resolve_exception_handlers", ["self"]),
    ("litestar.handlers", "HTTPRouteHandler.resolve_request_max_body_size", ["self"]),
    ("litestar", "Request.__init__", ["self", "scope", "receive", "send"]),
    ("litestar", "Response.to_asgi_response", ["self", "app", "request"]),
    ("litestar", "Litestar.__call__", ["self", "scope", "receive", "send"]),
]


@pytest.mark.parametrize(("module", "name", "parameters"), SIGNATURES, ids=[s[1] for s in SIGNATURES])
def test_each_litestar_callable_the_edge_uses_exists_with_its_parameters(
    module: str, name: str, parameters: list[str]
) -> None:
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(target, part), (
            f"litestar {VERSION}: {module}.{name} is gone (gateway/edge/ relies on it)"
        )
        target = getattr(target, part)
    found = list(inspect.signature(target).parameters)
    assert found[: len(parameters)] == parameters, (
        f"litestar {VERSION}: {module}.{name} now takes {found}; gateway/edge/ passes {parameters}"
    )


def _app() -> tuple[Litestar, HTTPRouteHandler, dict[str, Any]]:
    """A plain Litestar app with one POST route (body limit 10) whose handler records the scope it runs in."""
    seen: dict[str, Any] = {}

    @post("/v1/things", request_max_body_size=10)
    async def things(request: Request[Any, Any, Any]) -> None:
        seen.update(request.scope)

    @get("/v1/boom")
    async def boom() -> None:
        raise LookupError("boom")

    app = Litestar([things, boom], exception_handlers={KeyError: _on_key_error})
    return app, things, seen


def _on_key_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    return Response(b"key", status_code=418)


def test_the_router_lookup_returns_the_handler_and_its_template() -> None:
    app, things, _ = _app()
    # `app.asgi_router.handle_routing(path=, method=)` -> (asgi_app, handler, path, path_params, template)
    assert hasattr(app, "asgi_router"), f"litestar {VERSION}: Litestar.asgi_router is gone"
    assert callable(getattr(app.asgi_router, "handle_routing", None)), (
        f"litestar {VERSION}: ASGIRouter.handle_routing (the cached lookup) is gone"
    )
    found = app.asgi_router.handle_routing(path="/v1/things", method="POST")
    assert isinstance(found, tuple)
    assert len(found) == 5, f"litestar {VERSION}: handle_routing now returns {found!r}, not a 5-tuple"
    route = adapter.find_route(app, "/v1/things", "POST")
    assert route.handler.handler_name == things.handler_name
    assert route.template == "/v1/things"
    assert route.body_limit == 10


async def test_the_scope_keys_the_adapter_writes_are_those_litestar_writes() -> None:
    app, _, seen = _app()
    sent: list[Any] = []
    received = iter([{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> Any:
        return next(received)

    async def send(message: Any) -> None:
        sent.append(message)

    given: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/things",
        "raw_path": b"/v1/things",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
    }
    await app(dict(given), receive, send)  # type: ignore[arg-type]
    assert sent[0]["status"] == 201, sent
    written = {key for key in seen if key not in given}
    ours: dict[str, Any] = dict(given)
    adapter.enter_route(ours, app, adapter.find_route(app, "/v1/things", "POST"))  # type: ignore[arg-type]
    # A key Litestar starts writing before a handler runs may be one its Request or responses read: the
    # fast path, which writes them itself, must learn about it.
    assert written == set(ours) - set(given), (
        f"litestar {VERSION}: before a handler runs Litestar now writes {sorted(written)} into the scope; "
        f"gateway.edge.adapter.enter_route writes {sorted(set(ours) - set(given))}"
    )
    for key in ("app", "litestar_app", "route_handler", "path_template", "path_params"):
        assert ours[key] == seen[key] or key == "route_handler", key
    assert ours["route_handler"].handler_name == seen["route_handler"].handler_name
    assert adapter.route_template(seen) == "/v1/things"  # type: ignore[arg-type]


def test_the_exception_handler_lookup_is_litestars_by_class_hierarchy() -> None:
    app, _, _ = _app()
    route = adapter.find_route(app, "/v1/boom", "GET")
    # The app's handler for KeyError answers its subclasses; an exception with no handler of its own gets none
    # from the lookup (Litestar then renders its default 500; the gateway registers one for `Exception`).
    chosen = get_exception_handler(route.exception_handlers, KeyError("k"))
    assert chosen is _on_key_error, f"litestar {VERSION}: get_exception_handler picked {chosen!r}"

    class Narrower(KeyError):
        pass

    assert get_exception_handler(route.exception_handlers, Narrower("k")) is _on_key_error
    assert get_exception_handler(route.exception_handlers, ValueError("v")) is None


def test_the_gateway_replaces_nothing_in_litestar_and_has_no_send_hooks() -> None:
    # The stack runs in front of `Litestar.__call__`: the handler Litestar built is its own, and the fast path
    # (which sends without `Litestar._wrap_send`) is only right while the app has no `before_send` hooks.
    assert Gateway.__call__ is not Litestar.__call__
    assert "asgi_handler" not in vars(Gateway)
    assert hasattr(Litestar, "_wrap_send"), f"litestar {VERSION}: Litestar._wrap_send is gone"
    app = create_app(make_config())
    assert isinstance(app, Gateway)
    assert not app.before_send, "a before_send hook would not run on the fast path"
    assert type(app.asgi_handler).__module__.startswith("litestar."), app.asgi_handler


def _chat_app(**settings: Any) -> Litestar:
    """A Litestar app whose own handler answers the chat route ("litestar"), with `settings` (Litestar's)."""

    @post("/v1/chat/completions")
    async def chat() -> str:
        return "litestar"

    return Litestar([chat], **settings)


async def _post(app: Any, host: str) -> tuple[int, bytes]:
    sent: list[Any] = []
    received = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> Any:
        return next(received)

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", host.encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
    }
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "setting",
    [
        {"allowed_hosts": ["gw.example"]},
        {"cors_config": CORSConfig(allow_origins=["https://gw.example"])},
        {"csrf_config": CSRFConfig(secret="s" * 32)},
        {"compression_config": CompressionConfig(backend="gzip")},
        {"before_send": [lambda message, scope: None]},
    ],
    ids=["allowed_hosts", "cors", "csrf", "compression", "before_send"],
)
def test_a_route_litestar_wraps_in_middleware_is_not_plain(setting: dict[str, Any]) -> None:
    assert adapter.find_route(_chat_app(), "/v1/chat/completions", "POST").plain
    assert not adapter.find_route(_chat_app(**setting), "/v1/chat/completions", "POST").plain
    # The gateway's own app runs none of these: its generation routes take the fast path.
    assert adapter.find_route(create_app(make_config()), "/v1/chat/completions", "POST").plain


async def test_the_fast_path_leaves_a_wrapped_route_to_litestar_so_a_forged_host_is_refused() -> None:
    # An attacker's Host header on an app that lists its hosts: Litestar's middleware refuses it, the fast
    # path in front never answers (it would need the gateway's services, which this app has not got).
    app = _chat_app(allowed_hosts=["gw.example"])
    edge = fast_generation(app, app)
    status, _ = await _post(edge, "evil.example")
    assert status == 400
    assert await _post(edge, "gw.example") == (201, b"litestar")
