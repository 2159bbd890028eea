"""Tokenization off the event loop, with the checks of token ids a request carries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from pdserve.router.errors import APIError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# apply_chat_template's own arguments: a client's template variables may not set them.
_RENDER_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "chat_template",
        "processor_kwargs",
    }
)


class Tokenization:
    """Runs the tokenizer on one worker thread: long prompts would otherwise stall every
    stream on the event loop, and one thread keeps the tokenizer free of concurrent use."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._executor: ThreadPoolExecutor | None = None  # made on first use, so the app
        self.vocab_size = len(tokenizer)  # serves again after a lifespan's shutdown
        self._renders_tools: bool | None = None

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encode = self._tokenizer.encode
        return list(await self.run(encode, text, add_special_tokens=add_special_tokens))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The messages through the chat template; `template_kwargs` (vLLM's
        chat_template_kwargs, documents) become template variables, never the renderer's own
        arguments."""
        template_kwargs = template_kwargs or {}
        taken = sorted(set(template_kwargs) & _RENDER_ARGS)
        if taken:
            raise APIError(
                400,
                f"chat_template_kwargs cannot set {', '.join(taken)}: they are the renderer's",
                "chat_template_kwargs",
            )
        try:
            ids = await self.run(
                self._tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                tools=tools,
                continue_final_message=continue_final,
                **template_kwargs,
            )
        except Exception as exc:  # template errors (roles, no template) are the client's to fix
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        # transformers 5 returns a BatchEncoding, earlier versions a list.
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def renders_tools(self) -> bool:
        """Whether the chat template writes `tools` into the prompt (checked once: a template
        that ignores them renders the same text with or without)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe", "parameters": {}}}

            def render(tools: list | None) -> str:
                return self._tokenizer.apply_chat_template(probe, tokenize=False, tools=tools)

            try:
                self._renders_tools = await self.run(render, [tool]) != await self.run(render, None)
            except Exception:  # a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt has no tokens", param)
        self.check_vocab(ids, param)

    def check_vocab(self, ids: list[int] | tuple[int, ...], param: str) -> None:
        if ids and max(ids) >= self.vocab_size:
            raise APIError(
                400,
                f"token id {max(ids)} is outside the vocabulary (ids 0..{self.vocab_size - 1})",
                param,
            )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
