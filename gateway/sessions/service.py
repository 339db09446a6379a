"""Sessions: a conversation kept by the gateway, bound to the versions it started on.

    create   model (and optional policy, system prompt, ttl, metadata) -> the versions resolved now: model,
             tokenizer, chat template, policy, system prompt (`Bound`); the tenant's oldest sessions end
             (`evicted_capacity`) past `max_sessions_per_tenant`
    step n   the history so far plus the step's messages, generated under the bound versions with replica
             affinity on the session; the reply (read back from the answer as sent) and the answer itself
             are recorded as step n

Ordering: step n must be the next one. A step already recorded, sent again with the same content, gets its
recorded answer (no engine call, no charge: `idempotent-replayed: true`); with other content 409
`step_conflict`; a gap is 409 `step_out_of_order`; the next step while it runs is 409 `step_in_progress`
(with Retry-After: the SDKs retry and then get the recorded answer), so two concurrent sends of one step make
one engine call. A step is claimed (`Pending`) by compare and set on the record, so this holds across
gateway processes sharing the store.

Ends: an ended session answers 410 with its reason (`expired`: idle or absolute expiry on the injected clock;
`evicted_capacity`; `deleted`; `model_version_retired`), never a fresh session, until its tombstone lapses
(then 404). Ending drops the history. A session whose model version is no longer served (unpublished, or no
engine for its pool) ends `model_version_retired`, unless it declared `on_retire: migrate` and its bound
policy allows it (`session_migration: allow`): then it moves to the version its model name resolves to now
(the history is re-rendered by the new version's template at the next step) and the move is recorded.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Response
from msgspec.structs import replace

from gateway.config import SessionsConfig
from gateway.errors import (
    APIError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    retry_after_headers,
)
from gateway.generation.context import Generation
from gateway.generation.resolution import Binding, policy_for, prompt_for, target
from gateway.keeping import StoredAnswer, kept, replayed
from gateway.schemas import ChatMessage
from gateway.sessions.base import (
    Bound,
    Ended,
    EndReason,
    Migration,
    OnRetire,
    Pending,
    SessionRecord,
    SessionStore,
    SessionStoreUnavailableError,
    Step,
    Versioned,
)
from gateway.sessions.history import UnreadableAnswerError, characters, messages_of, reply_of
from policy.auth import Principal
from policy.clock import Clock
from registry.view import ResolvedModel
from routing.router import session_key

SESSION_HEADER = "x-lockgate-session"
STEP_HEADER = "x-lockgate-session-step"
REPLAYED_HEADER = "idempotent-replayed"
# What became of session requests: `lockgate:session_events_total{event}`.
EVENTS = (
    "created",
    "step",
    "replayed",
    "in_progress",
    "conflict",
    "out_of_order",
    "migrated",
    "expired",
    "evicted_capacity",
    "deleted",
    "model_version_retired",
)
# Compare-and-set attempts before a contended save gives up (409 step_in_progress).
_ATTEMPTS = 8
log = logging.getLogger("lockgate.sessions")
T = TypeVar("T")
Run = Callable[[list[ChatMessage], Binding], Awaitable[Response[Any]]]


class SessionGoneError(APIError):
    """The session ended: `code` says why."""

    status_code = 410
    error_type = "invalid_request_error"


class StepConflictError(APIError):
    """The step cannot be taken now (out of order, another content, running)."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "step_conflict"


class SessionUnavailableError(APIError):
    """The session store cannot answer now."""

    status_code = 503
    error_type = "service_unavailable"


