"""VllmRemoteEngine against a fake `vllm serve`: a raw ASGI app under uvicorn in the test's event loop that
answers like vLLM 0.32's OpenAI server (streamed completions, /health, /metrics, /v1/models). The real server
runs the contract suite (tests/engines/conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from engines.base import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestError,
    OutputConstraint,
    SamplingSpec,
)
from engines.vllm_remote import RemoteEngineConfig, VllmRemoteEngine, parse_metrics
from tests.conftest import free_port
from tests.fake_vllm_server import read_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 42.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 900.0
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="91",sliding_window="None"} 1.0
"""


def _event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def _token(token_id: int, text: str, finish: str | None = None, logprobs: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "token_ids": [token_id], "finish_reason": finish}
    if logprobs:
        top = {f"token_id:{token_id}": -0.5, "token_id:7": -1.5, "token_id:8": -3.0}
        choice["logprobs"] = {
            "tokens": [f"token_id:{token_id}"],
            "token_logprobs": [-0.5],
            "top_logprobs": [top],
        }
    return choice


def _stream(n: int, logprobs: bool = False, finish: str = "length") -> list[bytes]:
    events = [_event([_token(10 + i, f"t{i}", logprobs=logprobs)]) for i in range(n - 1)]
    events.append(_event([_token(10 + n - 1, f"t{n - 1}", finish=finish, logprobs=logprobs)]))
    usage = {"prompt_tokens": 3, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 2}}
    events += [_event([], usage), b"data: [DONE]\n\n"]
    return events


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


