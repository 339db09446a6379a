"""Signing in to the reviewer console, before any session exists: the form's CSRF token and the attempt limit.

CSRF: the sign-in page sets a login cookie (`lockgate_login`, with the session cookie's attributes) holding a
random nonce, and its form carries HMAC-SHA256(server secret, nonce) (`ServerSecret.login_token`). A POST to
`/console/login` whose token is not the HMAC of its cookie's nonce is refused 403 before the key is looked
at: a cross-site form can neither read the cookie nor compute the HMAC, and the `__Host-` prefix keeps a
sibling subdomain from planting a nonce whose token it fetched for itself (which `insecure_cookie` gives up).

Attempt limit: every sign-in attempt, failed or not, takes a token from its client address's bucket (an IPv6
address by its /64, which one host can hold whole) and, when the key is well formed, from its key id's
bucket: `[console] login_burst` at once, then `login_per_minute`. The buckets live in the quota store
(`services.meter.store`), so every gateway process on one Redis counts together. An exhausted bucket is a
429 page with Retry-After; an unreachable quota store refuses sign-in (503), it never waves attempts through.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from typing import Any

from litestar import Request, Response

from gateway.console import views
from gateway.console.plumbing import PageError, cookie, cookie_name, html
from gateway.errors import retry_after_seconds
from gateway.services import Services
from policy.quota import BucketSpec, QuotaBackendError, QuotaBusyError, QuotaExceededError
from policy.tenants.keys import parse_key

LOGIN_COOKIE = "lockgate_login"
# Seconds a sign-in form stays usable.
LOGIN_COOKIE_TTL = 3600
_NONCE = re.compile(r"[A-Za-z0-9_-]{32}")
# Every login bucket shares one Redis Cluster hash tag: one reserve touches an address's and a key's.
_BUCKET = "{console-login}"


def _nonce(request: Request[Any, Any, Any], services: Services) -> str:
    """The nonce of the request's login cookie when it holds a well-formed one, else a fresh one."""
    nonce = request.cookies.get(cookie_name(LOGIN_COOKIE, services.config.console), "")
    return nonce if _NONCE.fullmatch(nonce) else secrets.token_urlsafe(24)


def login_page(
    request: Request[Any, Any, Any], services: Services, message: str = "", status: int = 200
) -> Response[str]:
    """The sign-in form with its CSRF token, setting (or renewing) the login cookie it is bound to."""
    console = services.config.console
    nonce = _nonce(request, services)
    response = html(views.login_page(services.secret.login_token(nonce), message), status)
    response.set_cookie(cookie(LOGIN_COOKIE, nonce, console, LOGIN_COOKIE_TTL))
    return response


def token_ok(request: Request[Any, Any, Any], services: Services, token: str) -> bool:
    """Whether the form's `token` is the CSRF token of the request's login cookie."""
    nonce = request.cookies.get(cookie_name(LOGIN_COOKIE, services.config.console), "")
    if not _NONCE.fullmatch(nonce):
        return False
    return hmac.compare_digest(token.encode(), services.secret.login_token(nonce).encode())


def client_address(request: Request[Any, Any, Any]) -> str:
    """The address an attempt is counted against: the peer's IPv4 address, or its IPv6 /64."""
    host = request.client.host if request.client is not None else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host or "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def attempt_wait(request: Request[Any, Any, Any], services: Services, key: str) -> int | None:
    """Count a sign-in attempt with `key`: None when it may go on, else the seconds until it could."""
    console = services.config.console
    rate = console.login_per_minute / 60.0
    names = [f"{_BUCKET}:addr:{client_address(request)}"]
    parsed = parse_key(key)
    if parsed is not None:
        names.append(f"{_BUCKET}:key:{parsed[0]}")
    buckets = [BucketSpec(key=name, capacity=console.login_burst, rate=rate) for name in names]
    try:
        await services.meter.store.reserve(buckets, [1.0] * len(buckets), services.clock())
    except QuotaExceededError as exc:
        return retry_after_seconds(exc.retry_after)
    except (QuotaBackendError, QuotaBusyError) as exc:
        raise PageError(503, "sign-in is unavailable; try again shortly") from exc
    return None
