"""Fake classifiers for cascade and gate tests: scripted scores, failures and hangs."""

from __future__ import annotations

import asyncio

from guard.base import GuardError, GuardInput, GuardInputError, GuardScore


class Scripted:
    """Answers a fixed score (or raises GuardError when `fail` is set), counting calls."""

    def __init__(self, name: str, p_unsafe: float, category: str = "", *, fail: bool = False) -> None:
        self.name = name
        self.p_unsafe = p_unsafe
        self.category = category
        self.fail = fail
        self.calls = 0

    async def classify(self, item: GuardInput) -> GuardScore:
        """The scripted score, or GuardError."""
        self.calls += 1
        if self.fail:
            raise GuardError(f"{self.name} is down")
        return GuardScore(p_unsafe=self.p_unsafe, category=self.category, guard=self.name, model="fake@1")


class Hanging:
    """Never answers until released: a guard that stalls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = asyncio.Event()

    async def classify(self, item: GuardInput) -> GuardScore:
        """Wait for `release`, then answer safe."""
        await self.release.wait()
        return GuardScore(p_unsafe=0.0, guard=self.name)


class Sized(Hanging):
    """A guard that stalls and knows its one-call size: an item of more than `limit` bytes is oversized."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__(name)
        self.limit = limit

    def oversized(self, item: GuardInput) -> bool:
        """More than `limit` bytes of text."""
        return len(item.text().encode()) > self.limit


class Crafted:
    """Fails on an item whose text holds `needle` as the item's own failure (GuardInputError, as a text
    that talks a guard model off its labels), scores any other `p_unsafe`; counts calls."""

    def __init__(self, name: str, needle: str, p_unsafe: float = 0.0) -> None:
        self.name = name
        self.needle = needle
        self.p_unsafe = p_unsafe
        self.calls = 0

    async def classify(self, item: GuardInput) -> GuardScore:
        """GuardInputError on the needle, else the score."""
        self.calls += 1
        if self.needle in item.text():
            raise GuardInputError(f"{self.name}: label mass 0.001 is below 0.02: the model is not answering")
        return GuardScore(p_unsafe=self.p_unsafe, guard=self.name, model="fake@1")


class ByText:
    """P(unsafe) = 1 when the judged text contains `needle`, else 0; records every text it saw."""

    def __init__(self, needle: str, name: str = "bytext@1") -> None:
        self.name = name
        self.needle = needle
        self.seen: list[str] = []

    async def classify(self, item: GuardInput) -> GuardScore:
        """1.0 if the needle is in the text, else 0.0."""
        text = item.text()
        self.seen.append(text)
        return GuardScore(p_unsafe=1.0 if self.needle in text else 0.0, category="violence", guard=self.name)


class Queued(Scripted):
    """A scripted guard whose engine has `wait` seconds of work queued ahead of a new call."""

    def __init__(self, name: str, p_unsafe: float, *, wait: float) -> None:
        super().__init__(name, p_unsafe)
        self.wait = wait

    def expected_wait(self) -> float:
        """The scripted wait."""
        return self.wait