@dataclass
class FakeVllm:
    """What the fake server answers, and what it saw."""

    events: list[bytes] = field(default_factory=lambda: _stream(3))
    status: int = 200
    error_body: bytes = b'{"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}'
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # Seconds between events; after `stall_after` events the stream stops sending until the client leaves.
    interval: float = 0.0
    stall_after: int | None = None
    # False: take the request and never answer, not even its status line (a vLLM tearing down after a drain).
    responds: bool = True
    models: list[str] = field(default_factory=lambda: ["m"])
    healthy: bool = True
    metrics: str = METRICS
    # /metrics answers once this is set (clear it to hold scrapes back); `scrapes` counts those answered.
    metrics_open: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))
    scrapes: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    # The request headers of each completion, by name.
    sent_headers: list[dict[bytes, bytes]] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        path = scope["path"]
        if path == "/health":
            await self._answer(send, 200 if self.healthy else 503, b"")
        elif path == "/metrics":
            await self.metrics_open.wait()
            self.scrapes += 1
            await self._answer(send, 200, self.metrics.encode(), b"text/plain")
        elif path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in self.models]
            await self._answer(send, 200, json.dumps({"object": "list", "data": data}).encode())
        elif path == "/v1/completions":
            self.bodies.append(json.loads(raw))
            self.sent_headers.append(dict(scope["headers"]))
            await self._complete(receive, send)
        else:
            await self._answer(send, 404, b"")

    async def _answer(self, send: Send, status: int, body: bytes, kind: bytes = b"application/json") -> None:
        headers = [(b"content-type", kind), *self.headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _complete(self, receive: Receive, send: Send) -> None:
        if self.status != 200:
            await self._answer(send, self.status, self.error_body)
            return
        finished = False

        async def watch() -> None:
            message = await receive()
            if message["type"] == "http.disconnect" and not finished:
                self.disconnected.set()

        watcher = asyncio.create_task(watch())
        if not self.responds:
            await self.disconnected.wait()
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self.streaming.set()
        for i, event in enumerate(self.events):
            if self.stall_after is not None and i >= self.stall_after:
                await self.disconnected.wait()
                return
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(self.interval)
        finished = True
        await send({"type": "http.response.body", "body": b""})
        watcher.cancel()


@asynccontextmanager
async def _serve(fake: FakeVllm) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _config(url: str, **overrides: Any) -> RemoteEngineConfig:
    settings: dict[str, Any] = {
        "url": url,
        "served_model": "m",
        "max_model_len": 64,
        "first_token_timeout": 5.0,
        "token_timeout": 5.0,
        "metrics_interval": 0.05,
        "start_timeout": 5.0,
    }
    return RemoteEngineConfig(**(settings | overrides))


@asynccontextmanager
async def _engine(fake: FakeVllm, **overrides: Any) -> AsyncIterator[VllmRemoteEngine]:
    async with _serve(fake) as url:
        engine = VllmRemoteEngine(_config(url, **overrides), token_text=lambda t: f"<{t}>")
        await engine.start()
        try:
            yield engine
        finally:
            await engine.shutdown()


def _request(sampling: SamplingSpec | None = None, **fields: Any) -> EngineRequest:
    return EngineRequest(
        request_id="r1",
        prompt_token_ids=(1, 2, 3),
        sampling=sampling or SamplingSpec(max_tokens=4),
        **fields,
    )


async def test_every_sampling_field_reaches_the_body() -> None:
    fake = FakeVllm()
    sampling = SamplingSpec(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        seed=11,
        stop=("END",),
        logprobs=2,
        ignore_eos=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        top_k=20,
        min_p=0.05,
        min_tokens=3,
        logit_bias=((5, -100.0), (6, 2.5)),
        constraint=OutputConstraint(kind="json_schema", schema='{"type":"object"}'),
    )
    async with _engine(fake) as engine:
        [_ async for _ in engine.generate(_request(sampling, priority=-4, cache_salt="tenant-a"))]
    body = fake.bodies[0]
    expected = {
        "model": "m",
        "prompt": [1, 2, 3],
        "request_id": "r1",
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 11,
        "stop": ["END"],
        "ignore_eos": True,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "logit_bias": {"5": -100.0, "6": 2.5},
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "structured_outputs": {"json": '{"type":"object"}'},
        "cache_salt": "tenant-a",
        "priority": -4,
    }
    assert body == expected


async def test_json_object_and_no_priority_when_the_server_runs_fcfs() -> None:
    fake = FakeVllm()
    sampling = SamplingSpec(max_tokens=4, constraint=OutputConstraint(kind="json_object"))
    async with _engine(fake, priority_scheduling=False) as engine:
        [_ async for _ in engine.generate(_request(sampling, priority=-4))]
    assert fake.bodies[0]["structured_outputs"] == {"json_object": True}
    assert "priority" not in fake.bodies[0]
    assert "cache_salt" not in fake.bodies[0]


async def test_the_trace_context_goes_along_as_traceparent() -> None:
    fake = FakeVllm()
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with _engine(fake) as engine:
        [_ async for _ in engine.generate(_request(SamplingSpec(max_tokens=3), traceparent=traceparent))]
        [_ async for _ in engine.generate(_request(SamplingSpec(max_tokens=3)))]
    assert fake.sent_headers[0][b"traceparent"] == traceparent.encode()
    assert b"traceparent" not in fake.sent_headers[1]


async def test_stream_gives_deltas_then_one_final_delta_with_usage() -> None:
    fake = FakeVllm(events=_stream(3, logprobs=True, finish="stop"))
    async with _engine(fake) as engine:
        deltas = [d async for d in engine.generate(_request(SamplingSpec(max_tokens=4, logprobs=2)))]
    assert [d.token_ids for d in deltas] == [(10,), (11,), (12,)]
    assert "".join(d.text for d in deltas) == "t0t1t2"
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert [d.usage for d in deltas[:-1]] == [None, None]
    usage = deltas[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (3, 3, 2)
    lp = deltas[0].logprobs
    assert lp is not None
    assert (lp[0].token_id, lp[0].token, lp[0].logprob) == (10, "<10>", -0.5)
    # The top 2 by logprob, ids parsed from vLLM's `token_id:<id>` keys.
    assert [(t.token_id, t.token, t.logprob) for t in lp[0].top] == [(10, "<10>", -0.5), (7, "<7>", -1.5)]


async def test_finish_reasons_map_like_the_local_engine() -> None:
    for wire, ours in [("length", "length"), ("abort", "abort"), ("stop", "stop"), ("other", "stop")]:
        fake = FakeVllm(events=_stream(1, finish=wire))
        async with _engine(fake) as engine:
            deltas = [d async for d in engine.generate(_request())]
        assert deltas[-1].finish_reason == ours


async def test_http_errors_map_onto_engine_errors() -> None:
    cases: list[tuple[int, type[Exception]]] = [
        (400, EngineRequestError),
        (404, EngineRequestError),
        (500, EngineDeadError),  # a server error: the replica's fault (a draining vLLM answers 500)
        (502, EngineDeadError),
        (503, EngineOverloadedError),
        (429, EngineOverloadedError),
    ]
    for status, error in cases:
        fake = FakeVllm(status=status, headers=[(b"retry-after", b"7")])
        async with _engine(fake) as engine:
            with pytest.raises(error) as caught:
                [_ async for _ in engine.generate(_request())]
            assert engine.in_flight == 0
        if status == 400:
            assert "bad prompt" in str(caught.value)
        if error is EngineOverloadedError:
            assert caught.value.retry_after == 7.0  # type: ignore[attr-defined]


async def test_a_stream_ended_without_a_finish_is_the_replicas_failure() -> None:
    # What a vLLM draining on SIGTERM sends a request it refuses: a stream with no token, ended at once or
    # when its drain is over.
    for events in ([], [_event([], {"prompt_tokens": 3, "completion_tokens": 0})]):
        fake = FakeVllm(events=[*events, b"data: [DONE]\n\n"])
        async with _engine(fake) as engine:
            with pytest.raises(EngineDrainingError, match="shutting down"):
                [_ async for _ in engine.generate(_request())]
    # Cut after some output: the replica failed (not a drain).
    fake = FakeVllm(events=[_event([_token(10, "a")]), b"data: [DONE]\n\n"])
    async with _engine(fake) as engine:
        with pytest.raises(EngineDeadError, match="without finishing") as caught:
            [_ async for _ in engine.generate(_request())]
        assert not isinstance(caught.value, EngineDrainingError)


async def test_an_error_event_in_the_stream_fails_the_request() -> None:
    error = b'data: {"error": {"message": "Internal server error", "type": "x", "code": 500}}\n\n'
    fake = FakeVllm(events=[_event([_token(10, "a")]), error, b"data: [DONE]\n\n"])
    async with _engine(fake) as engine:
        with pytest.raises(EngineRequestError, match="Internal server error"):
            [_ async for _ in engine.generate(_request())]


async def test_refused_connection_is_a_dead_engine_with_retry_after() -> None:
    fake = FakeVllm()
    async with _serve(fake) as url:
        engine = VllmRemoteEngine(_config(url, retry_after=3.0))
        await engine.start()
    try:
        with pytest.raises(EngineDeadError) as caught:
            [_ async for _ in engine.generate(_request())]
        assert caught.value.retry_after == 3.0
        with pytest.raises(EngineDeadError):
            await engine.score_next_token([1, 2], [5])
        assert not (await engine.health()).ready
        assert engine.in_flight == 0
    finally:
        await engine.shutdown()


async def test_start_refuses_a_replica_serving_other_weights() -> None:
    fake = FakeVllm(models=["other-model"])
    async with _serve(fake) as url:
        engine = VllmRemoteEngine(_config(url))
        with pytest.raises(EngineDeadError, match="other weights"):
            await engine.start()


async def test_start_gives_up_on_a_replica_that_never_gets_healthy() -> None:
    fake = FakeVllm(healthy=False)
    async with _serve(fake) as url:
        engine = VllmRemoteEngine(_config(url, start_timeout=0.3))
        with pytest.raises(EngineDeadError, match="not healthy"):
            await engine.start()


async def test_stall_between_tokens_fails_the_request_and_closes_the_connection() -> None:
    fake = FakeVllm(events=_stream(5), stall_after=2)
    async with _engine(fake, token_timeout=0.2) as engine:
        stream = engine.generate(_request())
        first = await anext(stream)
        assert first.token_ids == (10,)
        with pytest.raises(EngineRequestError, match="stalled"):
            async for _ in stream:
                pass
        async with asyncio.timeout(5):
            await fake.disconnected.wait()
        assert engine.in_flight == 0


async def test_no_first_token_within_its_timeout_fails_the_request() -> None:
    fake = FakeVllm(events=_stream(3), stall_after=0)
    async with _engine(fake, first_token_timeout=0.2) as engine:
        with pytest.raises(EngineRequestError, match="stalled"):
            [_ async for _ in engine.generate(_request())]


async def test_a_replica_that_takes_a_request_and_never_answers_is_failed_over() -> None:
    fake = FakeVllm(responds=False)
    async with _engine(fake, response_timeout=0.2) as engine:
        with pytest.raises(EngineDeadError, match=r"no response in 0\.2 s"):
            [_ async for _ in engine.generate(_request())]
        async with asyncio.timeout(5):
            await fake.disconnected.wait()  # the request is given up, its connection closed
        assert engine.in_flight == 0


async def test_closing_the_stream_closes_the_upstream_connection() -> None:
    fake = FakeVllm(events=_stream(50), interval=0.02)
    async with _engine(fake) as engine:
        stream = engine.generate(_request())
        await anext(stream)
        assert engine.in_flight == 1
        assert (await engine.load()).running + (await engine.load()).waiting >= 1
        await stream.aclose()
        async with asyncio.timeout(5):
            await fake.disconnected.wait()
        assert engine.in_flight == 0


async def test_metrics_are_parsed_into_load_and_combined_with_in_flight() -> None:
    fake = FakeVllm(metrics=METRICS.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0"))
    async with _engine(fake) as engine:
        load = await engine.load()
        assert (load.running, load.waiting) == (0, 0)
        assert load.kv_tokens_capacity == 91 * 128
        assert load.kv_tokens_used == int(0.25 * 91 * 128)
        assert load.steps == 42
        fake.events, fake.stall_after = _stream(5), 1
        stream = engine.generate(_request())
        await anext(stream)
        # The scrape shows nothing running yet: this engine's own request counts as waiting.
        assert ((await engine.load()).running, (await engine.load()).waiting) == (0, 1)
        fake.metrics = METRICS
        async with asyncio.timeout(5):
            while (await engine.load()).running != 3:  # noqa: ASYNC110 - the refresh task's next scrape
                await asyncio.sleep(0.01)
        assert (await engine.load()).waiting == 2
        await stream.aclose()


async def test_own_requests_that_ended_since_the_last_scrape_are_not_load() -> None:
    # The server reports one running request: this engine's own, in flight while it was scraped.
    one = METRICS.replace("} 3.0", "} 1.0").replace("} 2.0", "} 0.0")
    fake = FakeVllm(metrics=one, events=_stream(5), stall_after=1)
    async with _engine(fake) as engine:
        stream = engine.generate(_request())
        await anext(stream)
        seen = fake.scrapes
        async with asyncio.timeout(5):
            while fake.scrapes < seen + 2:  # noqa: ASYNC110 - a whole scrape taken while it ran
                await asyncio.sleep(0.01)
        load = await engine.load()
        assert (load.running, load.waiting) == (1, 0)  # counted once, not as its own and the server's
        fake.metrics_open.clear()  # no newer scrape: the last one still shows the request running
        await stream.aclose()
        assert engine.in_flight == 0
        load = await engine.load()
        assert (load.running, load.waiting) == (0, 0)
        fake.metrics_open.set()


def test_parse_metrics_sums_engines_and_takes_capacity_from_cache_config_info() -> None:
    two_engines = METRICS + METRICS.replace('engine="0"', 'engine="1"')
    metrics = parse_metrics(two_engines)
    assert (metrics.running, metrics.waiting, metrics.steps) == (6, 4, 84)
    assert metrics.kv_capacity == 2 * 91 * 128
    sized = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="5000",num_gpu_blocks="1"} 1.0\n'
    assert parse_metrics(sized).kv_capacity == 5000
    assert parse_metrics("garbage\n# comment\nvllm:num_requests_running NaN\n").running == 0


async def test_score_next_token_asks_for_exactly_the_named_ids() -> None:
    answer = {
        "choices": [
            {
                "index": 0,
                "text": "x",
                "logprobs": {
                    "tokens": ["token_id:9"],
                    "token_logprobs": [-0.1],
                    "top_logprobs": [{"token_id:9": -0.1, "token_id:5": -2.0, "token_id:17": -4.0}],
                },
                "finish_reason": "length",
            }
        ]
    }
    fake = FakeVllm(events=[json.dumps(answer).encode()])
    async with _engine(fake) as engine:
        scores = await engine.score_next_token([1, 2, 3], [5, 17, 17], priority=-10, cache_salt="tenant-a")
        assert scores == {5: -2.0, 17: -4.0}
        body = fake.bodies[0]
        assert body["logprob_token_ids"] == [5, 17]
        assert (body["max_tokens"], body["temperature"], body["priority"]) == (1, 0.0, -10)
        # A guard call is salted like the tenant's generation requests: no cached prefix across tenants.
        assert body["cache_salt"] == "tenant-a"
        with pytest.raises(EngineRequestError, match=r"\[400\]"):
            await engine.score_next_token([1, 2, 3], [5, 400])
        with pytest.raises(EngineRequestError):
            await engine.score_next_token([1] * 64, [5])


async def test_requests_that_cannot_fit_are_refused_before_sending() -> None:
    fake = FakeVllm()
    async with _engine(fake) as engine:
        with pytest.raises(EngineRequestError, match="exceeds the context"):
            [_ async for _ in engine.generate(_request(SamplingSpec(max_tokens=62)))]
        with pytest.raises(EngineRequestError, match="one choice"):
            [_ async for _ in engine.generate(_request(n=2))]
    assert fake.bodies == []


# Against the session's real `vllm serve` replica (tests/engines/conftest.py).


async def _server_running(url: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.get("/metrics")
    return parse_metrics(response.text).running


async def test_closing_a_real_stream_aborts_the_request_in_the_server(
    vllm_remote: VllmRemoteEngine, vllm_server: str
) -> None:
    sampling = SamplingSpec(max_tokens=1500, temperature=1.0, ignore_eos=True)
    stream = vllm_remote.generate(
        EngineRequest(request_id="remote-cancel", prompt_token_ids=tuple(range(300, 320)), sampling=sampling)
    )
    assert (await anext(stream)).finish_reason is None
    assert (await anext(stream)).finish_reason is None
    # vLLM updates its gauges once per engine step: poll its own /metrics, bounded.
    async with asyncio.timeout(30):
        while await _server_running(vllm_server) != 1:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)
    await stream.aclose()
    assert vllm_remote.in_flight == 0
    async with asyncio.timeout(30):
        while await _server_running(vllm_server) != 0:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)


async def test_a_real_server_takes_priority_and_cache_salt(vllm_remote: VllmRemoteEngine) -> None:
    req = EngineRequest(
        request_id="remote-salted",
        prompt_token_ids=tuple(range(300, 320)),
        sampling=SamplingSpec(max_tokens=2, temperature=0.0),
        priority=-3,
        cache_salt="tenant-a",
    )
    deltas = [d async for d in vllm_remote.generate(req)]
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage is not None
    assert deltas[-1].usage.completion_tokens == 2


# What a client can shape (sampling fields, stop strings, schemas) must never look like a draining replica (a
# stream with no token and no finish): that takes the replica out of routing for every tenant. Each request
# below either finishes (possibly with no text) or fails as the request's own error.
EOS = 2  # SmolLM2's <|im_end|>
_CLIENT_SHAPES = {
    "one_token": SamplingSpec(max_tokens=1, temperature=0.0),
    "eos_forced_first": SamplingSpec(max_tokens=8, temperature=0.0, logit_bias=((EOS, 100.0),)),
    "min_tokens_at_max": SamplingSpec(max_tokens=3, min_tokens=3, temperature=0.0),
    # The first greedy token of both prompts below is "k" or "-": a stop hit at once, nothing streamed.
    "stop_on_the_first_token": SamplingSpec(max_tokens=8, temperature=0.0, stop=("k", "-", " ", "\n")),
    "empty_stop_string": SamplingSpec(max_tokens=8, temperature=1.0, seed=7, stop=("",), top_k=1),
    "impossible_schema": SamplingSpec(
        max_tokens=8,
        temperature=0.0,
        constraint=OutputConstraint(
            kind="json_schema", schema='{"type": "string", "minLength": 3, "maxLength": 1}'
        ),
    ),
    "empty_enum": SamplingSpec(
        max_tokens=8, temperature=0.0, constraint=OutputConstraint(kind="json_schema", schema='{"enum": []}')
    ),
    "every_logprob": SamplingSpec(max_tokens=2, temperature=2.0, top_p=0.01, logprobs=20, min_p=1.0),
}


@pytest.mark.parametrize("shape", sorted(_CLIENT_SHAPES))
async def test_no_client_shaped_request_makes_a_real_replica_look_like_it_is_draining(
    vllm_remote: VllmRemoteEngine, shape: str
) -> None:
    prompts = {"eos_prompt": (EOS,) * 4, "plain": tuple(range(300, 320))}
    for name, prompt in prompts.items():
        req = EngineRequest(
            request_id=f"shape-{shape}-{name}", prompt_token_ids=prompt, sampling=_CLIENT_SHAPES[shape]
        )
        try:
            deltas = [d async for d in vllm_remote.generate(req)]
        except EngineDeadError as exc:
            pytest.fail(f"{shape}/{name}: a client-shaped request failed as the replica's failure: {exc!r}")
        except EngineRequestError:
            continue  # the request's own error (vLLM's 400): no mark on the replica
        assert deltas[-1].finish_reason is not None, (shape, name)
