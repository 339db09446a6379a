"""The result cache's part in one request: whether it may answer it, under which key, and how
(`gateway.result_cache` holds the rules and the store)."""

from __future__ import annotations

from typing import Literal

import msgspec

from engines.base import EngineRequest
from gateway.generation.context import Generation
from gateway.generation.planning import Plan
from gateway.inbound import HeaderLookup
from gateway.result_cache.cache import ResultCache
from gateway.result_cache.keys import deterministic, lookup_of, result_key

# On a request the cache may answer: whether the answer came from it (`hit`) or was generated (`miss`).
CACHE_HEADER = "x-lockgate-cache"


class CacheUse(msgspec.Struct, frozen=True, kw_only=True):
    """The cache a request may use, its key, and whether to look it up (`use`) or only keep the answer
    (`refresh`: `Cache-Control: no-cache`)."""

    cache: ResultCache
    key: str
    lookup: Literal["use", "refresh"]


def cache_use(
    gen: Generation, plan: Plan, req: EngineRequest, policy: str, tenant: str, headers: HeaderLookup
) -> CacheUse | None:
    """How `req` (the engine request of `plan`, under policy version `policy`) uses the result cache; None
    when it is off, the request asks for a fresh sample, or `Cache-Control: no-store`."""
    cache = gen.result_cache
    if cache is None or not deterministic(req):
        return None
    lookup = lookup_of(headers.get("cache-control"))
    if lookup == "skip":
        return None
    key = result_key(
        tenant=tenant,
        route=plan.kind,
        model=plan.model.ref,
        weights_sha256=plan.model.spec.weights_sha256,
        tokenizer=plan.model.tokenizer.ref,
        chat_template=plan.model.chat_template.ref,
        policy=policy,
        engine_build=cache.engine_build,
        req=req,
    )
    return CacheUse(cache=cache, key=key, lookup=lookup)
