"""Rendering chat messages with the model's own chat template and counting prompt tokens exactly.

The gateway tokenizes, not the engine: quotas, admission and the context check need exact counts before the
engine sees the request. Tokenizing is CPU work, so it runs in a small thread pool off the event loop, except
for a short prompt: rendering and encoding a prompt of up to `INLINE_CHARS` characters takes about as much of
the loop's time (60-120 us for 20 words) as handing it to a thread and taking the answer back (plus a wake-up
of the loop), so it runs in place, bounded by that length. A rendered prompt is encoded piece by piece
between its special tokens, and the ids of recent pieces are remembered (`gateway.generation.pieces`):
system prompts, role headers and the earlier turns of a conversation are not encoded again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.generation.pieces import piecewise_encoder

# Prompts whose message text adds up to at most this many characters (and that carry no tools) are rendered on
# the event loop. Measured on a 2-core EPYC (template and encoding): 100 characters 117 us, 500 characters
# 242 us, 1,024 characters 410 us; the hand-off to the pool costs the loop about 70 us and lets a longer
# prompt encode on another core (the Rust encoder releases the GIL), so only short ones stay: at most ~150 us.
INLINE_CHARS = 256
# Chat messages (and tools) as the template reads them.
Messages = list[dict[str, Any]]


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of a model directory, by path and never from the network. Blocking: run it in a
    worker thread."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class PromptRenderer:
    """A tokenizer and a chat template (the registry's template text, not the one beside the tokenizer).

    One fast tokenizer is shared by the executor's threads: rendering and encoding always call it with the
    same truncation and padding settings (none), so no call mutates it and concurrent calls do not conflict
    (tests/gateway/test_rendering_versions.py runs them concurrently on the production pool size).
    """

    def __init__(self, tokenizer: Any, executor: ThreadPoolExecutor, template: str | None = None) -> None:
        """Render with `template` (Jinja text); None: the template the tokenizer directory holds."""
        text = template if template is not None else getattr(tokenizer, "chat_template", None)
        if not text:
            raise ValueError("no chat template: the registry gave none and the tokenizer has none")
        self.template: str = text
        # The tokenizer and its executor, shared with one-token guards on the same tokenizer.
        self.tokenizer = tokenizer
        self.executor = executor
        self.vocab_size: int = len(tokenizer)
        self._render = _renderer(tokenizer, text)
        self._encode = _encoder(tokenizer)
        self._encode_rendered = piecewise_encoder(tokenizer) or (lambda text: self._encode(text, False))

    @classmethod
    async def load(
        cls, model_dir: Path, executor: ThreadPoolExecutor, template: str | None = None
    ) -> PromptRenderer:
        """Load the tokenizer from a prepared model directory (never from the network); render with
        `template` (None: the directory's own chat template). Built in `executor`, off the event loop."""

        def build() -> PromptRenderer:
            # In the worker thread: the tokenizer's load, and the template's compilation and probes.
            tokenizer = load_tokenizer(model_dir)
            if template is None and not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{model_dir} has no chat template")
            return cls(tokenizer, executor, template)

        return await asyncio.get_running_loop().run_in_executor(executor, build)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else the caller describes the tools in a
        system message, see gateway/generation/tools.py)."""
        return "tools" in self.template

    def _chat(self, messages: Messages, tools: Messages | None) -> list[int]:
        # The template already wrote every special token the model expects.
        return self._encode_rendered(self._render(messages, tools))

    def _text(self, text: str) -> list[int]:
        return self._encode(text, True)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (what the guard reads of a token-id prompt)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: str(self.tokenizer.decode(token_ids, skip_special_tokens=False))
        )

    async def chat(self, messages: Messages, tools: Messages | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, for a template that renders them) rendered with the chat
        template and a generation prompt."""
        if tools is None and _short(messages):
            return self._chat(messages, None)
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._chat, messages, tools)

    async def text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt."""
        if len(text) <= INLINE_CHARS:
            return self._text(text)
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._text, text)


def _short(messages: Messages) -> bool:
    """Whether `messages` are plain text of at most `INLINE_CHARS` characters in all."""
    size = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or len(message) > 2:  # parts, tool calls, names: the thread pool
            return False
        size += len(content)
    return size <= INLINE_CHARS


def _renderer(tokenizer: Any, template: str) -> Callable[[Messages, Messages | None], str]:
    """`(messages, tools) -> text` with `template` and a generation prompt: what `transformers`'
    `apply_chat_template(..., tokenize=False)` renders, without the work it repeats on every call (looking up
    the compiled template, building the special tokens' map, checking its arguments; about a quarter of
    rendering a short prompt). The same compiled template and variables; tools are already JSON schemas.

    The template's globals (Jinja's and transformers' helpers, a ChainMap) are merged with the fixed
    variables once, here: `Template.render` merges them into a new context on every call, walking the
    ChainMap in Python (half of rendering a 20-word prompt: 44 -> 22 us on a slow 2-core EPYC). The context
    is the template's own (`new_context`), shared with a dict made per call."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    fixed = {
        **compiled.globals,
        **tokenizer.special_tokens_map,
        "documents": None,
        "add_generation_prompt": True,
    }
    concat = compiled.environment.concat

    def render(messages: Messages, tools: Messages | None) -> str:
        context = compiled.new_context({**fixed, "messages": messages, "tools": tools}, shared=True)
        return str(concat(compiled.root_render_func(context)))

    return render


def _encoder(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """`(text, add_special_tokens) -> ids` for `tokenizer`: straight through its Rust tokenizer where it is a
    fast one (the `transformers` call around it costs more than encoding a short prompt), the same ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text, special: list(tokenizer(text, add_special_tokens=special)["input_ids"])
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return lambda text, special: list(batch([text], add_special_tokens=special)[0].ids)
