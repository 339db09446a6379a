"""The output guard's CPU per generated token: bounded windows against re-reading the whole output.

    python -m ops.bench.guard_windows [--tokens 256 2048] [--hold-back 8] [--check-every 16] [--answers 5]

Each answer is a stream of one-token deltas (English-like words) moderated as a streamed response is
(`guard.moderator.moderate`, the default policy's `hold_back` and `check_every`), every check scored by the
default policy's rules stage through the cascade and the policy's decision (`guard.cascade`,
`policy.safety.decision`): the guard work a request does on the gateway's CPU whatever model stages follow.
Two schemes on the same answers and scorer:

- `windows`: what the gateway does, each check scores what the moderator holds (about check_every +
  hold_back tokens);
- `re-read`: what it did before, each check scores the whole output so far (the bench keeps the text as it
  passes and hands the scorer that instead of the window).

It prints, per answer length and scheme, the CPU per generated token (process time, the fastest of
`--answers` runs, which damps the noise of a shared machine), the checks and the tokens scored per generated
token (what the tenant is charged as `usage.guard_tokens`, at price factor 1). Figures are printed, never
asserted: on a shared machine they move by tens of percent between runs, the ratio between schemes much less.
A model stage's cost per check grows with the tokens it scores like the rules stage's, only more: the tokens
scored per generated token is the figure that carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncGenerator, Sequence

from engines.base import EngineDelta
from guard.base import GuardInput, Span
from guard.moderator import moderate
from ops.eval.cascades import policy_cascade
from policy.safety.decision import decide
from policy.safety.defaults import rules_policy
from registry.models import PolicySpec

_TEXT = (
    "the river ran past the old mill and the children watched boats drift by while a dog barked at gulls "
    "over the harbour wall where fishermen mended nets and talked about the weather and the price of bread"
)
_WORDS = tuple(_TEXT.split())


def answer(tokens: int, seed: int) -> list[EngineDelta]:
    """`tokens` one-token deltas of harmless words (the last one finishes)."""
    rng = random.Random(seed)
    return [
        EngineDelta(
            token_ids=(i,), text=" " + rng.choice(_WORDS), finish_reason="stop" if i == tokens - 1 else None
        )
        for i in range(tokens)
    ]


class Scorer:
    """The default policy's rules stage, its cascade and decision: one check of one text."""

    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
        self.categories = tuple(c.name for c in spec.categories)
        self.cascade = policy_cascade(spec)

    async def score(self, text: str) -> None:
        item = GuardInput(
            direction="output", spans=(Span(text=text, source="output"),), categories=self.categories
        )
        decision = decide(await self.cascade.run(item), self.spec, "output")
        if decision.action != "allow":
            raise AssertionError(f"the bench's harmless answer was not allowed: {decision}")


async def _stream(deltas: Sequence[EngineDelta], seen: list[str]) -> AsyncGenerator[EngineDelta, None]:
    for delta in deltas:
        seen.append(delta.text)
        yield delta


async def moderated(
    deltas: Sequence[EngineDelta], scorer: Scorer, *, re_read: bool, hold_back: int, check_every: int
) -> tuple[float, int, int]:
    """(CPU seconds, checks, tokens scored) of moderating one answer under one scheme."""
    seen: list[str] = []  # the output so far, as the old scheme re-read it (one token per delta)
    checks = scored = window = 0

    def told(tokens: int) -> None:
        nonlocal window
        window = tokens

    async def check(text: str, decoded: str, final: bool) -> None:
        nonlocal checks, scored
        checks += 1
        if re_read:
            # The whole output so far: every delta received (the moderator has not released past it).
            scored += len(seen)
            await scorer.score("".join(seen))
        else:
            scored += window
            await scorer.score(text)

    began = time.process_time()
    async for _ in moderate(
        _stream(deltas, seen), check, hold_back=hold_back, check_every=check_every, scored=told
    ):
        pass
    return time.process_time() - began, checks, scored


async def run(lengths: Sequence[int], answers: int, hold_back: int, check_every: int) -> list[str]:
    """The printed lines: one per answer length and scheme."""
    scorer = Scorer(rules_policy())
    lines = [
        f"output guard, default rules policy, hold_back {hold_back}, check_every {check_every}, "
        f"fastest of {answers} answers:"
    ]
    for tokens in lengths:
        texts = [answer(tokens, seed) for seed in range(answers)]
        figures = {}
        for scheme, re_read in (("re-read", True), ("windows", False)):
            runs = [
                await moderated(t, scorer, re_read=re_read, hold_back=hold_back, check_every=check_every)
                for t in texts
            ]
            cpu = min(r[0] for r in runs)
            _, checks, scored = runs[0]
            figures[scheme] = cpu
            lines.append(
                f"{tokens:>5} tokens, {scheme:<7}: {cpu / tokens * 1e6:8.1f} us guard CPU per generated "
                f"token, {checks} checks, {scored / tokens:6.2f} tokens scored per generated token"
            )
        lines.append(
            f"{tokens:>5} tokens: windows cost {figures['windows'] / figures['re-read']:.2f}x the re-reads"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--answers", type=int, default=5)
    spec = rules_policy()
    parser.add_argument("--hold-back", type=int, default=spec.hold_back_tokens)
    parser.add_argument("--check-every", type=int, default=spec.check_every_tokens)
    args = parser.parse_args(argv)
    for line in asyncio.run(run(args.tokens, args.answers, args.hold_back, args.check_every)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
