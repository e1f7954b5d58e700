"""Rendering (messages -> text) and tokenizing (text -> ids), off the event loop.

Both run in a thread pool. Each call borrows a tokenizer copy from a pool that grows on
demand, because one shared tokenizer behind a lock would serialize every request's
tokenization across the pool's threads.
"""

from __future__ import annotations

import asyncio
import copy
import queue
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from frontend.api_models import ChatMessage


class TokenizerPool:
    def __init__(self, tokenizer) -> None:
        self._prototype = tokenizer
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._idle.put(tokenizer)

    @contextmanager
    def borrow(self):
        try:
            tok = self._idle.get_nowait()
        except queue.Empty:
            tok = copy.deepcopy(self._prototype)
        try:
            yield tok
        finally:
            self._idle.put(tok)


def message_text(message: ChatMessage) -> str | None:
    if message.content is None or isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text":
            raise ValueError(f"content parts of type {part.type!r} are not supported")
        texts.append(part.text or "")
    return "".join(texts)


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        entry = {"role": m.role, "content": message_text(m)}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls is not None:
            entry["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


class Tokenization:
    """The frontend's input stage; every method is a coroutine that runs in the pool."""

    def __init__(self, tokenizer, threads: int) -> None:
        self.pool = TokenizerPool(tokenizer)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
    ) -> str:
        return await self._run(self._render, messages, add_generation_prompt, template_kwargs)

    def _render(self, messages, add_generation_prompt, template_kwargs) -> str:
        with self.pool.borrow() as tok:
            return tok.apply_chat_template(
                _template_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self.pool.borrow() as tok:
            return tok.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self._decode, ids, skip_special_tokens)

    def _decode(self, ids, skip_special_tokens) -> str:
        with self.pool.borrow() as tok:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
