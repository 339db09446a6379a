"""Quota at the HTTP edge: reserve for a planned request; denials become 429, 400 or 503 with headers.

503 `quota_unavailable`: the store is unreachable and the tenant fails closed. 503 `quota_busy`: every
connection of our own pool stayed busy past `quota.pool_timeout` (gateway overload; whatever the fail mode).
"""

from __future__ import annotations

import math

from gateway.errors import EngineUnavailableError, InvalidRequestError, RateLimitedError
from gateway.generation.planning import Plan
from policy.auth import Principal
from policy.quota.base import QuotaBusyError, QuotaExceededError, QuotaImpossibleError
from policy.quota.meter import Charge, QuotaMeter, QuotaUnavailableError, applicable, rate_limit_headers


def charge_headers(charge: Charge) -> dict[str, str]:
    """RateLimit headers after a granted reservation (none for unmetered requests)."""
    reservation = charge.reservation
    if reservation is None:
        return {}
    return rate_limit_headers(charge.names, reservation.buckets, reservation.levels)


async def reserve(meter: QuotaMeter, principal: Principal, plan: Plan) -> Charge:
    """Reserve `prompt + n x max_tokens` tokens and one request for `plan`, or raise the HTTP error."""
    req = plan.engine_request
    tokens = len(req.prompt_token_ids) + req.n * req.sampling.max_tokens
    try:
        return await meter.reserve(principal.tenant, principal.key, tokens)
    except QuotaExceededError as exc:
        spec = applicable(principal.tenant, principal.key)
        names = tuple(name for name, _, _ in spec)
        buckets = tuple(bucket for _, bucket, _ in spec)
        # A bucket that never refills (rate 0) waits forever; say a day rather than overflow.
        wait = min(exc.retry_after, 86_400.0)
        headers = {"Retry-After": str(max(1, math.ceil(wait)))}
        headers.update(rate_limit_headers(names, buckets, exc.levels))
        name = next((n for n, b, _ in spec if b.key == exc.bucket), exc.bucket)
        raise RateLimitedError(
            f"rate limit reached on `{name}`; this request fits again in {wait:.2f} s",
            code="rate_limit_exceeded",
            headers=headers,
        ) from exc
    except QuotaImpossibleError as exc:
        name = next(
            (n for n, b, _ in applicable(principal.tenant, principal.key) if b.key == exc.bucket), exc.bucket
        )
        raise InvalidRequestError(
            f"this request needs {exc.amount:g} tokens (prompt {len(req.prompt_token_ids)} + n {req.n} x "
            f"max_tokens {req.sampling.max_tokens}) but `{name}` holds at most {exc.capacity:g}: it can "
            "never fit; lower max_tokens or n, or ask for a larger quota",
            param="max_tokens",
            code="quota_exceeds_capacity",
        ) from exc
    except QuotaUnavailableError as exc:
        raise EngineUnavailableError(
            str(exc), code="quota_unavailable", headers={"Retry-After": "1"}
        ) from exc
    except QuotaBusyError as exc:
        raise EngineUnavailableError(
            "the gateway is overloaded (quota checks are queued); retry shortly",
            code="quota_busy",
            headers={"Retry-After": "1"},
        ) from exc
