"""The requests of a run, decided before it starts: when each arrives, whose it is, its lengths and whether
the client cancels it. One seed gives the same plan every time."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import msgspec

from ops.bench.load.arrivals import arrival_times
from ops.bench.load.workload import Fixed, Length, LogNormal, Priority, Tenant, Uniform, Workload

# Everyday sentences of short common words, about one token per word in the usual BPE vocabularies: a prompt
# of N words is about N tokens (plus the chat template's own). Sentences, not words drawn at random: word
# salad reads to a safety guard like nothing a user writes, and the default cascade blocks it at the input,
# so a bench of it would measure refusals, not serving (2026-12-06: 31 of 31 blocked).
_SENTENCES = (
    "The weather was mild this morning and the park was quiet.",
    "We planted tomatoes and basil in the garden last spring.",
    "My sister is learning to play the piano on weekends.",
    "The train to the city leaves every twenty minutes.",
    "Our team meeting moved to Thursday afternoon.",
    "The library opens at nine and closes at six.",
    "He baked a loaf of bread with whole wheat flour.",
    "The children drew pictures of boats and birds.",
    "A cup of tea is nice after a long walk.",
    "The museum has a new exhibit about old maps.",
    "She wrote a short note to thank her neighbour.",
    "The river was high after the rain.",
    "We watched a film about the ocean and its fish.",
    "The bakery on the corner sells fresh bread every day.",
    "They painted the kitchen a pale shade of green.",
    "The bus was late, so we walked home together.",
)


class Planned(msgspec.Struct, frozen=True, kw_only=True):
    """One request of the plan."""

    index: int
    at: float  # seconds from the start of the run
    tenant: str
    api_key: str
    priority: Priority
    prompt_words: int
    prompt_seed: int  # the prompt is built when sent: a long run's prompts are never all in memory
    max_tokens: int
    cancel_after: int | None  # content chunks before the client closes the stream; None: read to the end

    def prompt(self) -> str:
        """The request's synthetic prompt."""
        return synthetic_prompt(self.index, self.prompt_words, random.Random(self.prompt_seed))


def draw(length: Length, rng: random.Random) -> int:
    """One value of a length distribution."""
    if isinstance(length, Fixed):
        return length.value
    if isinstance(length, Uniform):
        return rng.randint(length.low, length.high)
    assert isinstance(length, LogNormal)
    value = round(rng.lognormvariate(math.log(length.median), length.sigma))
    return min(length.high, max(length.low, value))


def synthetic_prompt(index: int, words: int, rng: random.Random) -> str:
    """About `words` tokens of everyday filler text (`words` words, the tag first). The request's own tag
    comes first, so no two prompts share a prefix and a prefix cache cannot skip their prefill."""
    tag = f"[{index}-{rng.getrandbits(48):012x}]"
    body: list[str] = []
    while len(body) < words - 1:
        body += rng.choice(_SENTENCES).split()
    return " ".join([tag, *body[: max(0, words - 1)]])


def _pick(tenants: Sequence[Tenant], rng: random.Random) -> Tenant:
    return rng.choices(tenants, weights=[t.weight for t in tenants])[0]


def make_plan(workload: Workload) -> list[Planned]:
    """Every request of the run, in order of arrival."""
    if not workload.tenants:
        raise ValueError("the workload has no tenants (give --api-key or [[tenants]])")
    rng = random.Random(workload.seed)
    count, duration = workload.limit()
    times = arrival_times(workload.arrival, rng, count=count, duration=duration)
    plan: list[Planned] = []
    for index, at in enumerate(times):
        tenant = _pick(workload.tenants, rng)
        words = draw(tenant.prompt_tokens or workload.prompt_tokens, rng)
        cancel = rng.random() < workload.cancel_fraction
        plan.append(
            Planned(
                index=index,
                at=at,
                tenant=tenant.name,
                api_key=tenant.api_key,
                priority=tenant.priority,
                prompt_words=words,
                prompt_seed=rng.getrandbits(64),
                max_tokens=draw(tenant.output_tokens or workload.output_tokens, rng),
                cancel_after=draw(workload.cancel_after, rng) if cancel else None,
            )
        )
    return plan
