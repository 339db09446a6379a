"""A simulated engine with a continuous-batching timing model, for load and fault tests.

It is a simulator, never the default engine: it has no model and no tokenizer. Its tokens are drawn
deterministically and its text comes from a tiny vocabulary of its own. What it does model faithfully is
the shape of a real engine under load: one scheduler steps a batch, step time grows with batch size and
newly admitted prompts, KV capacity holds requests back, and closing a stream frees its slot at once.

Its output has the shape a request asks for, so load and fault tests take the same paths as with a real
engine: under a `json_schema` constraint the text is an instance of the schema (`engines.schema_example`),
under `json_object` a small JSON object, streamed a few characters per token and finished with "stop" once
complete; `logit_bias` bans (<= -100) and forces (>= 100) token ids; `min_tokens` holds back every end.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import json
import math
import random
import time
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

import msgspec

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineLoad,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestError,
    FinishReason,
    Health,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engines.schema_example import SchemaError, example_instance

_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "it", "for", "as", "with", "was", "on", "be", "at", "by",
    "this", "from", "or", "an", "are", "not", "but", "we", "all", "can", "one", "has", "more", "will", "if",
    "so", "out", "up", "time", "new", "some", "them", "other", "like", "then", "now", "only", "into", "over",
    "also", "back", "after", "use", "two", "how", "our", "work", "first", "well", "way", "even", "want",
)  # fmt: skip


class SimulatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Timing, capacity and fault-injection knobs of a `SimulatedEngine`."""

    prefill_s_per_token: float = 0.0002  # prefill cost per prompt token of a newly admitted request
    decode_step_s: float = 0.01  # time of one decode step with a batch of 1
    decode_step_s_per_seq: float = 0.001  # extra step time per running sequence: big batches step slower
    kv_capacity_tokens: int = 65536  # KV capacity; a running request reserves prompt + max_tokens
    max_batch: int = 64  # most sequences decoded in one step
    max_waiting: int = 1024  # beyond this many queued requests `generate` raises EngineOverloadedError
    vocab_size: int = 32000  # token ids are drawn from range(vocab_size)
    fail_after_tokens: int | None = None  # fault injection: every request fails after this many tokens
    max_model_len: int = 2048  # longest prompt + max_tokens a request may ask for
    # Tokens per block of a simulated prefix cache (vLLM's automatic prefix caching); 0 = no prefix cache. A
    # request's leading prompt blocks that an earlier request of the same `cache_salt` filled are not
    # prefilled again and are reported as `cached_tokens`. The cache holds at most kv_capacity_tokens.
    prefix_cache_block: int = 0
    # Declared answer quality (the routes benchmark, `ops.bench.routes`): a prompt's difficulty is a hash of
    # its last `_QUESTION_TOKENS` tokens (the question and the generation prompt, the same under any chat
    # template of one tokenizer) in [0, 1); an answer is right where it is under `skill`, and its first word
    # says so ("right" or "wrong"); its tokens' log-probabilities are `confident_logprob` (right) or
    # `unsure_logprob` (wrong), each moved by up to `logprob_noise` either way. None: off.
    skill: float | None = None
    confident_logprob: float = -0.3
    unsure_logprob: float = -1.5
    logprob_noise: float = 0.6


_QUESTION_TOKENS = 32


def difficulty(prompt_token_ids: Sequence[int]) -> float:
    """The declared difficulty of a prompt, in [0, 1) (`SimulatorConfig.skill`)."""
    tail = prompt_token_ids[-_QUESTION_TOKENS:]
    return zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tail)) / 2**32


_Item = EngineDelta | EngineRequestError | EngineDeadError


