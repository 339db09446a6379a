"""A `vllm serve` replica reached over HTTP: the same `Engine` as `VllmLocalEngine`, through the server's
OpenAI-compatible API (`POST /v1/completions` with token-id prompts, `/health`, `/metrics`, `/v1/models`).

What the server must run with for the whole contract to hold (the flags `VllmLocalEngine` sets itself):
`--served-model-name NAME` (checked at start), `--scheduling-policy priority` (vLLM refuses a request with a
priority other than 0 otherwise; `RemoteEngineConfig.priority_scheduling=False` leaves it out),
`--enable-prompt-tokens-details` (cached tokens in usage), `--structured-outputs-config
'{"backend":"xgrammar","disable_any_whitespace":true}'` (the gateway checks schemas against xgrammar) and
`--worker-extension-cls engines.vllm_local.ScoringWorkerExtension` (named-id scoring sharing a step with
top-k logprobs, see `engines.vllm_local._patch_sampler`). `EngineRequest.deadline` is not sent: vLLM's
server has no such field; the gateway enforces deadlines by closing the stream. The server does not say how
many sequences it runs at once: `RemoteEngineConfig.max_num_seqs`, its `--max-num-seqs`, is reported in the
load (`EngineLoad.max_running`) so that requests beyond it wait in the gateway's fair queue.

Errors map onto `engines.base`: unreachable replica (refused, reset, cut mid-stream, a stream ended
after some tokens without a finish, no response status line within `response_timeout`) or a server error
(5xx but 503) -> `EngineDeadError` with `retry_after`; a stream ended with no token and no finish (what a
replica draining on SIGTERM answers a new request) -> `EngineDrainingError`, an `EngineDeadError` that keeps
the replica out of routing until it has left (`Replica.judge_failure`); HTTP 429/503 or a full connection
pool -> `EngineOverloadedError`; any other refusal (400, other 4xx), an error event in the stream, or a
stall past a timeout -> `EngineRequestError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx
import msgspec

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineDrainingError,
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
from engines.vllm_remote_wire import (
    CHUNK,
    ENCODE,
    JSON_HEADERS,
    MODELS,
    ChoiceWire,
    ChunkWire,
    LogprobsWire,
    RemoteEngineConfig,
    ServerMetrics,
    completion_body,
    parse_metrics,
    score_body,
    token_id_of,
)

log = logging.getLogger("lockgate.engine")

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmRemoteEngine:
    """An `Engine` backed by a `vllm serve` process reached over HTTP.

    `token_text` gives a token id's text for logprobs (the gateway's tokenizer; vLLM decodes one token the
    same way): the server is asked for ids, because its text-keyed alternatives lose tokens that decode
    alike. Without it, logprob entries carry empty text."""

    def __init__(self, config: RemoteEngineConfig, *, token_text: Callable[[int], str] | None = None) -> None:
        """Build the engine; nothing connects until `start()`."""
        self.config = config
        self.replica_id = f"remote:{config.url}"
        self.model_name = config.served_model
        self.max_model_len = config.max_model_len
        self._url = config.url.rstrip("/")
        self._token_text = token_text
        self._client: httpx.AsyncClient | None = None
        self._metrics = ServerMetrics()
        # This engine's requests open at the replica while the last scrape was taken (the most at once of
        # its start and its end): the part of the scrape that was this engine's own.
        self._own_at_scrape = 0
        self._metrics_task: asyncio.Task[None] | None = None
        # Requests this engine has open at the replica (generate and score_next_token).
        self.in_flight = 0

    @property
    def client(self) -> httpx.AsyncClient:
        """The pooled HTTP client (only between start() and shutdown())."""
        if self._client is None:
            raise EngineDeadError("the remote engine is not started", retry_after=self.config.retry_after)
        return self._client

    async def start(self) -> None:
        """Wait (bounded by `start_timeout`) for /health, check that /v1/models serves `served_model`, read
        the metrics once and start refreshing them every `metrics_interval` seconds."""
        c = self.config
        if self._client is None:
            limits = httpx.Limits(max_connections=c.pool_size, max_keepalive_connections=c.pool_size)
            timeout = httpx.Timeout(c.token_timeout, connect=c.connect_timeout, pool=c.first_token_timeout)
            self._client = httpx.AsyncClient(base_url=self._url, limits=limits, timeout=timeout)
        try:
            async with asyncio.timeout(c.start_timeout):
                while not (health := await self.health()).ready:  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.25)
        except TimeoutError:
            await self.shutdown()
            raise EngineDeadError(
                f"{self.replica_id} not healthy within {c.start_timeout} s: {health.detail}",
                retry_after=c.retry_after,
            ) from None
        served = await self._served_models()
        if c.served_model not in served:
            await self.shutdown()
            raise EngineDeadError(
                f"{self.replica_id} serves {served}, not {c.served_model!r}: the replica runs other weights"
            )
        await self._refresh_metrics()
        self._metrics_task = asyncio.create_task(self._metrics_loop(), name=f"metrics {self.replica_id}")

    async def _served_models(self) -> list[str]:
        async with self._errors_mapped():
            response = await self.client.get("/v1/models")
            self._raise_for_status(response)
        return [m.id for m in MODELS.decode(response.content).data]

    async def shutdown(self) -> None:
        """Stop the metrics task and close the client; streams still open fail (their connections close,
        which aborts their requests in the server)."""
        task, self._metrics_task = self._metrics_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def health(self) -> Health:
        """`GET /health`: 200 means ready."""
        if self._client is None:
            return Health(ready=False, detail="not started")
        try:
            response = await self._client.get("/health", timeout=self.config.connect_timeout)
        except httpx.HTTPError as exc:
            return Health(ready=False, detail=f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return Health(ready=False, detail=f"/health answered {response.status_code}")
        return Health(ready=True)

    async def load(self) -> EngineLoad:
        """The server's last scraped figures, combined with this engine's own requests there.

        Rule: the requests are the others' part of the scrape (what it counted beyond this engine's own
        requests open while it was taken) plus this engine's in-flight requests now, so that own requests
        that ended since the scrape (up to `metrics_interval` s old) are not load, and those begun since
        are; of them, `running` is at most what the server reports, the rest wait (own requests the scrape
        has not seen running yet wait, as `VllmLocalEngine` counts them)."""
        m = self._metrics
        total = max(0, m.running + m.waiting - self._own_at_scrape) + self.in_flight
        # Invariant: running + waiting >= in_flight (what this engine holds there is never hidden).
        running = min(m.running, total)
        return EngineLoad(
            running=running,
            waiting=total - running,
            kv_tokens_used=int(m.kv_usage * m.kv_capacity),
            kv_tokens_capacity=m.kv_capacity,
            steps=m.steps,
            max_running=self.config.max_num_seqs,
        )

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval)
            await self._refresh_metrics()

    async def _refresh_metrics(self) -> None:
        own = self.in_flight
        try:
            response = await self.client.get("/metrics", timeout=self.config.connect_timeout)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            # The last figures stay; health() is what reports the replica down.
            log.warning("metrics of %s unavailable: %s: %s", self.replica_id, type(exc).__name__, exc)
            return
        self._metrics = parse_metrics(response.text)
        self._own_at_scrape = max(own, self.in_flight)

    def _check_room(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens"
            )

    @contextlib.asynccontextmanager
    async def _errors_mapped(self) -> AsyncIterator[None]:
        """httpx's transport errors as engine errors; counts the request in flight while open."""
        self.in_flight += 1
        try:
            yield
        except httpx.PoolTimeout as exc:
            raise EngineOverloadedError(f"{self.replica_id}: no free connection") from exc
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise EngineDeadError(
                f"{self.replica_id} unreachable: {type(exc).__name__}: {exc}",
                retry_after=self.config.retry_after,
            ) from exc
        except httpx.TimeoutException as exc:
            raise EngineRequestError(f"{self.replica_id}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise EngineRequestError(f"{self.replica_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.in_flight -= 1

    def _raise_for_status(self, response: httpx.Response) -> None:
        """Refusals by status (the body must have been read)."""
        if response.status_code < 400:
            return
        message = f"{self.replica_id} answered {response.status_code}"
        with contextlib.suppress(msgspec.DecodeError):
            error = CHUNK.decode(response.content).error
            if error is not None:
                message = f"{message}: {error.message}"
        if response.status_code in (429, 503):
            retry = response.headers.get("retry-after", "")
            after = float(retry) if retry.replace(".", "", 1).isdigit() else self.config.retry_after
            raise EngineOverloadedError(message, retry_after=after)
        if response.status_code >= 500:
            # The server failed, not the request (vLLM answers a bad request with 400): e.g. a replica
            # draining on SIGTERM refuses new work with 500. Failed over before a first token.
            raise EngineDeadError(message, retry_after=self.config.retry_after)
        raise EngineRequestError(message)

    async def _events(
        self, body: dict[str, Any], headers: Mapping[str, str]
    ) -> AsyncGenerator[ChunkWire, None]:
        """The decoded SSE events of one streamed completion, bounded by the first-token and between-token
        timeouts. Closing this iterator closes the response (its connection), which aborts the request."""
        c = self.config
        async with self._errors_mapped():
            # Reads are bounded below by the first-token and between-token timeouts, not by httpx.
            timeout = httpx.Timeout(None, connect=c.connect_timeout, pool=c.response_timeout)
            request = self.client.build_request(
                "POST", "/v1/completions", content=ENCODE.encode(body), headers=headers, timeout=timeout
            )
            try:
                async with asyncio.timeout(c.response_timeout):
                    response = await self.client.send(request, stream=True)
            except TimeoutError:
                raise EngineDeadError(
                    f"{self.replica_id}: no response in {c.response_timeout} s",
                    retry_after=c.retry_after,
                ) from None
            try:
                if response.status_code >= 400:
                    await response.aread()
                    self._raise_for_status(response)
                lines = response.aiter_lines()
                wait = c.first_token_timeout
                while True:
                    try:
                        async with asyncio.timeout(wait):
                            line = await anext(lines)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise EngineRequestError(f"{self.replica_id}: stream stalled for {wait} s") from None
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    wait = c.token_timeout
                    try:
                        chunk = CHUNK.decode(data)
                    except msgspec.DecodeError as exc:
                        raise EngineRequestError(f"{self.replica_id} sent a malformed event: {exc}") from exc
                    if chunk.error is not None:
                        raise EngineRequestError(f"{self.replica_id}: {chunk.error.message}")
                    yield chunk
            finally:
                await response.aclose()

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Stream deltas from the replica. Closing this iterator closes the HTTP response, which makes vLLM
        abort the request. The final delta (finish reason, usage) is held until the server's usage event."""
        if req.n != 1:
            raise EngineRequestError("an engine generates one choice per request (see engines.choices)")
        self._check_room(len(req.prompt_token_ids), req.sampling.max_tokens)
        completion_tokens = 0
        final: ChoiceWire | None = None
        cached = 0
        headers = {**JSON_HEADERS, "traceparent": req.traceparent} if req.traceparent else JSON_HEADERS
        events = self._events(completion_body(req, self.config), headers)
        try:
            async for chunk in events:
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
                for choice in chunk.choices:
                    if final is not None:
                        raise EngineRequestError(f"{self.replica_id} sent output after the finish")
                    if choice.finish_reason is not None:
                        final = choice  # yielded with the usage that follows
                        continue
                    if choice.token_ids or choice.text:
                        completion_tokens += len(choice.token_ids or ())
                        yield self._delta(choice, req.sampling.logprobs)
        finally:
            await events.aclose()
        if final is None and not completion_tokens:
            # What a replica told to stop (SIGTERM, `--shutdown-timeout`) answers a new request while it
            # drains: a stream with no token in it, ended at once or when the drain is over.
            raise EngineDrainingError(
                f"{self.replica_id} refused the request: it is shutting down",
                retry_after=self.config.retry_after,
            )
        if final is None:
            raise EngineDeadError(
                f"{self.replica_id} ended the stream without finishing the request",
                retry_after=self.config.retry_after,
            )
        if final.finish_reason == "error":
            raise EngineRequestError(f"{self.replica_id} failed the request")
        completion_tokens += len(final.token_ids or ())
        usage = Usage(
            prompt_tokens=len(req.prompt_token_ids), completion_tokens=completion_tokens, cached_tokens=cached
        )
        finish = _FINISH.get(final.finish_reason or "", "stop")
        yield self._delta(final, req.sampling.logprobs, finish=finish, usage=usage)

    def _delta(
        self,
        choice: ChoiceWire,
        top_n: int | None,
        finish: FinishReason | None = None,
        usage: Usage | None = None,
    ) -> EngineDelta:
        token_ids = tuple(choice.token_ids or ())
        logprobs = None
        if top_n is not None:
            wire = choice.logprobs or LogprobsWire()
            logprobs = tuple(
                self._token_logprob(t, lp, top or {}, top_n)
                for t, lp, top in zip(token_ids, wire.token_logprobs, wire.top_logprobs, strict=False)
            )
        return EngineDelta(
            token_ids=token_ids, text=choice.text, logprobs=logprobs, finish_reason=finish, usage=usage
        )

    def _token_logprob(
        self, token_id: int, logprob: float | None, top: dict[str, float], n: int
    ) -> TokenLogprob:
        text = self._token_text or (lambda _t: "")
        alternatives = sorted(((token_id_of(k), v) for k, v in top.items()), key=lambda kv: -kv[1])[:n]
        return TokenLogprob(
            token_id=token_id,
            token=text(token_id),
            logprob=logprob if logprob is not None else -9999.0,
            top=tuple(TopLogprob(token_id=t, token=text(t), logprob=v) for t, v in alternatives),
        )

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """Log-probabilities of exactly `token_ids` as the first generated token: one greedy step with the
        server's `logprob_token_ids` (vLLM gathers the raw log-softmax at exactly those ids, as
        `VllmLocalEngine` does in process). An id the server leaves out raises EngineRequestError."""
        wanted = list(dict.fromkeys(token_ids))
        if not wanted:
            raise EngineRequestError("no token ids to score")
        self._check_room(len(prompt_token_ids), 1)
        body = score_body(prompt_token_ids, wanted, priority, self.config, cache_salt=cache_salt)
        async with self._errors_mapped():
            c = self.config
            timeout = httpx.Timeout(
                c.first_token_timeout, connect=c.connect_timeout, pool=c.first_token_timeout
            )
            response = await self.client.post(
                "/v1/completions", content=ENCODE.encode(body), headers=JSON_HEADERS, timeout=timeout
            )
            self._raise_for_status(response)
        try:
            choices = CHUNK.decode(response.content).choices
        except msgspec.DecodeError as exc:
            raise EngineRequestError(f"{self.replica_id} sent a malformed answer: {exc}") from exc
        wire = choices[0].logprobs if choices else None
        first = wire.top_logprobs[0] if wire and wire.top_logprobs else None
        found = {token_id_of(k): v for k, v in (first or {}).items()}
        missing = [t for t in wanted if t not in found]
        if missing:
            raise EngineRequestError(f"the engine returned no logprob for token ids {missing}")
        return {t: found[t] for t in wanted}


__all__ = ["RemoteEngineConfig", "ServerMetrics", "VllmRemoteEngine", "parse_metrics"]
