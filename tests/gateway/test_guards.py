"""The guard wrappers the gateway builds: a guard loading in the background tells the cascade how large an
item is for it only once loaded (so a timeout on an oversized item is the item's own, never the breaker's)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import msgspec
import numpy as np
import pytest

from gateway.config import GuardConfig
from gateway.generation.prompts import PromptRenderer
from gateway.guard_factory import GuardFactory, LoadingGuard
from guard.base import Classifier, GuardError, GuardInput, ItemSized, Span
from guard.ngram import DIM, NgramHead, features, normalize
from registry.models import GuardModelSpec, Published
from registry.view import ResolvedGuard
from tests.guard.fakes import Scripted, Sized

SMALL = GuardInput(direction="input", spans=(Span(text="hi", source="user"),))
LARGE = GuardInput(direction="input", spans=(Span(text="x" * 101, source="user"),))


async def test_a_loading_guard_is_item_sized_through_the_guard_it_loaded() -> None:
    loaded = asyncio.Event()

    async def load() -> Classifier:
        await loaded.wait()
        return Sized("emb@1", limit=100)

    guard = LoadingGuard("emb@1", load)
    assert isinstance(guard, ItemSized)
    # Still loading: a timeout now is the load's (the guard's own), so nothing is oversized.
    assert not guard.oversized(LARGE)
    loaded.set()
    await guard.ready()
    assert guard.oversized(LARGE)
    assert not guard.oversized(SMALL)


async def test_a_loading_guard_of_an_unsized_or_failed_guard_is_never_oversized() -> None:
    async def plain() -> Classifier:
        return Scripted("s@1", 0.0)

    async def broken() -> Classifier:
        raise GuardError("no artifact")

    unsized = LoadingGuard("s@1", plain)
    await unsized.ready()
    assert not unsized.oversized(LARGE)
    failed = LoadingGuard("b@1", broken)
    await asyncio.gather(failed.ready(), return_exceptions=True)
    assert not failed.oversized(LARGE)


async def test_the_factory_builds_an_ngram_guard_from_its_pinned_head(tmp_path: Path) -> None:
    weights = np.zeros(DIM, dtype=np.float32)
    weights[features(normalize("pipe bomb"))] = 1.0
    sha = NgramHead(weights, -2.0).save(tmp_path / "guards" / "ngram-guard")
    spec = GuardModelSpec(kind="ngram", artifact="guards/ngram-guard", weights_sha256=sha)
    published = Published(
        kind="guard_model",
        name="ngram-guard",
        version="1",
        content_hash="0" * 64,
        spec_json=msgspec.json.encode(spec).decode(),
        published_at=0.0,
        actor="t",
    )
    resolved = ResolvedGuard(ref="ngram-guard@1", guard=published, spec=spec, model=None)
    with ThreadPoolExecutor(max_workers=1) as executor:
        renderer = cast(PromptRenderer, SimpleNamespace(executor=executor))
        factory = GuardFactory(
            pools={},
            renderer=renderer,
            tokenizer_ref="tok@1",
            artifacts=tmp_path,
            config=GuardConfig(),
            clock=time.monotonic,
        )
        await factory.ready((resolved,))
        guard = factory(resolved)
        assert (
            await guard.classify(
                GuardInput(direction="input", spans=(Span(text="pipe bomb", source="user"),))
            )
        ).p_unsafe > 0.9
        assert (await guard.classify(SMALL)).p_unsafe < 0.5
        # A head that is not the pinned one is a guard error, never a score.
        wrong = msgspec.structs.replace(
            resolved, ref="ngram-guard@2", spec=msgspec.structs.replace(spec, weights_sha256="1" * 64)
        )
        with pytest.raises(GuardError, match="sha256"):
            await factory(wrong).classify(SMALL)