class _Outbox:
    """One request's deltas from the scheduler to its stream, in order, waking the stream's reader.

    A deque and one future per wait: `asyncio.Queue` costs several times as much per item (its getters and
    putters queues, its unfinished-task count and `Event`), paid once per simulated token."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[_Item] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: _Item) -> None:
        self.items.append(item)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # a reader cancelled while waiting left it cancelled
            waiter.set_result(None)

    async def get(self) -> _Item:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


class _Seq:
    """Scheduler-side state of one request."""

    __slots__ = (
        "banned",
        "cached",
        "emitted",
        "forced",
        "json",
        "json_pos",
        "order",
        "out",
        "req",
        "reserved",
        "right",
        "rng",
        "stop_hold",
        "stops",
        "text",
        "token_ids",
    )

    def __init__(self, req: EngineRequest, order: int, rng: random.Random) -> None:
        self.req = req
        self.order = order  # FIFO tie-break among equal priorities
        self.rng = rng
        self.out = _Outbox()
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # chars of `text` already sent; the rest may still turn out to be a stop string
        self.reserved = 0  # KV tokens held while running
        self.cached = 0  # leading prompt tokens found in the prefix cache
        bias = req.sampling.logit_bias
        self.banned = frozenset(t for t, b in bias if b <= -100)
        self.forced = sorted({t for t, b in bias if b >= 100} - self.banned)
        self.stops = tuple(s for s in req.sampling.stop if s)
        # Chars at the end of the text held back while they might still grow into a stop string.
        self.stop_hold = max(map(len, self.stops), default=1) - 1
        # Under a constraint: the whole JSON text to stream, and how many of its chars are out already.
        self.json: str | None = None
        self.json_pos = 0
        # Under a declared skill: whether this answer is right (None: no skill declared).
        self.right: bool | None = None

    def key(self) -> tuple[int, int]:
        """Admission order: lower priority value first, then arrival."""
        return (self.req.priority, self.order)


_PIECES = tuple(" " + word for word in _WORDS)


def _token_text(token_id: int) -> str:
    return _PIECES[token_id % len(_PIECES)]


# What a `json_object` constraint gets: a small object, varied like any other output.
_JSON_OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"result": {"type": "string", "maxLength": 16}, "score": {"type": "integer"}},
    "required": ["result"],
}
_MAX_JSON_PIECE = 4  # chars of JSON text per simulated token


def _constrained_text(req: EngineRequest, rng: random.Random) -> str | None:
    """The JSON the request's constraint makes it emit (compact, as vLLM's structured outputs without free
    whitespace), or None without a constraint."""
    constraint = req.sampling.constraint
    if constraint is None:
        return None
    schema: Any = _JSON_OBJECT_SCHEMA
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.schema)
        except json.JSONDecodeError as exc:
            raise EngineRequestError(f"the json_schema constraint is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise EngineRequestError("the json_schema constraint must be a JSON object")
    try:
        instance = example_instance(schema, rng)
    except SchemaError as exc:
        raise EngineRequestError(f"unsupported json_schema constraint: {exc}") from exc
    return json.dumps(instance, separators=(",", ":"), ensure_ascii=False)


def _usage(seq: _Seq) -> Usage:
    return Usage(
        prompt_tokens=len(seq.req.prompt_token_ids),
        completion_tokens=len(seq.token_ids),
        cached_tokens=seq.cached,
    )


_FAVOURITES = 16  # ids per prompt that score_next_token gives most of the first token's mass


def _logprob(rank: int, jitter_from: int) -> float:
    # Halving probabilities per rank keeps every value < 0 and the sum of exp() below 1.
    return -(rank + 1) * math.log(2.0) - (jitter_from % 10) / 100.0


class SimulatedEngine:
    """An `Engine` that simulates continuous batching with an injectable clock, for tests only."""

    def __init__(
        self,
        config: SimulatorConfig,
        *,
        replica_id: str = "sim-0",
        model_name: str = "simulated",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Create a stopped engine; call `start()` before expecting any output."""
        self.replica_id = replica_id
        self.model_name = model_name
        self.max_model_len = config.max_model_len
        self._cfg = config
        self._clock = clock
        self._sleep = sleep
        self._waiting: list[_Seq] = []  # kept sorted by _Seq.key
        self._running: list[_Seq] = []
        self._kv_used = 0
        # Block hashes of the simulated prefix cache, least recently used first.
        self._prefix_blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._order = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failure = ""
        self._steps = 0

    async def start(self) -> None:
        """Start the scheduler task. Idempotent."""
        if self._closed:
            raise EngineDeadError(f"{self.replica_id} is shut down")
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"simulated-scheduler-{self.replica_id}")

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Stream one delta per scheduler step; closing the stream drops the request and frees its KV.

        Refusals (too long, overloaded, shut down) raise on the first `anext()`. Requests queued before
        `start()` wait for it.
        """
        self._check_alive()
        cfg = self._cfg
        prompt_len = len(req.prompt_token_ids)
        need = prompt_len + req.sampling.max_tokens
        if req.sampling.max_tokens < 1 or need > cfg.max_model_len:
            raise EngineRequestError(
                f"prompt {prompt_len} + max_tokens {req.sampling.max_tokens} > {self.max_model_len} tokens"
            )
        if need > cfg.kv_capacity_tokens:  # would wait forever, so refuse now
            raise EngineRequestError(f"request needs {need} KV tokens, capacity is {cfg.kv_capacity_tokens}")
        if req.n != 1:
            raise EngineRequestError("an engine generates one choice per request (see engines.choices)")
        bad = [t for t, _ in req.sampling.logit_bias if not 0 <= t < cfg.vocab_size]
        if bad:
            raise EngineRequestError(f"logit_bias token ids must be in range({cfg.vocab_size}), got {bad}")
        if len(self._waiting) >= cfg.max_waiting:
            raise EngineOverloadedError(f"{len(self._waiting)} requests already waiting")
        seq = _Seq(req, next(self._order), random.Random(self._seed_key(req)))
        if self._cfg.skill is not None:
            seq.right = difficulty(req.prompt_token_ids) < self._cfg.skill
        if len(seq.banned) >= cfg.vocab_size:
            raise EngineRequestError("logit_bias bans every token id")
        seq.json = _constrained_text(req, seq.rng)
        bisect.insort(self._waiting, seq, key=_Seq.key)
        self._wake.set()
        try:
            while True:
                item = await seq.out.get()
                if not isinstance(item, EngineDelta):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._discard(seq)

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """Fake first-token log-probabilities of exactly `token_ids`, after a simulated prefill.

        Each id's value depends only on the prompt and the id (never on which other ids are asked about), and
        the values over the whole vocabulary sum to at most 1: a few favourite ids per prompt take halving
        shares, every other id an equal sliver. The call bypasses the scheduler queue, as if it always had
        the best priority; `priority` and `cache_salt` (there is no prefix cache) are accepted for the
        protocol's sake.
        """
        self._check_alive()
        vocab = self._cfg.vocab_size
        if not token_ids or any(not 0 <= t < vocab for t in token_ids):
            raise EngineRequestError(f"token ids to score must be in range({vocab}), got {list(token_ids)}")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise EngineRequestError(f"prompt of {len(prompt_token_ids)} tokens leaves no room for one more")
        await self._sleep(self._cfg.prefill_s_per_token * len(prompt_token_ids) + self._cfg.decode_step_s)
        favourites = random.Random(f"score:{list(prompt_token_ids)}").sample(
            range(vocab), min(_FAVOURITES, vocab)
        )
        rank = {tid: r for r, tid in enumerate(favourites)}
        # The favourites hold 1 - 2**-_FAVOURITES of the mass; the rest is shared by all other ids.
        rest = -_FAVOURITES * math.log(2.0) - math.log(max(1, vocab - len(favourites)))
        return {
            t: _logprob(rank[t], prompt_token_ids[-1] if prompt_token_ids else 0) if t in rank else rest
            for t in dict.fromkeys(token_ids)
        }

    async def load(self) -> EngineLoad:
        """The scheduler's live counts; KV used is what running requests have reserved."""
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens_used=self._kv_used,
            kv_tokens_capacity=self._cfg.kv_capacity_tokens,
            steps=self._steps,
            max_running=self._cfg.max_batch,
        )

    async def health(self) -> Health:
        """Ready between `start()` and `shutdown()` while the scheduler is alive."""
        if self._closed:
            return Health(ready=False, detail=self._failure or "shut down")
        if self._task is None:
            return Health(ready=False, detail="not started")
        return Health(ready=True)

    async def shutdown(self) -> None:
        """Abort every request in flight (finish_reason "abort") and stop the scheduler. Idempotent."""
        self._closed = True
        self._abort_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(self._failure or f"{self.replica_id} is shut down")

    def _seed_key(self, req: EngineRequest) -> str:
        # Greedy output depends only on the prompt, a seed reproduces a sample, else every request differs.
        if req.sampling.temperature == 0.0:
            return f"greedy:{req.prompt_token_ids}"
        if req.sampling.seed is not None:
            return f"seed:{req.sampling.seed}:{req.prompt_token_ids}"
        return f"id:{req.request_id}"

    async def _run(self) -> None:
        try:
            while True:
                if self._waiting:
                    self._drop_expired()
                prefill_tokens = self._admit()
                if not self._running:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                cfg = self._cfg
                step = cfg.decode_step_s + cfg.decode_step_s_per_seq * len(self._running)
                await self._sleep(step + cfg.prefill_s_per_token * prefill_tokens)
                self._steps += 1
                for seq in list(self._running):  # a stream closed during the step is already gone
                    self._advance(seq)
        except Exception as exc:  # a broken simulator must fail its requests, not hang them
            self._die(f"scheduler crashed: {exc!r}")

    def _die(self, reason: str) -> None:
        self._failure = reason
        self._closed = True
        for seq in self._waiting + self._running:
            seq.out.put_nowait(EngineDeadError(reason))
        self._waiting.clear()
        self._running.clear()
        self._kv_used = 0

    def kill(self, reason: str = "killed by fault injection") -> None:
        """Fault injection: the engine dies now, as when its process is killed; every open request fails
        with EngineDeadError and nothing is served until a new engine replaces it."""
        self._die(reason)
        if self._task is not None:
            self._task.cancel()

    def _admit(self) -> int:
        """Move waiting requests into the batch, strictly in order; returns their prompt tokens."""
        prefill = 0
        while self._waiting and len(self._running) < self._cfg.max_batch:
            seq = self._waiting[0]
            need = len(seq.req.prompt_token_ids) + seq.req.sampling.max_tokens
            # Head-of-line blocking: skipping a big request for smaller ones would starve it.
            if self._kv_used + need > self._cfg.kv_capacity_tokens:
                break
            self._waiting.pop(0)
            seq.reserved = need
            self._kv_used += need
            self._running.append(seq)
            seq.cached = self._cache_prefix(seq.req)
            prefill += len(seq.req.prompt_token_ids) - seq.cached
        return prefill

    def _cache_prefix(self, req: EngineRequest) -> int:
        """The leading prompt tokens already in the prefix cache (whole blocks, never the last prompt token,
        which is always computed, as in vLLM); the prompt's blocks are cached from now on (LRU)."""
        size = self._cfg.prefix_cache_block
        if size <= 0:
            return 0
        prompt = req.prompt_token_ids
        blocks = self._prefix_blocks
        chained: int = hash(req.cache_salt)
        cached, hitting = 0, True
        for start in range(0, len(prompt) - size, size):
            chained = hash((chained, tuple(prompt[start : start + size])))
            if hitting and chained in blocks:
                cached += size
            else:
                hitting = False
            blocks[chained] = None
            blocks.move_to_end(chained)
        while len(blocks) * size > self._cfg.kv_capacity_tokens:
            blocks.popitem(last=False)
        return cached

    def _drop_expired(self) -> None:
        now = self._clock()
        for seq in [s for s in self._waiting if s.req.deadline is not None and s.req.deadline < now]:
            self._waiting.remove(seq)
            seq.out.put_nowait(self._final(seq, "abort"))

    def _advance(self, seq: _Seq) -> None:
        """Give one running request its next token, finishing it on a stop string or max_tokens."""
        cfg, sampling = self._cfg, seq.req.sampling
        if cfg.fail_after_tokens is not None and len(seq.token_ids) >= cfg.fail_after_tokens:
            self._discard(seq)
            seq.out.put_nowait(EngineRequestError(f"injected failure after {len(seq.token_ids)} tokens"))
            return
        token_id, piece = self._next_token(seq)
        if seq.right is not None and seq.json is None and not seq.token_ids:
            piece = " right" if seq.right else " wrong"
        seq.token_ids.append(token_id)
        seq.text += piece
        finish: FinishReason | None = None
        end = len(seq.text)
        # vLLM looks for stop strings only from min_tokens on; the text before is sent unchecked.
        may_end = len(seq.token_ids) >= sampling.min_tokens
        if seq.stops and may_end:
            # No stop string starts before `emitted`: the tail below is held back until it cannot.
            hits = [i for i in (seq.text.find(s, seq.emitted) for s in seq.stops) if i >= 0]
            if hits:
                finish, end = "stop", min(hits)
            else:
                # Hold back a tail that might still grow into a stop string spanning tokens.
                end = max(seq.emitted, end - seq.stop_hold)
        # Complete JSON is where the grammar allows only end of sequence, which ignore_eos skips.
        json_done = seq.json is not None and seq.json_pos >= len(seq.json)
        if finish is None and json_done and may_end and not sampling.ignore_eos:
            finish, end = "stop", len(seq.text)
        if finish is None and len(seq.token_ids) >= sampling.max_tokens:
            finish, end = "length", len(seq.text)
        logprobs = (
            None
            if sampling.logprobs is None
            else (self._token_logprob(token_id, piece, sampling.logprobs, seq.right),)
        )
        text, seq.emitted = seq.text[seq.emitted : end], max(seq.emitted, end)
        usage = None
        if finish is not None:
            self._discard(seq)
            usage = _usage(seq)
        seq.out.put_nowait(
            EngineDelta(
                token_ids=(token_id,), text=text, logprobs=logprobs, finish_reason=finish, usage=usage
            )
        )

    def _next_token(self, seq: _Seq) -> tuple[int, str]:
        """The next token id and its text: a piece of the constrained JSON, else a drawn word."""
        vocab = self._cfg.vocab_size
        if seq.json is not None:
            start = seq.json_pos
            # Past the end of the JSON (min_tokens or ignore_eos hold the end back) only whitespace is valid.
            piece = seq.json[start : start + seq.rng.randint(1, _MAX_JSON_PIECE)] or " "
            seq.json_pos = min(len(seq.json), start + len(piece))
            # A stable id per piece, moved on past banned ids (a real vocabulary spells text many ways).
            base = zlib.crc32(piece.encode())
            token_id = next(t for t in ((base + k) % vocab for k in range(vocab)) if t not in seq.banned)
            return token_id, piece
        if seq.forced:
            token_id = seq.rng.choice(seq.forced)
        else:
            # `int(random() * vocab)`: one call into C where `randrange` runs three Python frames.
            token_id = int(seq.rng.random() * vocab)
            while token_id in seq.banned:  # generate() refused a request that bans every id
                token_id = int(seq.rng.random() * vocab)
        return token_id, _token_text(token_id)

    def _token_logprob(self, token_id: int, text: str, n: int, right: bool | None) -> TokenLogprob:
        # The chosen token ranks first; alternatives step by a prime so they are distinct ids.
        ids = [(token_id + rank * 7919) % self._cfg.vocab_size for rank in range(n)]
        top = tuple(
            TopLogprob(i, text if rank == 0 else _token_text(i), _logprob(rank, token_id))
            for rank, i in enumerate(ids)
        )
        chosen = _logprob(0, token_id)
        if right is not None:
            cfg = self._cfg
            spread = ((token_id * 2654435761) % 1000) / 500.0 - 1.0  # in [-1, 1), fixed per token id
            base = cfg.confident_logprob if right else cfg.unsure_logprob
            chosen = min(0.0, base + cfg.logprob_noise * spread)
        return TokenLogprob(token_id, text, chosen, top)

    def _final(self, seq: _Seq, reason: FinishReason) -> EngineDelta:
        return EngineDelta(token_ids=(), text="", finish_reason=reason, usage=_usage(seq))

    def _discard(self, seq: _Seq) -> None:
        """Forget a request wherever it is and free its KV; safe to call twice."""
        if seq in self._running:
            self._running.remove(seq)
            self._kv_used -= seq.reserved
            seq.reserved = 0
            self._wake.set()  # room freed: admission may proceed
        elif seq in self._waiting:
            self._waiting.remove(seq)

    def _abort_all(self) -> None:
        for seq in self._waiting + self._running:
            seq.out.put_nowait(self._final(seq, "abort"))
        for seq in self._waiting + self._running:
            self._discard(seq)
