"""Prompts are rendered with the tokenizer and chat template versions the registry resolved, a model version
that cannot be rendered is refused when published or aliased, and the renderer cache loads each pair once."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import ModelConfig
from gateway.generation.prompts import PromptRenderer
from gateway.generation.renderers import RendererCache, renderer_key
from registry.base import RegistryStore
from registry.default_model import register_default_model
from registry.errors import InvalidError
from registry.models import ChatTemplateSpec, ModelSpec, TokenizerSpec
from registry.service import Registry
from registry.store.sqlite import SqliteRegistryStore
from registry.view import RegistryView, ResolvedModel
from tests.backends import FakeClock
from tests.conftest import MODEL, OutcomeLog, Tenancy, make_config, serving

CHAT = "/v1/chat/completions"
ADMIN = "/admin/registry"
# A second chat template version: the served one with a fixed extra system turn in front.
EXTRA_TURN = "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
BROKEN_TEMPLATE = "{% for m in messages %}{{ m.content }"  # does not compile


def extra_template(text: str) -> str:
    """The served template with the extra system turn rendered first."""
    return EXTRA_TURN + text


def expected_tokens(tokenizer: Any, template: str, messages: list[dict[str, str]]) -> int:
    """Prompt tokens of `messages` under `template`, rendered directly (what the gateway must count)."""
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture
async def registry_store(tmp_path: Path) -> AsyncIterator[RegistryStore]:
    """A registry of this test alone (the session's default store is shared by other tests)."""
    store = await SqliteRegistryStore.open(tmp_path / "registry.sqlite3")
    yield store
    await store.close()


class Gateway:
    """One app with admin and consumer clients."""

    def __init__(self, http: httpx.AsyncClient, tenancy: Tenancy) -> None:
        self.http = http
        self.tenancy = tenancy

    async def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.http.request(
            method, f"{ADMIN}{path}", json=body, headers=self.tenancy.admin_headers
        )

    async def ask(self, model: str, content: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return await self.http.post(CHAT, json=body, headers=self.tenancy.consumer_headers)

    async def served_spec(self) -> dict[str, Any]:
        """The spec of the served (only) model version."""
        [current] = (await self.admin("GET", f"/model/{MODEL}/versions")).json()
        spec: dict[str, Any] = current["spec"]
        return spec

    async def publish_extra_template(self, renderer: PromptRenderer) -> str:
        """Publish the extra-turn chat template and a model version using it (same tokenizer and weights);
        return that model version's ref."""
        created = await self.admin(
            "POST",
            f"/chat_template/{MODEL}/versions",
            {"version": "extra", "spec": {"text": extra_template(renderer.template)}},
        )
        assert created.status_code == 201, created.text
        spec = dict(await self.served_spec(), chat_template=f"{MODEL}@extra")
        created = await self.admin("POST", f"/model/{MODEL}/versions", {"version": "extra", "spec": spec})
        assert created.status_code == 201, created.text
        return f"{MODEL}@extra"


@pytest.fixture
async def gateway(
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    tenancy: Tenancy,
    outcomes: OutcomeLog,
    registry_store: RegistryStore,
) -> AsyncIterator[Gateway]:
    # make_config(): the production tokenizer pool size (the config default), not the fixture's one thread.
    config = make_config()
    assert config.model.tokenizer_threads == ModelConfig().tokenizer_threads > 1
    app = create_app(
        config,
        engine=sim_engine,
        renderer=renderer,
        tenants=tenancy.store,
        registry=registry_store,
        sink=outcomes,
    )
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield Gateway(http, tenancy)


async def test_an_alias_moved_to_another_template_version_renders_with_it(
    gateway: Gateway, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    before = expected_tokens(renderer.tokenizer, renderer.template, messages)
    after = expected_tokens(renderer.tokenizer, extra_template(renderer.template), messages)
    assert after > before
    first = await gateway.ask(MODEL, messages[0]["content"])
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] == before

    extra = await gateway.publish_extra_template(renderer)
    moved = await gateway.admin("PUT", f"/model/{MODEL}/alias", {"targets": [{"version": "extra"}]})
    assert moved.status_code == 200, moved.text
    second = await gateway.ask(MODEL, messages[0]["content"])
    assert second.status_code == 200, second.text
    assert second.headers["x-lockgate-model"] == extra
    assert second.json()["usage"]["prompt_tokens"] == after
    outcome = await outcomes.wait_for(second.headers["x-request-id"])
    assert outcome.chat_template == f"{MODEL}@extra"


async def test_a_model_version_that_cannot_render_is_refused_when_published(
    gateway: Gateway, tmp_path: Path
) -> None:
    served = await gateway.served_spec()

    async def publish(version: str, **changes: str) -> httpx.Response:
        spec = dict(served, **changes)
        return await gateway.admin("POST", f"/model/{MODEL}/versions", {"version": version, "spec": spec})

    missing = await publish("gone", artifact=str(tmp_path / "nowhere" / "model.safetensors"))
    assert missing.status_code == 400, missing.text
    assert "nowhere" in missing.json()["error"]["message"]
    assert "does not exist" in missing.json()["error"]["message"]

    wrong = {"version": "wrong", "spec": {"content_hash": "ab" * 32}}
    assert (await gateway.admin("POST", f"/tokenizer/{MODEL}/versions", wrong)).status_code == 201
    mismatch = await publish("mismatch", tokenizer=f"{MODEL}@wrong")
    assert mismatch.status_code == 400, mismatch.text
    assert "tokenizer.json" in mismatch.json()["error"]["message"]
    assert "does not match" in mismatch.json()["error"]["message"]

    broken = {"version": "broken", "spec": {"text": BROKEN_TEMPLATE}}
    assert (await gateway.admin("POST", f"/chat_template/{MODEL}/versions", broken)).status_code == 201
    bad_template = await publish("badtpl", chat_template=f"{MODEL}@broken")
    assert bad_template.status_code == 400, bad_template.text
    assert "does not render" in bad_template.json()["error"]["message"]

    # None of them was published.
    assert len((await gateway.admin("GET", f"/model/{MODEL}/versions")).json()) == 1


async def test_an_alias_to_a_version_that_cannot_render_is_refused(
    gateway: Gateway, registry_store: RegistryStore, tmp_path: Path
) -> None:
    # Published without the check (a registry without the hook, e.g. before this check existed).
    unchecked = await Registry.load(registry_store, FakeClock())
    served = unchecked.view.resolve_model(MODEL, key="")
    spec = msgspec.structs.replace(served.spec, artifact=str(tmp_path / "nowhere" / "model.safetensors"))
    await unchecked.publish("model", MODEL, "gone", spec, actor="test")
    refused = await gateway.admin("PUT", f"/model/{MODEL}/alias", {"targets": [{"version": "gone"}]})
    assert refused.status_code == 400, refused.text
    assert "does not exist" in refused.json()["error"]["message"]
    canary = [{"version": served.model.version, "weight": 0.9}, {"version": "gone", "weight": 0.1}]
    refused = await gateway.admin("PUT", f"/model/{MODEL}/alias", {"targets": canary})
    assert refused.status_code == 400, refused.text
    answer = await gateway.ask(MODEL, "hello")
    assert answer.status_code == 200
    assert answer.headers["x-lockgate-model"] == served.ref


async def test_concurrent_requests_of_mixed_template_versions_count_right(
    gateway: Gateway, renderer: PromptRenderer
) -> None:
    extra = await gateway.publish_extra_template(renderer)
    served = (await gateway.ask(MODEL, "warm up")).headers["x-lockgate-model"]
    templates = {served: renderer.template, extra: extra_template(renderer.template)}
    cases = [(served if i % 2 else extra, f"Question {i}: " + "tell me more " * (i % 7)) for i in range(64)]
    answers = await asyncio.gather(*(gateway.ask(model, content) for model, content in cases))
    for (model, content), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-lockgate-model"] == model
        messages = [{"role": "user", "content": content}]
        wanted = expected_tokens(renderer.tokenizer, templates[model], messages)
        assert answer.json()["usage"]["prompt_tokens"] == wanted


# The cache itself.


@pytest.fixture
async def registry(registry_store: RegistryStore, model_dir: Path) -> Registry:
    """A registry (no model check) with the default model published under MODEL."""
    registry = await Registry.load(registry_store, FakeClock())
    await register_default_model(registry, model_dir, public_name=MODEL, actor="test")
    return registry


@pytest.fixture
async def executor() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=2)
    yield pool
    pool.shutdown()


async def with_template(registry: Registry, version: str, text: str, artifact: str = "") -> ResolvedModel:
    """Publish chat template `version` and a model version `version` on it."""
    await registry.publish("chat_template", MODEL, version, ChatTemplateSpec(text=text), actor="t")
    served = registry.view.resolve_model(MODEL, key="")
    spec = msgspec.structs.replace(
        served.spec, chat_template=f"{MODEL}@{version}", artifact=artifact or served.spec.artifact
    )
    await registry.publish("model", MODEL, version, spec, actor="t")
    return registry.view.resolve_model(f"{MODEL}@{version}", key="")


async def test_concurrent_gets_share_one_load(
    registry: Registry, executor: ThreadPoolExecutor, model_dir: Path
) -> None:
    cache = RendererCache(model_dir.parent, executor, size=4)
    model = registry.view.resolve_model(MODEL, key="")
    renderers = await asyncio.gather(*(cache.get(model) for _ in range(16)))
    assert all(r is renderers[0] for r in renderers)
    assert cache.loads == {renderer_key(model): 1}
    assert renderers[0].template == model.template.text
    assert await cache.get(model) is renderers[0]


async def test_the_cache_is_bounded_least_recently_used_out(
    registry: Registry, executor: ThreadPoolExecutor, model_dir: Path
) -> None:
    cache = RendererCache(model_dir.parent, executor, size=1)
    first = registry.view.resolve_model(MODEL, key="")
    second = await with_template(registry, "second", extra_template(first.template.text))
    one = await cache.get(first)
    two = await cache.get(second)
    assert two.template == second.template.text
    assert renderer_key(first) not in cache
    assert await cache.get(first) is not one
    assert cache.loads[renderer_key(first)] == 2


async def test_a_failed_load_is_tried_again(
    registry: Registry, executor: ThreadPoolExecutor, model_dir: Path, tmp_path: Path
) -> None:
    later = tmp_path / "later"
    artifact = str(later / "model.safetensors")
    model = await with_template(
        registry, "later", "{% for m in messages %}{{ m.content }}{% endfor %}", artifact
    )
    cache = RendererCache(model_dir.parent, executor, size=2)
    with pytest.raises(InvalidError, match="does not exist"):
        await cache.get(model)
    later.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        await asyncio.to_thread(shutil.copy, model_dir / name, later / name)
    renderer = await cache.get(model)
    assert await renderer.decode(await renderer.chat([{"role": "user", "content": "hi"}])) == "hi"
    assert not renderer.supports_tools
    assert cache.loads[renderer_key(model)] == 2


async def test_the_registry_calls_its_model_check_on_publish_and_alias(registry: Registry) -> None:
    calls: list[str] = []

    async def check(view: RegistryView, ref: str, spec: ModelSpec) -> None:
        calls.append(ref)
        if "bad" in ref:
            raise InvalidError(f"model {ref}: refused")

    served = registry.view.resolve_model(MODEL, key="")
    registry.model_check = check
    await registry.publish("tokenizer", MODEL, "t2", TokenizerSpec(content_hash="cd" * 32), actor="t")
    assert calls == []  # only model versions are checked
    spec = msgspec.structs.replace(served.spec, artifact="x/model.safetensors")
    await registry.publish("model", MODEL, "good", spec, actor="t")
    # Publishing it again changes nothing and checks nothing.
    await registry.publish("model", MODEL, "good", spec, actor="t")
    assert calls == [f"{MODEL}@good"]
    with pytest.raises(InvalidError, match="refused"):
        await registry.publish("model", MODEL, "bad", spec, actor="t")
    assert not registry.view.has("model", MODEL, "bad")
    await registry.set_alias("model", MODEL, "good", actor="t")
    assert calls[-1] == f"{MODEL}@good"
    registry.model_check = None
    await registry.publish("model", MODEL, "bad", spec, actor="t")
    registry.model_check = check
    with pytest.raises(InvalidError, match="refused"):
        await registry.set_alias("model", MODEL, "bad", actor="t")
    assert registry.view.alias("model", MODEL).targets[0].version == "good"
