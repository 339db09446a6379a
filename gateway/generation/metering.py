"""Quota at the HTTP edge: reserve for a planned request, or for a number of tokens (moderations); denials
become 429, 400 or 503 with headers.

503 `quota_unavailable`: the store is unreachable and the tenant fails closed. 503 `quota_busy`: every
connection of our own pool stayed busy past `quota.pool_timeout` (gateway overload; whatever the fail mode).
"""

from __future__ import annotations

import logging

from gateway.errors import (
    APIError,
    EngineUnavailableError,
    InvalidRequestError,
    RateLimitedError,
    retry_after_headers,
)
from gateway.generation.audit import record_refusal
from gateway.generation.context import Generation
from gateway.generation.planning import Plan
from gateway.observe.timeline import RequestTimeline
from policy.auth import Principal
from policy.quota.base import QuotaBackendError, QuotaBusyError, QuotaExceededError, QuotaImpossibleError
from policy.quota.meter import BucketSet, Charge, QuotaMeter, QuotaUnavailableError, rate_limit_headers

log = logging.getLogger("lockgate.quota")


def charge_headers(charge: Charge) -> dict[str, str]:
    """RateLimit headers after a granted reservation (none for unmetered requests)."""
    reservation = charge.reservation
    if reservation is None:
        return {}
    return rate_limit_headers(charge.bucket_set, reservation.levels)


async def reserve(gen: Generation, principal: Principal, plan: Plan, timeline: RequestTimeline) -> Charge:
    """Reserve `prompt + n x max_tokens` tokens and one request for `plan`, or raise the HTTP error (a
    denial is tallied in the audit trail)."""
    req = plan.engine_request
    start = timeline.now()
    try:
        return await reserve_tokens(
            gen.meter,
            principal,
            len(req.prompt_token_ids) + req.n * req.sampling.max_tokens,
            need=f"prompt {len(req.prompt_token_ids)} + n {req.n} x max_tokens {req.sampling.max_tokens}",
            param="max_tokens",
            advice="lower max_tokens or n, or ask for a larger quota",
        )
    except APIError as exc:
        record_refusal(gen, principal, plan.request_id, "quota", exc)
        raise
    finally:
        timeline.phase("quota", start)


async def tokens_left(gen: Generation, principal: Principal) -> float | None:
    """The caller's tokens left in its token quota (None: none applies, or the store cannot be read now,
    which is logged: a route's budget rule then does not hold)."""
    try:
        return await gen.meter.tokens_left(principal.tenant, principal.key)
    except (QuotaBackendError, QuotaBusyError) as exc:
        log.warning("tokens left of tenant %s unknown: %s", principal.tenant.tenant_id, exc)
        return None


async def reserve_tokens(
    meter: QuotaMeter, principal: Principal, tokens: int, *, need: str, param: str, advice: str
) -> Charge:
    """Reserve `tokens` tokens and one request, or raise the HTTP error. A request that can never fit is a 400
    naming `param`, saying what it needs (`need`) and what to do (`advice`)."""
    try:
        return await meter.reserve(principal.tenant, principal.key, tokens)
    except QuotaExceededError as exc:
        spec = meter.buckets_for(principal.tenant, principal.key)
        # A bucket that never refills (rate 0) waits forever; say a day rather than overflow.
        wait = min(exc.retry_after, 86_400.0)
        headers = retry_after_headers(wait, exact=True)
        headers.update(rate_limit_headers(spec, exc.levels))
        name = _bucket_name(spec, exc.bucket)
        raise RateLimitedError(
            f"rate limit reached on `{name}`; this request fits again in {wait:.2f} s",
            code="rate_limit_exceeded",
            headers=headers,
        ) from exc
    except QuotaImpossibleError as exc:
        name = _bucket_name(meter.buckets_for(principal.tenant, principal.key), exc.bucket)
        raise InvalidRequestError(
            f"this request needs {exc.amount:g} tokens ({need}) but `{name}` holds at most "
            f"{exc.capacity:g}: it can never fit; {advice}",
            param=param,
            code="quota_exceeds_capacity",
        ) from exc
    except QuotaUnavailableError as exc:
        raise EngineUnavailableError(
            str(exc), code="quota_unavailable", headers=retry_after_headers(1)
        ) from exc
    except QuotaBusyError as exc:
        raise EngineUnavailableError(
            "the gateway is overloaded (quota checks are queued); retry shortly",
            code="quota_busy",
            headers=retry_after_headers(1),
        ) from exc


def _bucket_name(spec: BucketSet, key: str) -> str:
    """The header name of the bucket stored under `key` (the key itself if it is not one of `spec`'s)."""
    return next((n for n, b in zip(spec.names, spec.buckets, strict=True) if b.key == key), key)