class Sessions:
    """Creates, reads, ends and steps sessions in `store` (built in the lifespan)."""

    def __init__(self, store: SessionStore, config: SessionsConfig, clock: Clock) -> None:
        self.store = store
        self._config = config
        self._clock = clock
        # Events by name (EVENTS, every one present): `lockgate:session_events_total`.
        self.counts: Counter[str] = Counter(dict.fromkeys(EVENTS, 0))

    @property
    def config(self) -> SessionsConfig:
        """The `[sessions]` settings."""
        return self._config

    def now(self) -> float:
        """The injected clock's time."""
        return self._clock()

    # ---- lifecycle ----------------------------------------------------------------------------------------

    async def create(
        self,
        gen: Generation,
        principal: Principal,
        *,
        model: str,
        policy: str | None = None,
        system_prompt: str | None = None,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        metadata: dict[str, str] | None = None,
        on_retire: OnRetire = "fail",
    ) -> SessionRecord:
        """A new session of `principal`'s tenant, bound to what `model` and its bindings resolve to now.
        `system_prompt`: one of the tenant's registry prompts (the tenant's or the key's binding, or a
        version of one), instead of the one the key would get."""
        config = self._config
        if ttl is not None and not 0 < ttl <= config.max_ttl:
            raise InvalidRequestError(f"ttl must be in (0, {config.max_ttl:g}] seconds", param="ttl")
        if idle_timeout is not None and not 0 < idle_timeout <= config.idle_timeout:
            raise InvalidRequestError(
                f"idle_timeout must be in (0, {config.idle_timeout:g}] seconds", param="idle_timeout"
            )
        resolved, _ = target(gen, model, principal)
        bound_policy = policy_for(gen, principal)
        if policy is not None and policy not in (principal.tenant.policy, bound_policy.ref):
            # A session may pin its tenant's policy, never choose another (a weaker one would be a bypass).
            raise InvalidRequestError(
                f"policy must be this tenant's policy `{principal.tenant.policy}` ({bound_policy.ref})",
                param="policy",
                code="policy_not_allowed",
            )
        try:
            prompt = prompt_for(gen, principal, _prompt_binding(principal, system_prompt))
        except EngineUnavailableError as exc:
            if system_prompt is None:
                raise
            raise NotFoundError(exc.message, param="system_prompt", code="prompt_not_found") from exc
        now = self._clock()
        record = SessionRecord(
            id="sess_" + secrets.token_urlsafe(18),
            tenant=principal.tenant.tenant_id,
            key_id=principal.key.key_id,
            model=model,
            bound=_bound(resolved, bound_policy.ref, prompt.ref if prompt else None),
            created_at=now,
            expires_at=now + (ttl or config.ttl),
            idle_timeout=idle_timeout or config.idle_timeout,
            last_used=now,
            metadata=metadata or {},
            on_retire=on_retire,
        )
        await self.make_room(record.tenant, keep=record.id, sessions=1)
        await self.save(record, None)
        self.counts["created"] += 1
        return record

    async def get(self, principal: Principal, session_id: str) -> SessionRecord:
        """The caller's live session (404 unknown or another tenant's; 410 ended)."""
        return (await self._live(principal, session_id)).record

    async def delete(self, principal: Principal, session_id: str) -> None:
        """End the caller's session (`deleted`); 410 if it had ended already."""
        found = await self._live(principal, session_id)
        await self._end(found, "deleted")

    # ---- steps --------------------------------------------------------------------------------------------

    async def step(
        self,
        gen: Generation,
        principal: Principal,
        session_id: str,
        number: int | None,
        model: str | None,
        content: msgspec.Struct,
        messages: list[ChatMessage],
        run: Run,
        state: dict[str, Any],
    ) -> Response[Any]:
        """Step `number` (None: the next) of the session with `messages`: `run(history, binding)` generates
        it unless it is answered from the record or refused (module docstring). `content`: what makes two
        sends of a step the same (the step's request, without its number). `model`: the model the request
        named (None: none), which must be the session's."""
        print_ = hashlib.sha256(msgspec.msgpack.encode(content)).hexdigest()
        for _ in range(_ATTEMPTS):
            found = await self._live(principal, session_id)
            record = found.record
            if model is not None and model not in (record.model, record.bound.model):
                raise InvalidRequestError(
                    f"this session serves `{record.model}` ({record.bound.model}), not `{model}`",
                    param="model",
                    code="session_model_mismatch",
                )
            now = self._clock()
            next_step = len(record.steps) + 1
            n = next_step if number is None else number
            if n < 1:
                raise InvalidRequestError("step must be >= 1", param="step")
            if n < next_step:
                done = record.steps[n - 1]
                if done.fingerprint != print_:
                    raise self._conflict(n, "step_conflict", "was recorded with other content")
                self.counts["replayed"] += 1
                return replayed(done.answer, REPLAYED_HEADER)
            if n > next_step:
                raise self._conflict(n, "step_out_of_order", f"is not the next step ({next_step})")
            if record.pending is not None and record.pending.until > now:
                if record.pending.fingerprint != print_:
                    raise self._conflict(n, "step_conflict", "is running with other content")
                self.counts["in_progress"] += 1
                raise StepConflictError(
                    f"step {n} of this session is still running; retry to get its answer",
                    param="step",
                    code="step_in_progress",
                    headers=retry_after_headers(1),
                )
            record = await self._served(gen, principal, found)
            token = secrets.token_hex(16)
            claim = Pending(step=n, fingerprint=print_, token=token, until=now + self._config.pending_timeout)
            if await self.save(replace(record, pending=claim), found.version):
                break
        else:
            raise StepConflictError(
                "this session is busy; retry",
                param="step",
                code="step_in_progress",
                headers=retry_after_headers(1),
            )
        history = [*messages_of(record), *messages]
        binding = Binding(
            session=session_key(record.id, None, tenant=record.tenant) or record.id,
            model=record.bound.model,
            policy=record.bound.policy,
            prompt=record.bound.prompt,
        )
        try:
            response = await run(history, binding)
        except BaseException:
            await self._settle(record.id, token, None)
            raise
        response.headers[SESSION_HEADER] = record.id
        response.headers[STEP_HEADER] = str(n)

        async def settle(answer: StoredAnswer | None) -> None:
            done = None
            if answer is not None:
                try:
                    reply, usage = reply_of(answer, characters(history))
                except UnreadableAnswerError as exc:  # never: this gateway wrote it
                    log.error("session %s step %d: answer not recorded: %s", record.id, n, exc)
                else:
                    done = Step(
                        step=n,
                        fingerprint=print_,
                        messages=messages,
                        reply=reply,
                        usage=usage,
                        answer=answer,
                        at=self._clock(),
                    )
            await self._settle(record.id, token, done)

        return await kept(response, settle, state, self._config.max_answer_bytes)

    async def _settle(self, session_id: str, token: str, done: Step | None) -> None:
        """Record `done` as the claimed step (None: give the claim up), if `token` still holds it."""
        try:
            for _ in range(_ATTEMPTS):
                found = await self.store.load(session_id)
                if found is None or found.record.pending is None or found.record.pending.token != token:
                    return  # ended, or the claim lapsed and was taken: the other holder decides
                record = replace(found.record, pending=None)
                if done is not None:
                    record = replace(
                        record,
                        steps=[*record.steps, done],
                        last_used=done.at,
                        history_tokens=done.usage.prompt_tokens + done.usage.completion_tokens,
                    )
                if await self.save(record, found.version):
                    if done is not None:
                        self.counts["step"] += 1
                        await self.make_room(record.tenant, keep=record.id, sessions=0)
                    return
        except (SessionUnavailableError, SessionStoreUnavailableError) as exc:
            # The answer is sent; the claim lapses after pending_timeout and the step may then be sent again.
            log.warning("session %s: step not recorded, the store is unavailable: %s", session_id, exc)

    # ---- reading, ending, capacity ------------------------------------------------------------------------

    async def _live(self, principal: Principal, session_id: str) -> Versioned:
        """The caller's session, ended first if it has lapsed (410 then; 404 unknown or another tenant's)."""
        found = await self.call(self.store.load(session_id))
        if found is None or found.record.tenant != principal.tenant.tenant_id:
            raise NotFoundError(
                f"session `{session_id}` does not exist", param="session_id", code="session_not_found"
            )
        if self.lapsed(found.record):
            found = await self._end(found, "expired")
        if found.record.ended is not None:
            raise _gone(found.record.ended)
        return found

    def lapsed(self, record: SessionRecord) -> bool:
        """Whether `record` is past its absolute or idle expiry and not yet ended."""
        now = self._clock()
        return record.ended is None and (
            now >= record.expires_at or now >= record.last_used + record.idle_timeout
        )

    async def _end(self, found: Versioned, reason: EndReason) -> Versioned:
        """`found` ended for `reason` (its history dropped), or what the store holds if another save came
        first."""
        ended = replace(
            found.record,
            ended=Ended(reason=reason, at=self._clock()),
            steps=[],
            pending=None,
            history_tokens=0,
        )
        if await self.save(ended, found.version):
            self.counts[reason] += 1
            return Versioned(ended, found.version + 1)
        again = await self.call(self.store.load(found.record.id))
        return again if again is not None else Versioned(ended, found.version + 1)

    async def _served(self, gen: Generation, principal: Principal, found: Versioned) -> SessionRecord:
        """The record, moved to a served model version if its own is retired and it may migrate; else 410."""
        record = found.record
        if _serves(gen, principal, record.bound.model):
            return record
        if record.on_retire == "migrate" and _allows_migration(gen, principal, record.bound.policy):
            try:
                resolved, _ = target(gen, record.model, principal)
            except APIError:
                resolved = None
            if resolved is not None and resolved.ref != record.bound.model:
                after = _bound(resolved, record.bound.policy, record.bound.prompt)
                move = Migration(
                    before=record.bound, after=after, at=self._clock(), at_step=len(record.steps) + 1
                )
                self.counts["migrated"] += 1
                return replace(record, bound=after, migrations=[*record.migrations, move])
        ended = await self._end(found, "model_version_retired")
        raise _gone(ended.record.ended or Ended(reason="model_version_retired", at=self._clock()))

    async def make_room(self, tenant: str, *, keep: str, sessions: int) -> None:
        """End the tenant's least recently used sessions (never `keep`) until `sessions` more fit and its
        history tokens are within the limit."""
        config = self._config
        members = await self.call(self.store.index(tenant))
        count = len(members) + sessions - (1 if keep in members and sessions else 0)
        tokens = sum(e.history_tokens for e in members.values())
        for session_id, entry in sorted(members.items(), key=lambda m: m[1].last_used):
            if count <= config.max_sessions_per_tenant and tokens <= config.max_history_tokens_per_tenant:
                return
            if session_id == keep:
                continue
            found = await self.call(self.store.load(session_id))
            if found is not None and found.record.ended is None:
                await self._end(found, "evicted_capacity")
            count -= 1
            tokens -= entry.history_tokens

    async def save(self, record: SessionRecord, version: int | None) -> bool:
        """Save `record` over `version` (None: a new one), kept while it may be used and its tombstone
        after."""
        if record.ended is not None:
            keep = self._config.tombstone
        else:
            keep = max(record.expires_at, record.last_used + record.idle_timeout) - self._clock()
            keep = max(keep, 1.0) + self._config.tombstone
        return await self.call(self.store.save(record, version, keep))

    async def call(self, step: Awaitable[T]) -> T:
        """`step`, a store operation; the store unavailable is 503 `session_store_unavailable`."""
        try:
            return await step
        except SessionStoreUnavailableError as exc:
            raise SessionUnavailableError(
                f"{exc}; retry later", code="session_store_unavailable", headers=retry_after_headers(1)
            ) from exc

    def _conflict(self, n: int, code: str, why: str) -> StepConflictError:
        self.counts["conflict" if code == "step_conflict" else "out_of_order"] += 1
        headers = {"x-should-retry": "false"}
        return StepConflictError(f"step {n} of this session {why}", param="step", code=code, headers=headers)


