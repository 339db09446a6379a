"""Rendering chat messages with the model's own chat template and counting prompt tokens exactly.

The gateway tokenizes, not the engine: quotas, admission and the context check need exact counts before the
engine sees the request. Tokenizing is CPU work, so it runs in a small thread pool off the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


class PromptRenderer:
    """The served model's tokenizer and chat template."""

    def __init__(self, tokenizer: Any, executor: ThreadPoolExecutor) -> None:
        self._tokenizer = tokenizer
        self._executor = executor
        # The tokenizer and its executor, shared with one-token guards on the same tokenizer.
        self.tokenizer = tokenizer
        self.executor = executor
        self.vocab_size: int = len(tokenizer)

    @classmethod
    async def load(cls, model_dir: Path, executor: ThreadPoolExecutor) -> PromptRenderer:
        """Load the tokenizer from a prepared model directory (never from the network)."""
        from transformers import AutoTokenizer

        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(
            executor, lambda: AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{model_dir} has no chat template")
        return cls(tokenizer, executor)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else the caller describes the tools in a
        system message, see gateway/generation/tools.py)."""
        return "tools" in (self._tokenizer.chat_template or "")

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        # The template already wrote every special token the model expects.
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (what the guard reads of a token-id prompt)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: str(self._tokenizer.decode(token_ids, skip_special_tokens=False))
        )

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of `messages` (and `tools`, for a template that renders them) rendered with the chat
        template and a generation prompt."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._chat, messages, tools)

    async def text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._text, text)
