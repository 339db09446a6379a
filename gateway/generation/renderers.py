"""Prompt renderers per (tokenizer version, chat template version): loaded once, kept in a bounded LRU.

A model version names the tokenizer and chat template versions it must be served with. The renderer of a
pair is the tokenizer loaded from the model version's artifact directory (its tokenizer.json checked against
the tokenizer version's content hash) and the registry's template text. Loads run in worker threads, never
on the event loop; concurrent requests for one pair share one load; a failed load is not kept, so the next
request tries again. `check` is the registry's model check: a version whose files are missing, whose
tokenizer.json does not match, or whose template does not render is refused when it is published or aliased.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import msgspec

from gateway.generation.prompts import PromptRenderer, load_tokenizer
from registry.errors import InvalidError
from registry.models import ChatTemplateSpec, ModelSpec, TokenizerSpec, parse_ref
from registry.validation import check_model_files, model_dir_of
from registry.view import RegistryView, ResolvedModel

# (tokenizer ref, chat template ref): what a renderer depends on.
RendererKey = tuple[str, str]
# Rendered once at load: a template that cannot render this is refused.
_PROBE = [{"role": "user", "content": "ping"}]


class RenderSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where one model version's renderer comes from."""

    model_ref: str
    spec: ModelSpec
    directory: Path
    tokenizer: TokenizerSpec
    template: str

    @property
    def key(self) -> RendererKey:
        """The cache key: the tokenizer and chat template versions."""
        return (self.spec.tokenizer, self.spec.chat_template)


def renderer_key(model: ResolvedModel) -> RendererKey:
    """The cache key of a resolved model version."""
    return (model.tokenizer.ref, model.chat_template.ref)


def source_of(data_dir: Path, model: ResolvedModel) -> RenderSource:
    """The render source of a resolved model version."""
    return RenderSource(
        model_ref=model.ref,
        spec=model.spec,
        directory=model_dir_of(data_dir, model.spec.artifact),
        tokenizer=model.tokenizer.spec_as(TokenizerSpec),
        template=model.template.text,
    )


def source_in_view(data_dir: Path, view: RegistryView, ref: str, spec: ModelSpec) -> RenderSource:
    """The render source of a model version about to be published (its tokenizer and template are)."""
    return RenderSource(
        model_ref=ref,
        spec=spec,
        directory=model_dir_of(data_dir, spec.artifact),
        tokenizer=view.spec("tokenizer", *parse_ref(spec.tokenizer), TokenizerSpec),
        template=view.spec("chat_template", *parse_ref(spec.chat_template), ChatTemplateSpec).text,
    )


def _check_template(source: RenderSource, tokenizer: Any) -> None:
    if not source.template.strip():
        raise InvalidError(f"model {source.model_ref}: chat template {source.spec.chat_template} is empty")
    try:
        tokenizer.apply_chat_template(
            _PROBE, chat_template=source.template, add_generation_prompt=True, tokenize=False
        )
    except jinja2.TemplateError as exc:
        raise InvalidError(
            f"model {source.model_ref}: chat template {source.spec.chat_template} does not render: {exc}"
        ) from exc


def _load_tokenizer(source: RenderSource) -> Any:
    """Check the files and load the tokenizer, by path. Blocking: run it in a worker thread."""
    check_model_files(source.model_ref, source.spec, source.directory, source.tokenizer)
    try:
        tokenizer = load_tokenizer(source.directory)
    # transformers and the Rust tokenizers library raise many types (OSError, ValueError, bare Exception)
    # for files they cannot read: each is this model version's fault, reported as such.
    except Exception as exc:
        raise InvalidError(
            f"model {source.model_ref}: cannot load the tokenizer in {source.directory}: {exc}"
        ) from exc
    _check_template(source, tokenizer)
    return tokenizer


class RendererCache:
    """Renderers by (tokenizer, chat template) version pair: at most `size`, least recently used out."""

    def __init__(self, data_dir: Path, executor: ThreadPoolExecutor, size: int) -> None:
        """Artifacts are relative to `data_dir`; renderers tokenize in `executor`."""
        if size < 1:
            raise ValueError(f"a renderer cache holds at least one renderer, got size {size}")
        self.data_dir = data_dir
        self.executor = executor
        self.size = size
        # Invariant: len(_loaded) <= size after every insertion.
        self._loaded: OrderedDict[RendererKey, PromptRenderer] = OrderedDict()
        # One load per key in flight; removed when it ends, success or not.
        self._loading: dict[RendererKey, asyncio.Task[PromptRenderer]] = {}
        # Loads started, by key (tests read it: concurrent requests share one).
        self.loads: dict[RendererKey, int] = {}

    def __contains__(self, key: RendererKey) -> bool:
        return key in self._loaded

    def seed(self, key: RendererKey, renderer: PromptRenderer) -> None:
        """Keep an already loaded renderer for `key` (the app's served model, or one a test passes in)."""
        self._put(key, renderer)

    async def get(self, model: ResolvedModel) -> PromptRenderer:
        """The renderer of `model`'s tokenizer and template versions, loading it if needed."""
        key = renderer_key(model)
        found = self._loaded.get(key)
        if found is not None:
            self._loaded.move_to_end(key)
            return found
        return await self._load(source_of(self.data_dir, model))

    async def check(self, view: RegistryView, ref: str, spec: ModelSpec) -> None:
        """The registry's model check: InvalidError unless model version `ref` can be served. Its own files
        are always checked (another version may share its renderer); the renderer is then loaded or reused,
        so that the first request finds it ready."""
        source = source_in_view(self.data_dir, view, ref, spec)
        await asyncio.to_thread(check_model_files, ref, spec, source.directory, source.tokenizer)
        if source.key in self._loaded:
            return
        await self._load(source)

    async def _load(self, source: RenderSource) -> PromptRenderer:
        key = source.key
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._build(source), name=f"load renderer {key}")
            self._loading[key] = task
            # Retrieved even when every waiter was cancelled, so a failure is never an unretrieved exception.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self.loads[key] = self.loads.get(key, 0) + 1
        # Shielded: a request cancelled while waiting must not cancel the load others wait for.
        return await asyncio.shield(task)

    async def _build(self, source: RenderSource) -> PromptRenderer:
        try:
            # Not the tokenizer pool: a load takes far longer than a prompt, which would wait behind it.
            # The template's compilation and the encoders' probes too (a millisecond or more).
            renderer = await asyncio.to_thread(
                lambda: PromptRenderer(_load_tokenizer(source), self.executor, source.template)
            )
            self._put(source.key, renderer)
            return renderer
        finally:
            del self._loading[source.key]

    def _put(self, key: RendererKey, renderer: PromptRenderer) -> None:
        self._loaded[key] = renderer
        self._loaded.move_to_end(key)
        while len(self._loaded) > self.size:
            self._loaded.popitem(last=False)