def _bound(model: ResolvedModel, policy: str, prompt: str | None) -> Bound:
    return Bound(
        model=model.ref,
        tokenizer=model.tokenizer.ref,
        chat_template=model.chat_template.ref,
        policy=policy,
        prompt=prompt,
    )


def _prompt_binding(principal: Principal, system_prompt: str | None) -> Binding | None:
    """The prompt a session asked for, as a binding (None: the key's or tenant's own); 400 unless it is one
    of the tenant's prompts: the instructions the guard trusts are the operator's to set, never a client's."""
    if system_prompt is None:
        return None
    own = {b.partition("@")[0] for b in (principal.key.system_prompt, principal.tenant.system_prompt) if b}
    if system_prompt.partition("@")[0] not in own:
        raise InvalidRequestError(
            f"system_prompt must be one of this tenant's prompts ({', '.join(sorted(own)) or 'none'})",
            param="system_prompt",
            code="prompt_not_allowed",
        )
    return Binding(session="", model="", policy="", prompt=system_prompt)


def _serves(gen: Generation, principal: Principal, model_ref: str) -> bool:
    """Whether `model_ref` is still published and has an engine for its pool."""
    try:
        target(gen, model_ref, principal)
    except (NotFoundError, InvalidRequestError, EngineUnavailableError):
        return False
    return True


def _allows_migration(gen: Generation, principal: Principal, policy_ref: str) -> bool:
    binding = Binding(session="", model="", policy=policy_ref, prompt=None)
    try:
        return policy_for(gen, principal, binding).spec.allows_session_migration
    except EngineUnavailableError:
        return False


def _gone(ended: Ended) -> SessionGoneError:
    return SessionGoneError(
        f"this session has ended ({ended.reason}); start a new session", param="session_id", code=ended.reason
    )
