"""Console sessions and the request plumbing of the reviewer console's pages (`gateway.console.pages`).

The cookie holds a random session id only (HttpOnly, SameSite=Strict, Path=/, no Domain, and `Secure` with
the `__Host-` prefix unless `[console] insecure_cookie` opts out for plain-HTTP development: the scheme the
gateway sees never decides, since a TLS proxy in front of it speaks plain HTTP); the app's `SessionStore`
(`sessions_of`: built in the lifespan from `[console]` and kept in the app state: in this process, or in
Redis for every gateway process to share, see `gateway.console.sessions`) maps the id to the key's
Authorization value, which is authenticated again on every request, so a revoked key or a removed role ends
its console session at once. Sessions expire `[console] session_ttl` after sign-in (injected clock). Every
POST after sign-in carries the session's CSRF token. Store and auth failures become `PageError`s, which the
console renders as HTML error pages (an unreachable session store: 503).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import parse_qs

import msgspec
from litestar import MediaType, Request, Response
from litestar.datastructures import Cookie

from gateway.config import ConsoleConfig
from gateway.console import views
from gateway.console.sessions import (
    Session,
    SessionStore,
    SessionStoreFullError,
    SessionStoreUnavailableError,
)
from gateway.edge.security import reviewer_scope
from gateway.errors import APIError
from gateway.services import Services
from policy.appeals.base import (
    AppealClaimedError,
    AppealConflictError,
    AppealNotFoundError,
    InvalidTransitionError,
)
from policy.audit.base import AuditUnavailableError
from policy.audit.base import NotFoundError as AuditNotFoundError
from policy.auth import AuthError, Principal
from policy.auth import StoreUnavailableError as KeyStoreUnavailableError

T = TypeVar("T")
# Cookie names without their `__Host-` prefix (`cookie_name`).
COOKIE = "lockgate_console"
HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


class PageError(Exception):
    """A console request that fails: rendered as an HTML error page with `status`."""

    def __init__(self, status: int, message: str, session: Session | None = None, who: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.session = session
        self.who = who


class Reviewer(msgspec.Struct, frozen=True, kw_only=True):
    """The signed-in reviewer of a request: session, principal and scope (None: every tenant)."""

    sid: str
    session: Session
    principal: Principal
    scope: str | None

    @property
    def who(self) -> str:
        """Key id and tenant, for the header."""
        return f"{self.principal.key.key_id} ({self.scope or 'all tenants'})"


def cookie_name(base: str, console: ConsoleConfig) -> str:
    """The cookie's name: `__Host-<base>` (the browser keeps it only if Secure, Path=/ and host-only, so no
    sibling subdomain or plain-HTTP page can set it), or `<base>` under `insecure_cookie`."""
    return base if console.insecure_cookie else f"__Host-{base}"


def cookie(base: str, value: str, console: ConsoleConfig, max_age: int) -> Cookie:
    """A console cookie (max_age 0: the one that deletes it, with the same attributes, as `__Host-` needs)."""
    return Cookie(
        key=cookie_name(base, console),
        value=value,
        path="/",
        httponly=True,
        samesite="strict",
        secure=not console.insecure_cookie,
        max_age=max_age,
    )


def html(body: str, status: int = 200) -> Response[str]:
    """An HTML page with the console's security headers."""
    return Response(body, status_code=status, media_type=MediaType.HTML, headers=HEADERS)


def error_response(_request: Request[Any, Any, Any], exc: PageError) -> Response[str]:
    csrf = exc.session.csrf if exc.session is not None else None
    return html(views.error_page(str(exc), csrf=csrf, who=exc.who), exc.status)


def sessions_of(request: Request[Any, Any, Any]) -> SessionStore:
    """The console's session store (built in the lifespan, kept in the app state beside the services)."""
    store: SessionStore = request.app.state.console_sessions
    return store


async def session_call(step: Awaitable[T]) -> T:
    """Run a session store call; an unreachable store is a 503 page (which does not name the store's
    address: the page is shown before sign-in)."""
    try:
        return await step
    except SessionStoreUnavailableError as exc:
        raise PageError(503, "console sessions are unavailable; try again shortly") from exc
    except SessionStoreFullError as exc:
        raise PageError(503, "the console holds all the sessions it may; try again later") from exc


async def signed_in(request: Request[Any, Any, Any], services: Services) -> Reviewer | None:
    """The reviewer whose session the request's cookie names, re-authenticated; None when there is none or
    its key no longer authenticates (that ends the session)."""
    sid = request.cookies.get(cookie_name(COOKIE, services.config.console))
    session = await session_call(sessions_of(request).get(sid))
    if sid is None or session is None:
        return None
    try:
        principal = await services.auth.authenticate(session.authorization)
    except AuthError:
        await session_call(sessions_of(request).close(sid))
        return None
    except KeyStoreUnavailableError as exc:
        raise PageError(503, f"{exc}; try again shortly") from exc
    try:
        scope = reviewer_scope(principal)
    except APIError as exc:
        await session_call(sessions_of(request).close(sid))
        raise PageError(403, "this key no longer has the reviewer role") from exc
    return Reviewer(sid=sid, session=session, principal=principal, scope=scope)


async def form(request: Request[Any, Any, Any]) -> dict[str, str]:
    """An urlencoded form's fields (the first value of each)."""
    fields = parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in fields.items()}


async def posted(request: Request[Any, Any, Any], services: Services) -> tuple[Reviewer, dict[str, str]]:
    """The reviewer and form of a POST: 403 without a live session or without its CSRF token."""
    reviewer = await signed_in(request, services)
    if reviewer is None:
        raise PageError(403, "your session has ended; sign in again")
    fields = await form(request)
    if not hmac.compare_digest(fields.get("csrf", "").encode(), reviewer.session.csrf.encode()):
        raise PageError(403, "the form is stale or forged (CSRF token missing or wrong); reload the page")
    return reviewer, fields


async def call(reviewer: Reviewer, step: Awaitable[T]) -> T:
    """Run an audit or appeal store call, mapping its errors to error pages."""
    try:
        return await step
    except (AuditNotFoundError, AppealNotFoundError) as exc:
        raise PageError(404, "no such decision", reviewer.session, reviewer.who) from exc
    except (AppealConflictError, AppealClaimedError, InvalidTransitionError) as exc:
        raise PageError(409, f"{exc}; reload the page", reviewer.session, reviewer.who) from exc
    except AuditUnavailableError as exc:
        message = "the audit database is unavailable; try again shortly"
        raise PageError(503, message, reviewer.session, reviewer.who) from exc
    except APIError as exc:
        raise PageError(exc.status_code, str(exc), reviewer.session, reviewer.who) from exc
