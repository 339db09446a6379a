"""Which requests the result cache may answer, and the key that holds everything deciding their answer.

Only deterministic requests: one choice (`n` 1) sampled at temperature 0, or with a `seed` (a declared sample
identity: the same seed gives the same sample). A request that asks for a fresh sample (any other) is never
looked up or kept; `Cache-Control: no-cache` generates afresh (and keeps the new answer), `no-store` neither
looks up nor keeps.

The key is the sha256 of one msgpack array of: the key layout's version, the tenant (one tenant never reads
another's entry, so a hit's timing tells nothing of other tenants), the route, the model version with its
weights hash, the tokenizer and chat template versions, the safety policy version, the engine build (engine
kind, vLLM version, dtype: they change the numbers), the rendered prompt's token ids (the messages, the
system prompt, the tools and their format all render into them), and every sampling field (response format
and tool-call constraints included). `tests/gateway/test_result_cache.py` checks that requests differing in
any one of them never share a key.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from engines.base import EngineRequest

KEY_LAYOUT = 1
Lookup = Literal["use", "refresh", "skip"]  # look up and keep; keep only; neither


class KeyParts(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What decides an answer (see the module docstring), in the key's order."""

    layout: int
    tenant: str
    route: str
    model: str
    weights_sha256: str
    tokenizer: str
    chat_template: str
    policy: str
    engine_build: str
    request: EngineRequest


_ENCODER = msgspec.msgpack.Encoder()


def deterministic(req: EngineRequest) -> bool:
    """Whether `req` names its sample: one choice, at temperature 0 or with a seed."""
    return req.n == 1 and (req.sampling.temperature == 0 or req.sampling.seed is not None)


def lookup_of(cache_control: str | None) -> Lookup:
    """What the request's `Cache-Control` asks of the cache."""
    directives = {d.strip().lower() for d in (cache_control or "").split(",")}
    if "no-store" in directives:
        return "skip"
    return "refresh" if "no-cache" in directives else "use"


def result_key(
    *,
    tenant: str,
    route: str,
    model: str,
    weights_sha256: str,
    tokenizer: str,
    chat_template: str,
    policy: str,
    engine_build: str,
    req: EngineRequest,
) -> str:
    """The key of `req`'s answer (a hex digest). Fields that do not change the answer (its ids, priority,
    deadline, cache salt, trace context) are left out."""
    kept = msgspec.structs.replace(
        req, request_id="", priority=0, cache_salt=None, deadline=None, traceparent=""
    )
    parts = KeyParts(
        layout=KEY_LAYOUT,
        tenant=tenant,
        route=route,
        model=model,
        weights_sha256=weights_sha256,
        tokenizer=tokenizer,
        chat_template=chat_template,
        policy=policy,
        engine_build=engine_build,
        request=kept,
    )
    return hashlib.sha256(_ENCODER.encode(parts)).hexdigest()
