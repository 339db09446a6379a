"""The chunked-prefill budget that keeps one vLLM engine step within a time target on this host, measured.

vLLM aborts a request only between engine steps, and every running stream waits for the step in progress:
one long prefill in a single step stalls everyone (on a 2-core AVX2 CPU a 1,500-token prompt was one 19 s
step in bf16). vLLM's `max_num_batched_tokens` caps the tokens of one step, so a long prompt is prefilled in
chunks. How many tokens fit in a time target depends on the host, so it is measured on the engine itself:

1. decode probe: a one-sequence decode, whose step time `d` is the fixed cost of a step;
2. prefill probe: a prompt as long as the context, prefilled in chunks of the probe budget `b0`; the last
   chunks attend to the whole context, so they are the slowest a step of that size gets. Their time is
   `d + b0 * c`, which gives `c`, the worst cost of one more token in a step.

The budget for a target `T` is `(T - d) / c` tokens, rounded down to a multiple of 16 (vLLM's block size)
and never below `max_num_seqs` (vLLM requires it). The profile is cached per host, dtype and model, so only
the first start on a host pays for it (two engine starts and about one context's prefill).
"""

from __future__ import annotations

import itertools
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("lockgate.engine")

# Chunk size of the prefill probe: small enough to be several steps of a 2,048-token context, large enough
# that the per-token cost dominates the fixed cost of a step.
PROBE_BUDGET = 128
_ALIGN = 16


class StepProfile(msgspec.Struct, frozen=True, kw_only=True):
    """How long engine steps take on one host, for one model and dtype."""

    host: str
    # Seconds of one decode step with one sequence: the fixed cost of any step.
    decode_step_s: float
    # Chunk size the prefill probe ran with, and the seconds each of its steps took, in order.
    probe_budget: int
    chunk_steps_s: tuple[float, ...]
    measured_at: float

    @property
    def worst_token_s(self) -> float:
        """Seconds one more prompt token adds to a step at the end of the context (the slowest position)."""
        tail = sorted(self.chunk_steps_s[-3:])
        worst = tail[len(tail) // 2] if tail else self.decode_step_s
        return max(worst - self.decode_step_s, 1e-6) / self.probe_budget


def choose_budget(profile: StepProfile, target_s: float, *, max_model_len: int, floor: int) -> int:
    """Tokens per engine step that keep a step within `target_s` by `profile` (at least `floor`)."""
    spare = target_s - profile.decode_step_s
    tokens = int(spare / profile.worst_token_s) if spare > 0 else 0
    tokens -= tokens % _ALIGN
    budget = max(floor, min(tokens, max_model_len))
    if tokens < floor:
        log.warning(
            "engine steps cannot meet the %.3f s target on this host (a decode step alone takes %.3f s, one "
            "prompt token %.4f s): using the smallest budget, %d tokens",
            target_s,
            profile.decode_step_s,
            profile.worst_token_s,
            budget,
        )
    return budget


class StepClock:
    """Counts engine steps and keeps when the newest ones ended (fed by the engine's stat logger)."""

    def __init__(self, keep: int = 4096) -> None:
        self.count = 0
        self._keep = keep
        self.ends: list[float] = []

    def tick(self, now: float) -> None:
        """One engine step ended at `now` (seconds, monotonic)."""
        self.count += 1
        self.ends.append(now)
        if len(self.ends) > self._keep:
            del self.ends[: self._keep // 2]


def load_profile(path: Path) -> StepProfile | None:
    """The cached profile at `path`, or None if there is none or it is unreadable."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=StepProfile)
    except (OSError, msgspec.DecodeError):
        return None


def save_profile(path: Path, profile: StepProfile) -> None:
    """Write the profile atomically (a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(profile))
    tmp.replace(path)


def _random_prompt(n: int, rng: random.Random) -> list[int]:
    # Ids from the middle of the vocabulary: ordinary tokens, never special ones.
    return [rng.randrange(1_000, 30_000) for _ in range(n)]


async def measure_profile(
    llm: Any, steps: StepClock, *, host: str, max_model_len: int, probe_budget: int = PROBE_BUDGET
) -> StepProfile:
    """Measure a `StepProfile` on a started `AsyncLLM` whose budget is `probe_budget`; nothing else may run
    on it meanwhile. `steps` must be fed by that engine's stat logger."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random()
    salt = f"probe-{rng.getrandbits(64):x}"  # never reuses a prefix cached by traffic or an earlier probe

    async def run(prompt: list[int], max_tokens: int, name: str) -> list[float]:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        arrivals = []
        request = {"prompt_token_ids": prompt, "cache_salt": salt}
        async for _ in llm.generate(request, params, f"{salt}-{name}"):
            arrivals.append(time.perf_counter())
        return arrivals

    await run(_random_prompt(8, rng), 2, "warm")
    arrivals = await run(_random_prompt(16, rng), 17, "decode")
    decode_s = statistics.median(b - a for a, b in itertools.pairwise(arrivals))
    first = len(steps.ends)
    await run(_random_prompt(max_model_len - 2, rng), 1, "prefill")
    ends = steps.ends[first:]
    chunk_steps = tuple(b - a for a, b in itertools.pairwise(ends))
    profile = StepProfile(
        host=host,
        decode_step_s=decode_s,
        probe_budget=probe_budget,
        chunk_steps_s=chunk_steps,
        measured_at=time.time(),
    )
    log.info(
        "measured engine steps: decode %.3f s, prefill chunks of %d tokens %.3f-%.3f s",
        decode_s,
        probe_budget,
        min(chunk_steps, default=0.0),
        max(chunk_steps, default=0.0),
    )
    return profile
