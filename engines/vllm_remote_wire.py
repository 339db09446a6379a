"""What crosses the wire to a `vllm serve` replica: its config, the request bodies, the response events and
the figures read from its Prometheus metrics (names as vLLM 0.32's OpenAI server uses them)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from engines.base import EngineRequest, EngineRequestError


class RemoteEngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the replica is and how long to wait for it (seconds)."""

    url: str
    # The name the server was started with (`--served-model-name`); start() refuses a replica without it.
    served_model: str
    max_model_len: int
    connect_timeout: float = 5.0
    # Request sent -> the response's status line (vLLM answers a stream's before it queues the request; a
    # free connection is waited for within it too). Past it the replica counts as failed, and the request
    # fails over before its first token: a server tearing down after a drain takes requests and never
    # answers them.
    response_timeout: float = 10.0
    # Request sent -> first stream event: queueing plus a whole prefill (up to max_model_len on a slow CPU).
    first_token_timeout: float = 60.0
    # Longest gap between two stream events once the stream has begun; past it the request fails.
    token_timeout: float = 30.0
    # Connections kept to the replica: the most requests in flight there at once; more wait for a free
    # connection up to response_timeout, then fail as overloaded.
    pool_size: int = 64
    metrics_interval: float = 1.0
    # start(): the longest to wait for /health (a CPU server takes 30-40 s to load).
    start_timeout: float = 120.0
    # Told to callers when the replica is unreachable.
    retry_after: float = 5.0
    # The server runs `--scheduling-policy priority`: send each request's priority (vLLM refuses a nonzero
    # priority otherwise, so False leaves it out and every request runs first come, first served).
    priority_scheduling: bool = True
    # The server's `--max-num-seqs` (its default depends on the device): the gateway sends it at most that
    # many sequences (and `routing.replicas.engine_queue` more), so requests beyond what it runs wait in the
    # gateway's fair queue rather than in vLLM's. 0 = not known: every request the KV budget allows goes.
    max_num_seqs: Annotated[int, msgspec.Meta(ge=0)] = 0


class LogprobsWire(msgspec.Struct):
    """Logprobs of a completion choice (keys are `token_id:<id>`)."""

    top_logprobs: list[dict[str, float] | None] = []
    token_logprobs: list[float | None] = []


class ChoiceWire(msgspec.Struct):
    """One choice of a completion event (`token_ids` with `return_token_ids`)."""

    text: str = ""
    token_ids: list[int] | None = None
    logprobs: LogprobsWire | None = None
    finish_reason: str | None = None


class PromptDetailsWire(msgspec.Struct):
    """`usage.prompt_tokens_details` (with `--enable-prompt-tokens-details`)."""

    cached_tokens: int | None = None


class UsageWire(msgspec.Struct):
    """The usage event (with `stream_options.include_usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptDetailsWire | None = None


class ErrorWire(msgspec.Struct):
    """The error of an error answer or a failed stream."""

    message: str = ""


class ChunkWire(msgspec.Struct):
    """One SSE event of a streamed completion, or a whole completion answer, or an error answer."""

    choices: list[ChoiceWire] = []
    usage: UsageWire | None = None
    error: ErrorWire | None = None


class ModelWire(msgspec.Struct):
    """One model of /v1/models."""

    id: str


class ModelsWire(msgspec.Struct):
    """The /v1/models answer."""

    data: list[ModelWire] = []


CHUNK = msgspec.json.Decoder(ChunkWire)
MODELS = msgspec.json.Decoder(ModelsWire)
ENCODE = msgspec.json.Encoder()
JSON_HEADERS = {"content-type": "application/json"}
_TOKEN_ID = re.compile(r"token_id:(-?\d+)")


class ServerMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """The server's figures from its last /metrics scrape."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_capacity: int = 0
    steps: int = 0


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> ServerMetrics:
    """The figures `load()` needs from vLLM's Prometheus text: gauges summed over engines; KV capacity from
    `vllm:cache_config_info`'s `kv_cache_size_tokens` label (else `num_gpu_blocks` x `block_size`); steps
    from the count of the histogram `vllm:iteration_tokens_total` (vLLM observes it once per engine step).

    A small parser rather than prometheus_client: these are plain samples, and the gateway need not depend
    on the client library (it comes with vLLM, which a remote-only gateway does not install)."""
    sums: dict[str, float] = {}
    capacity = 0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:  # comments, HELP/TYPE, blank lines
            continue
        name, labels, value = match.groups()
        if name == "vllm:cache_config_info" and labels:
            found = dict(_LABEL.findall(labels))
            blocks, size = found.get("num_gpu_blocks", ""), found.get("block_size", "")
            if found.get("kv_cache_size_tokens", "").isdigit():
                capacity += int(found["kv_cache_size_tokens"])
            elif blocks.isdigit() and size.isdigit():
                capacity += int(blocks) * int(size)
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number):
            sums[name] = sums.get(name, 0.0) + number
    return ServerMetrics(
        running=int(sums.get("vllm:num_requests_running", 0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        kv_usage=sums.get("vllm:kv_cache_usage_perc", 0.0),
        kv_capacity=capacity,
        steps=int(sums.get("vllm:iteration_tokens_total_count", 0)),
    )


def token_id_of(key: str) -> int:
    """The id in a logprobs key of a server run with `return_tokens_as_token_ids` (`token_id:<id>`)."""
    match = _TOKEN_ID.fullmatch(key)
    if match is None:
        raise EngineRequestError(f"the server did not return token ids in logprobs (got {key!r})")
    return int(match.group(1))


def completion_body(req: EngineRequest, config: RemoteEngineConfig) -> dict[str, Any]:
    """The streamed /v1/completions body of a request: every SamplingSpec field, named as vLLM's server
    (`CompletionRequest`) reads it."""
    s = req.sampling
    body: dict[str, Any] = {
        "model": config.served_model,
        "prompt": list(req.prompt_token_ids),
        "request_id": req.request_id,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop": list(s.stop),
        "ignore_eos": s.ignore_eos,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "min_tokens": s.min_tokens,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,
        "logprobs": s.logprobs,
        # Ids, not text, in logprobs: the text comes from `token_text`.
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.constraint is not None:
        body["structured_outputs"] = (
            {"json_object": True} if s.constraint.kind == "json_object" else {"json": s.constraint.schema}
        )
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    if config.priority_scheduling:
        body["priority"] = req.priority
    return body


def score_body(
    prompt_token_ids: Sequence[int],
    token_ids: list[int],
    priority: int,
    config: RemoteEngineConfig,
    *,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The /v1/completions body that scores exactly `token_ids` as the first token: one greedy step with
    `logprob_token_ids` (vLLM gathers the raw log-softmax at those ids)."""
    body: dict[str, Any] = {
        "model": config.served_model,
        "prompt": list(prompt_token_ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 1,  # the server requires it with logprob_token_ids, which take precedence
        "logprob_token_ids": token_ids,
        "return_tokens_as_token_ids": True,
    }
    if config.priority_scheduling:
        body["priority"] = priority
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body
