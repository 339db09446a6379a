"""Engine step benchmark: abort latency and the inter-token latency of running streams when a long prompt
arrives, with the measured step budget next to unchunked prefill (one step for the whole prompt), and per
dtype. Each configuration starts its own vLLM engine on the default model.

    python -m ops.bench.steps [--dtype auto float32 bfloat16] [--budget 0 2048] [--prompt 1500] [--aborts 8]

Prefill aborts close the stream at a random point of a long prompt's prefill; decode aborts after five
tokens. `--budget 0` is the measured budget for `--target` seconds per step (cached per host after the first
measurement); a budget equal to the context (2048) prefills any prompt in one step, as before chunking. Run
by hand, not in CI: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec

from engines.base import EngineRequest, SamplingSpec
from engines.host import DtypeChoice
from engines.vllm_local import VllmLocalEngine
from ops.models.prepare import DEFAULT_MODEL_NAME

MAX_MODEL_LEN = 2048


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """The figures of one engine configuration, in seconds."""

    dtype: str
    budget: int
    decode_itl: float
    long_ttft: float
    itl_p50_during_long: float
    itl_max_during_long: float
    abort_prefill_p50: float
    abort_prefill_p99: float
    abort_decode_p50: float
    abort_decode_p99: float


def _request(prompt_len: int, max_tokens: int) -> EngineRequest:
    rng = random.Random()
    return EngineRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tuple(rng.randrange(1_000, 30_000) for _ in range(prompt_len)),
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=uuid.uuid4().hex,  # nothing comes from the prefix cache
    )


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def _idle(engine: VllmLocalEngine) -> None:
    """Until the engine core holds no KV block: it refuses to reset its prefix cache before (a call it takes
    between steps, so this sees the abort land, not just the front end forgetting the request)."""
    while not await engine.llm.reset_prefix_cache():
        pass


async def _abort_latency(
    engine: VllmLocalEngine, prompt_len: int, *, tokens: int = 0, delay: float = 0.0
) -> float:
    """Seconds from closing a request's stream to vLLM holding nothing of it. Closed after `tokens` decoded
    tokens (decode), or `delay` seconds into its prefill (prefill)."""
    stream = engine.generate(_request(prompt_len, max(tokens, 1) + 64))
    if tokens:
        async for _ in stream:
            tokens -= 1
            if tokens <= 0:
                break
    else:
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(delay)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
    began = time.perf_counter()
    await stream.aclose()
    await _idle(engine)
    return time.perf_counter() - began


async def _measure(engine: VllmLocalEngine, prompt_len: int, aborts: int) -> Row:
    arrivals: list[float] = []
    async for _ in engine.generate(_request(16, 65)):
        arrivals.append(time.perf_counter())
    decode_itl = statistics.median(b - a for a, b in itertools.pairwise(arrivals[1:]))

    began = time.perf_counter()
    async for _ in engine.generate(_request(prompt_len, 1)):
        pass
    long_ttft = time.perf_counter() - began

    # Two streams decode; a long prompt arrives; their inter-token gaps while it is prefilled.
    gaps: list[float] = []
    window = [0.0, float("inf")]

    async def decode() -> None:
        last = None
        async for _ in engine.generate(_request(16, MAX_MODEL_LEN - 32)):
            now = time.perf_counter()
            if last is not None and window[0] <= now and last <= window[1]:
                gaps.append(now - last)
            last = now

    streams = [asyncio.create_task(decode()) for _ in range(2)]
    await asyncio.sleep(1.0)
    window[0] = time.perf_counter()
    async for _ in engine.generate(_request(prompt_len, 1)):
        pass
    window[1] = time.perf_counter()
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    await _idle(engine)

    # Closed at a random point of the prefill (seeded: every configuration sees the same points).
    rng = random.Random(7)
    prefill = [
        await _abort_latency(engine, prompt_len, delay=rng.uniform(0.1, 0.9) * long_ttft)
        for _ in range(aborts)
    ]
    decode_aborts = [await _abort_latency(engine, 16, tokens=5) for _ in range(aborts)]
    return Row(
        dtype=str(engine.dtype),
        budget=engine.max_num_batched_tokens,
        decode_itl=decode_itl,
        long_ttft=long_ttft,
        itl_p50_during_long=statistics.median(gaps) if gaps else 0.0,
        itl_max_during_long=max(gaps, default=0.0),
        abort_prefill_p50=_pct(prefill, 0.5),
        abort_prefill_p99=_pct(prefill, 0.99),
        abort_decode_p50=_pct(decode_aborts, 0.5),
        abort_decode_p99=_pct(decode_aborts, 0.99),
    )


async def run(
    model_dir: Path,
    dtypes: Sequence[DtypeChoice],
    budgets: Sequence[int],
    target: float,
    prompt: int,
    aborts: int,
) -> list[Row]:
    """One row per (dtype, budget), each on an engine of its own."""
    rows = []
    for dtype, budget in itertools.product(dtypes, budgets):
        engine = VllmLocalEngine(
            model_dir,
            model_name=DEFAULT_MODEL_NAME,
            max_model_len=MAX_MODEL_LEN,
            dtype=dtype,
            max_num_batched_tokens=budget,
            step_target_s=target,
        )
        await engine.start()
        try:
            rows.append(await _measure(engine, prompt, aborts))
        finally:
            await engine.shutdown()
        print(_line(rows[-1]), flush=True)
    return rows


_HEADER = (
    "dtype", "budget", "decode ITL", "TTFT long", "ITL p50 (long)", "ITL max (long)",
    "abort prefill p50", "p99", "abort decode p50", "p99",
)  # fmt: skip


def _line(row: Row) -> str:
    figures = msgspec.structs.astuple(row)
    cells = [str(figures[0]), str(figures[1]), *(f"{value:.3f}" for value in figures[2:])]
    return "| " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run every configuration, print a Markdown table (seconds)."""
    parser = argparse.ArgumentParser(prog="python -m ops.bench.steps", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--budget", nargs="+", type=int, default=[0, MAX_MODEL_LEN])
    parser.add_argument("--target", type=float, default=0.5, help="seconds per step for budget 0")
    parser.add_argument("--prompt", type=int, default=1500, help="tokens of the long prompt")
    parser.add_argument("--aborts", type=int, default=8, help="aborts measured per phase")
    args = parser.parse_args(argv)
    data_dir = Path(os.environ.get("LOCKGATE_MODEL__DATA_DIR", "~/.cache/lockgate/models")).expanduser()
    model_dir = data_dir / DEFAULT_MODEL_NAME
    print(f"engine step benchmark: {args.prompt}-token prompt, {os.cpu_count()} CPUs, seconds")
    print("| " + " | ".join(_HEADER) + " |")
    print("|" + "---|" * len(_HEADER))
    asyncio.run(run(model_dir, args.dtype, args.budget, args.target, args.prompt, args.aborts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
