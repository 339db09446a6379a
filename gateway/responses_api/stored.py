"""Stored responses (`store`, `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`), kept in the
session store (`gateway.sessions`): one record per response, named by its id, holding the whole
conversation up to it (each earlier turn's input and reply, as a session's steps), the versions it ran on
(`Bound`: a continuation runs on them, as a session's next step does, with replica affinity on the
conversation), the request (to answer `GET` as it was answered) and its chat answer as sent.

A response is kept for its policy's `stored_response_ttl` (unset: `[sessions] ttl`; 0: it is not stored)
and forgotten `tombstone` later, and counts toward the tenant's
session limits (`max_sessions_per_tenant`, `max_history_tokens_per_tenant`: the least recently used make
room, as sessions do); a deleted one, or another tenant's,
is 404 (OpenAI's answer for a response that is not there). Continuing from any stored response forks the
conversation there. A response that was not answered in full (an error, a stream its client left) is not
stored.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec

from gateway.errors import NotFoundError
from gateway.generation.context import Generation
from gateway.generation.resolution import Binding, policy_for, prompt_for, route_for, target
from gateway.keeping import StoredAnswer
from gateway.responses_api.schemas import InputContent, InputItem, ResponseCreateRequest
from gateway.schemas import ChatMessage
from gateway.sessions.base import Bound, Ended, SessionRecord, Step, Versioned
from gateway.sessions.history import UnreadableAnswerError, characters, messages_of, reply_of
from gateway.sessions.service import Sessions, SessionUnavailableError
from policy.auth import Principal
from routing.router import session_key

log = logging.getLogger("lockgate.responses")
_REQUEST = msgspec.json.Decoder(ResponseCreateRequest)
# Metadata keys of a stored response's record.
ROOT, REQUEST = "root", "request"


def new_id() -> str:
    """A response id (random: never derived from anything a client chose)."""
    return "resp_" + secrets.token_hex(12)


class StoredResponses:
    """Responses kept in `sessions`' store, under its lifetimes."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def load(self, principal: Principal, response_id: str, param: str) -> SessionRecord:
        """The caller's stored response (404 naming `param`: unknown, forgotten, deleted, another
        tenant's)."""
        return (await self._found(principal, response_id, param)).record

    async def _found(self, principal: Principal, response_id: str, param: str) -> Versioned:
        sessions = self._sessions
        found = await sessions.call(sessions.store.load(response_id))
        if (
            found is None
            or found.record.tenant != principal.tenant.tenant_id
            or found.record.ended is not None
            or sessions.lapsed(found.record)
        ):
            raise NotFoundError(f"no stored response `{response_id}`", param=param, code="response_not_found")
        return found

    async def delete(self, principal: Principal, response_id: str) -> None:
        """Forget the caller's stored response (404 if there is none)."""
        found = await self._found(principal, response_id, "response_id")
        ended = msgspec.structs.replace(
            found.record, ended=Ended(reason="deleted", at=self._sessions.now()), steps=[]
        )
        await self._sessions.save(ended, found.version)

    def bound(self, gen: Generation, principal: Principal, req: ResponseCreateRequest) -> Bound:
        """The versions a new conversation runs on: what the request's model, the tenant's policy and the
        key's prompt resolve to now. A route binds its version (each turn's model is chosen by its rules,
        so the conversation names no one tokenizer or template)."""
        prompt = prompt_for(gen, principal)
        policy = policy_for(gen, principal).ref
        if gen.registry.view.is_route(req.model):
            route = route_for(gen, req.model, principal)
            return Bound(
                model=route.ref,
                tokenizer="",
                chat_template="",
                policy=policy,
                prompt=prompt.ref if prompt else None,
            )
        model, _ = target(gen, req.model, principal)
        return Bound(
            model=model.ref,
            tokenizer=model.tokenizer.ref,
            chat_template=model.chat_template.ref,
            policy=policy,
            prompt=prompt.ref if prompt else None,
        )

    @staticmethod
    def binding(bound: Bound, tenant: str, root: str) -> Binding:
        """How a response of the conversation `root` runs: on `bound`, routed by the conversation."""
        return Binding(
            session=session_key(root, None, tenant=tenant) or root,
            model=bound.model,
            policy=bound.policy,
            prompt=bound.prompt,
        )

    async def keep(
        self,
        principal: Principal,
        response_id: str,
        req: ResponseCreateRequest,
        bound: Bound,
        previous: SessionRecord | None,
        messages: list[ChatMessage],
        answer: StoredAnswer,
        ttl: float,
    ) -> None:
        """Store response `response_id` for `ttl` seconds: `previous`'s turns, then this one (`messages` and
        the reply of `answer`). Logged, not raised, when it cannot be: the answer has been sent."""
        history = messages_of(previous) if previous else []
        try:
            reply, usage = reply_of(answer, characters([*history, *messages]))
        except UnreadableAnswerError as exc:
            log.error("response %s not stored: %s", response_id, exc)
            return
        now = self._sessions.now()
        steps = previous.steps if previous else []
        turn = Step(
            step=len(steps) + 1,
            fingerprint="",
            messages=messages,
            reply=reply,
            usage=usage,
            answer=answer,
            at=now,
        )
        root = previous.metadata.get(ROOT, previous.id) if previous else response_id
        record = SessionRecord(
            id=response_id,
            tenant=principal.tenant.tenant_id,
            key_id=principal.key.key_id,
            model=req.model,
            bound=bound,
            created_at=now,
            expires_at=now + ttl,
            idle_timeout=ttl,
            last_used=now,
            metadata={ROOT: root, REQUEST: msgspec.json.encode(req).decode()},
            steps=[*steps, turn],
            history_tokens=usage.prompt_tokens + usage.completion_tokens,
        )
        try:
            # Stored conversations share the tenant's session limits (and make room the same way).
            await self._sessions.make_room(record.tenant, keep=record.id, sessions=1)
            await self._sessions.save(record, None)
        except SessionUnavailableError as exc:
            log.warning("response %s not stored: %s", response_id, exc)


def request_of(record: SessionRecord) -> ResponseCreateRequest:
    """The request a stored response answered."""
    return _REQUEST.decode(record.metadata[REQUEST])


def input_items(record: SessionRecord) -> list[dict[str, Any]]:
    """The input items of a stored response, as the Responses API lists them: each with an id and a status,
    messages with typed text parts (a string input is one user message)."""
    req = request_of(record)
    sent = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    items: list[dict[str, Any]] = []
    for i, item in enumerate(sent):
        kind = item.type or "message"
        entry: dict[str, Any] = {
            "id": item.id or f"item_{record.id[5:]}_{i}",
            "type": kind,
            "status": "completed",
        }
        if kind == "message":
            content = item.content
            parts = (
                [InputContent(type="input_text", text=content)] if isinstance(content, str) else content or []
            )
            entry |= {"role": item.role, "content": [_dropped_nulls(p) for p in parts]}
        else:
            entry |= {k: v for k, v in _dropped_nulls(item).items() if k not in ("id", "type", "status")}
        items.append(entry)
    return items


def _dropped_nulls(struct: msgspec.Struct) -> dict[str, Any]:
    return {k: v for k, v in msgspec.to_builtins(struct).items() if v is not None}
