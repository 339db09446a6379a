"""vLLM's `AsyncLLM` (V1) inside the gateway process; its engine core runs in a child process, as vLLM does.

vLLM starts its engine core with `spawn`: build this engine inside a function (the app lifespan, a fixture),
never at import time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from engines.base import (
    EngineDeadError,
    EngineDelta,
    EngineLoad,
    EngineRequest,
    EngineRequestError,
    FinishReason,
    Health,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engines.host import Dtype, DtypeChoice, detect_dtype, host_key
from engines.reaper import Reaper
from engines.step_budget import (
    PROBE_BUDGET,
    StepClock,
    StepProfile,
    choose_budget,
    load_profile,
    measure_profile,
    save_profile,
)

log = logging.getLogger("lockgate.engine")

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def offline_environment(data_dir: Path) -> dict[str, str]:
    """Environment that keeps vLLM off the network and its caches inside the project's data directory."""
    cache = data_dir.expanduser() / "cache"
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Otherwise the engine probes a public address to learn its own IP.
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        # The first logprobs request would otherwise trigger a ~20 s compile; scores are identical without it.
        "TORCHDYNAMO_DISABLE": "1",
    }


class _SchedulerStats:
    """Keeps the newest scheduler figures the engine core reported, and counts its steps (a vLLM stat logger:
    the engine core reports scheduler stats once per step)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.steps = StepClock()

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    sink.steps.tick(time.perf_counter())
                    sink.running = scheduler_stats.num_running_reqs
                    sink.waiting = scheduler_stats.num_waiting_reqs
                    sink.kv_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


def _patch_sampler() -> None:
    """Keep the top-k logprobs of other requests intact when a request with `logprob_token_ids` shares their
    engine step (vLLM 0.32's V1 sampler, the one CPU runs).

    When one request of a batch names token ids and another asks for top-k logprobs, vLLM's `Sampler` uses
    the named-ids tensors for the whole batch: the top-k request then gets token 0 at -inf in place of its
    alternatives. Here the rows that name no ids get their own top-k in those tensors instead (widened to
    the batch's largest k), which is what vLLM's top-k path computes for them. Idempotent.
    """
    import torch
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_lockgate_patched", False):
        return
    forward = Sampler.forward
    gather_named = Sampler.gather_specific_token_logprobs

    def patched_forward(self: Any, logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        self._lockgate_top_k = sampling_metadata.max_num_logprobs
        return forward(self, logits, sampling_metadata, *args, **kwargs)

    def patched_gather(
        self: Any, logprobs: Any, logprob_token_ids: dict[int, list[int]], sampled: Any
    ) -> Any:
        result = gather_named(self, logprobs, logprob_token_ids, sampled)
        top_k = getattr(self, "_lockgate_top_k", None)
        others = [row for row in range(logprobs.shape[0]) if row not in logprob_token_ids]
        if result is None or not top_k or top_k < 0 or not others:
            return result
        ids, values = result.logprob_token_ids, result.logprobs
        if ids.shape[1] < top_k + 1:  # padded columns are ignored by requests that asked for fewer
            extra = top_k + 1 - ids.shape[1]
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1)
            values = torch.cat([values, values.new_full((values.shape[0], extra), float("-inf"))], dim=1)
        rows = torch.tensor(others, dtype=torch.long, device=logprobs.device)
        top_values, top_ids = torch.topk(logprobs[rows], top_k, dim=-1)
        ids[rows, 1 : top_k + 1] = top_ids.to(ids.dtype)
        values[rows, 1 : top_k + 1] = top_values.to(values.dtype)
        return LogprobsTensors(
            logprob_token_ids=ids, logprobs=values, selected_token_ranks=result.selected_token_ranks
        )

    Sampler.forward = patched_forward  # type: ignore[method-assign]
    Sampler.gather_specific_token_logprobs = patched_gather  # type: ignore[method-assign]
    Sampler._lockgate_patched = True  # type: ignore[attr-defined]


class ScoringWorkerExtension:
    """Named in the engine args as vLLM's `worker_extension_cls`: vLLM's worker process imports this module
    to find it, which is when `_patch_sampler` runs there (see the end of this module). It adds no methods."""


class VllmLocalEngine:
    """An `Engine` backed by vLLM's in-process `AsyncLLM`."""

    def __init__(
        self,
        model_dir: Path,
        *,
        model_name: str,
        max_model_len: int,
        dtype: DtypeChoice = "auto",
        kv_cache_bytes: int = 256 << 20,
        max_logprobs: int = 20,
        enforce_eager: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 0,
        step_target_s: float = 0.5,
        profile_dir: Path | None = None,
        replica_id: str = "vllm-local-0",
    ) -> None:
        """`max_num_batched_tokens = 0` measures the budget that keeps a step within `step_target_s` (the
        profile is cached in `profile_dir`, by default beside the model directory)."""
        self.replica_id = replica_id
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._model_dir = model_dir
        self._dtype_choice = dtype
        self.dtype: Dtype | None = None
        self._kv_cache_bytes = kv_cache_bytes
        self._max_logprobs = max_logprobs
        self._enforce_eager = enforce_eager
        self._max_num_seqs = max_num_seqs
        self._budget_setting = max_num_batched_tokens
        self.step_target_s = step_target_s
        self._profile_dir = profile_dir or model_dir.parent / "cache" / "step-profiles"
        # The budget in force and the profile it came from (None when configured explicitly).
        self.max_num_batched_tokens = max_num_batched_tokens
        self.profile: StepProfile | None = None
        self._stats = _SchedulerStats()
        self._llm: Any = None
        self._kv_capacity = 0
        self._max_running = 0  # the started engine's max_num_seqs
        # Stops the engine core processes if this process is killed (engines/reaper.py).
        self._reaper: Reaper | None = None

    @property
    def llm(self) -> Any:
        """The underlying `AsyncLLM` (tests read vLLM's own state through it)."""
        if self._llm is None:
            raise EngineDeadError("the vLLM engine is not started")
        return self._llm

    @property
    def step_seconds(self) -> float | None:
        """The longest an engine step takes at the budget in force, by the measured profile (None when the
        budget was configured rather than measured); `/readyz` shows it to operators."""
        if self.profile is None:
            return None
        return self.profile.decode_step_s + self.max_num_batched_tokens * self.profile.worst_token_s

    @property
    def steps(self) -> StepClock:
        """The engine steps run so far (tests count steps instead of seconds)."""
        return self._stats.steps

    @property
    def reaper(self) -> Reaper | None:
        """The watcher that stops the engine core processes if this process dies (None while stopped)."""
        return self._reaper

    def engine_core_pids(self) -> list[int]:
        """Process ids of vLLM's engine core processes (fault tests kill them)."""
        manager = self.llm.engine_core.resources.engine_manager
        return [proc.pid for proc in manager.processes] if manager is not None else []

    async def start(self) -> None:
        """Start the engine core (blocking work runs in a thread; about 20-40 s on CPU). Without a configured
        budget, the first start on a host measures one (an extra start and a context's prefill)."""
        os.environ.update(offline_environment(self._model_dir.parent))
        self.dtype = dtype = await asyncio.to_thread(detect_dtype, self._dtype_choice)
        budget = self._budget_setting
        if not budget:
            budget = await self._measured_budget(dtype)
        if self._llm is None:
            await self._start_with(dtype, budget)
        self.max_num_batched_tokens = budget
        log.info(
            "vLLM engine %s started: dtype %s, %d tokens per step, %d sequences",
            self.replica_id,
            dtype,
            budget,
            self._max_num_seqs,
        )

    async def _start_with(self, dtype: Dtype, budget: int) -> None:
        self._reaper = reaper = await asyncio.to_thread(Reaper.start)
        try:
            self._llm = await asyncio.to_thread(self._build, dtype, budget)
        except BaseException:
            self._reaper = None
            await asyncio.to_thread(reaper.stop)
            raise
        await asyncio.to_thread(reaper.watch, self.engine_core_pids())
        cache = self._llm.vllm_config.cache_config
        self._kv_capacity = int((cache.num_gpu_blocks or 0) * cache.block_size)
        self._max_running = int(self._llm.vllm_config.scheduler_config.max_num_seqs)

    async def _measured_budget(self, dtype: Dtype) -> int:
        """The budget for the step target from this host's cached profile, measured first if there is none.
        Leaves the engine running when the measured budget is the probe's own."""
        import vllm

        floor = max(16, self._max_num_seqs)
        key = host_key(dtype, str(self._model_dir.resolve()), vllm.__version__, str(self.max_model_len))
        path = self._profile_dir / f"{key}.json"
        profile = await asyncio.to_thread(load_profile, path)
        probe = max(PROBE_BUDGET, floor)
        if profile is None:
            await self._start_with(dtype, probe)
            profile = await measure_profile(
                self._llm, self._stats.steps, host=key, max_model_len=self.max_model_len, probe_budget=probe
            )
            await asyncio.to_thread(save_profile, path, profile)
        self.profile = profile
        budget = choose_budget(profile, self.step_target_s, max_model_len=self.max_model_len, floor=floor)
        if self._llm is not None and budget != probe:
            await self.shutdown()
        return budget

    def _build(self, dtype: Dtype, budget: int) -> Any:
        from vllm.config.structured_outputs import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self._model_dir),
            dtype=dtype,
            max_model_len=self.max_model_len,
            enforce_eager=self._enforce_eager,
            max_logprobs=self._max_logprobs,
            kv_cache_memory_bytes=self._kv_cache_bytes,
            # Chunked prefill: a long prompt is prefilled over several steps of at most `budget` tokens, so
            # an abort (taken between steps) and the other streams' next tokens wait one bounded step.
            enable_chunked_prefill=True,
            max_num_batched_tokens=budget,
            max_num_seqs=self._max_num_seqs,
            # vLLM's default "fcfs" accepts a request's priority and silently ignores it; only "priority"
            # orders the waiting queue by it (lower first), so guard calls can go ahead of batch work.
            scheduling_policy="priority",
            # Loads this module in the worker process, whose sampler it patches (see _patch_sampler).
            worker_extension_cls=f"{__name__}.{ScoringWorkerExtension.__qualname__}",
            disable_log_stats=False,
            enable_log_requests=False,
            # The gateway checks JSON schemas against xgrammar's support before a request gets here
            # (gateway/generation/structured.py), so the engine must use exactly that backend.
            # Compact JSON (xgrammar reads this from the engine config, not per request): a small model left
            # free whitespace may loop on newlines until max_tokens.
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True
            ),
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])

    def _sampling_params(self, req: EngineRequest) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        if req.n != 1:
            raise EngineRequestError("an engine generates one choice per request (see engines.choices)")
        s = req.sampling
        structured = None
        if s.constraint is not None:
            if s.constraint.kind == "json_object":
                structured = StructuredOutputsParams(json_object=True)
            else:
                structured = StructuredOutputsParams(json=s.constraint.schema)
        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            logprobs=s.logprobs,
            ignore_eos=s.ignore_eos,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
            min_tokens=s.min_tokens,
            logit_bias=dict(s.logit_bias) or None,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )

    async def _engine_input(self, req: EngineRequest) -> Any:
        """The token prompt through vLLM's renderer (passing raw prompt dicts to generate() is deprecated)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        parsed = parse_model_prompt(self.llm.model_config, prompt)
        (engine_input,) = await self.llm.renderer.render_cmpl_async([parsed])
        return engine_input

    async def _outputs(self, req: EngineRequest, params: Any) -> AsyncGenerator[Any, None]:
        """vLLM's `RequestOutput`s of one request, its errors mapped onto ours. Closing this iterator before
        the request finished aborts it in the engine core."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError
        from vllm.v1.engine.exceptions import EngineGenerateError

        if len(req.prompt_token_ids) + req.sampling.max_tokens > self.max_model_len:
            raise EngineRequestError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.sampling.max_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens"
            )
        llm = self.llm
        if llm.errored:
            raise EngineDeadError("the vLLM engine core is dead")
        try:
            engine_input = await self._engine_input(req)
        except VllmDeadError as exc:
            raise EngineDeadError(str(exc)) from exc
        except (VLLMClientError, ValueError) as exc:
            raise EngineRequestError(str(exc) or type(exc).__name__) from exc
        # Priorities apply because the engine runs with scheduling_policy="priority" (see _build).
        stream = llm.generate(engine_input, params, req.request_id, priority=req.priority)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        except VllmDeadError as exc:
            raise EngineDeadError(str(exc)) from exc
        except (VLLMClientError, EngineGenerateError, ValueError) as exc:
            raise EngineRequestError(str(exc) or type(exc).__name__) from exc
        finally:
            if not finished and not llm.errored:
                # Closed or cancelled early, possibly while vLLM was still adding the request (when its own
                # generator cannot abort it yet). Aborting an id vLLM no longer knows is a no-op. A dead
                # engine core takes no abort (its requests are gone with it).
                await llm.abort(req.request_id)
            await stream.aclose()

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineDelta, None]:
        """Stream deltas from vLLM. Closing this iterator aborts the request in the engine core."""
        completion_tokens = 0
        try:
            params = self._sampling_params(req)
        except ValueError as exc:  # vLLM validates sampling parameters as it builds them
            raise EngineRequestError(f"invalid sampling parameters: {exc}") from exc
        outputs = self._outputs(req, params)
        try:
            async for out in outputs:
                completion = out.outputs[0]
                token_ids = tuple(completion.token_ids)
                completion_tokens += len(token_ids)
                finish: FinishReason | None = None
                usage = None
                if out.finished:
                    finish = _FINISH.get(completion.finish_reason or "", "stop")
                    usage = Usage(
                        prompt_tokens=len(req.prompt_token_ids),
                        completion_tokens=completion_tokens,
                        cached_tokens=out.num_cached_tokens or 0,
                    )
                yield EngineDelta(
                    token_ids=token_ids,
                    text=completion.text,
                    logprobs=_logprobs(token_ids, completion.logprobs, req.sampling.logprobs),
                    finish_reason=finish,
                    usage=usage,
                )
        finally:
            await outputs.aclose()

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """Log-probabilities of exactly `token_ids` as the first generated token: one greedy step with
        vLLM's `logprob_token_ids` (raw log-softmax of the logits, gathered at those ids)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        wanted = list(dict.fromkeys(token_ids))
        if not wanted:
            raise EngineRequestError("no token ids to score")
        req = EngineRequest(
            request_id=f"score-{os.urandom(8).hex()}",
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=SamplingSpec(max_tokens=1, temperature=0.0),
            priority=priority,
            cache_salt=cache_salt,
        )
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprob_token_ids=wanted,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        found: dict[int, Any] = {}
        outputs = self._outputs(req, params)
        try:
            async for out in outputs:
                positions = out.outputs[0].logprobs if out.outputs else None
                if positions:
                    found = dict(positions[0])
        finally:
            await outputs.aclose()
        missing = [t for t in wanted if t not in found]
        if missing:
            raise EngineRequestError(f"the engine returned no logprob for token ids {missing}")
        return {t: float(found[t].logprob) for t in wanted}

    async def load(self) -> EngineLoad:
        """Load from vLLM's scheduler stats; an engine with no unfinished request is idle."""
        if self._llm is None or self._llm.get_num_unfinished_requests() == 0:
            return EngineLoad(
                running=0,
                waiting=0,
                kv_tokens_used=0,
                kv_tokens_capacity=self._kv_capacity,
                steps=self._stats.steps.count,
                max_running=self._max_running,
            )
        unfinished = self._llm.get_num_unfinished_requests()
        return EngineLoad(
            steps=self._stats.steps.count,
            running=self._stats.running,
            # Requests the front end holds that the engine core has not reported running yet are waiting.
            waiting=max(self._stats.waiting, unfinished - self._stats.running),
            kv_tokens_used=int(self._stats.kv_usage * self._kv_capacity),
            kv_tokens_capacity=self._kv_capacity,
            max_running=self._max_running,
        )

    async def health(self) -> Health:
        """Ready once started, until the engine core dies or is shut down."""
        if self._llm is None:
            return Health(ready=False, detail="not started")
        if self._llm.errored:
            return Health(ready=False, detail="engine core is dead")
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        try:
            await self._llm.check_health()
        except VllmDeadError as exc:
            return Health(ready=False, detail=f"{type(exc).__name__}: {exc}")
        return Health(ready=True, step_seconds=self.step_seconds)

    async def shutdown(self) -> None:
        """Abort every request and stop the engine core and its worker processes."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        from vllm.v1.engine.exceptions import EngineDeadError as VllmDeadError

        # Keys are vLLM's internal request ids (hence internal=True). A dead engine core takes no abort.
        states = llm.output_processor.request_states
        if states and not llm.errored:
            await llm.abort(list(states), internal=True)
        if states:
            # vLLM's shutdown cancels the output handler that would fail these: fail them here, or their
            # streams would wait forever.
            llm.output_processor.propagate_error(VllmDeadError())
        reaper, self._reaper = self._reaper, None
        try:
            await asyncio.to_thread(llm.shutdown)
        finally:
            if reaper is not None:
                await asyncio.to_thread(reaper.stop)


def _logprobs(token_ids: tuple[int, ...], raw: Any, top_n: int | None) -> tuple[TokenLogprob, ...] | None:
    """Convert vLLM's per-position {token_id: Logprob} dicts, keeping the top `top_n` by rank."""
    if top_n is None or raw is None:
        return None
    result = []
    for token_id, alternatives in zip(token_ids, raw, strict=False):
        chosen = alternatives[token_id]
        ranked = sorted(alternatives.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
        result.append(
            TokenLogprob(
                token_id=token_id,
                token=chosen.decoded_token or "",
                logprob=max(chosen.logprob, -9999.0),
                top=tuple(
                    TopLogprob(token_id=tid, token=lp.decoded_token or "", logprob=max(lp.logprob, -9999.0))
                    for tid, lp in ranked
                ),
            )
        )
    return tuple(result)


# vLLM's worker resolves `ScoringWorkerExtension` by importing this module: patch its sampler then. The
# service process imports this module long before vLLM (which it loads lazily), so it is left alone.
if "vllm.v1.worker.worker_base" in sys.modules:
    _patch_sampler()
