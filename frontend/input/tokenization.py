"""Rendering (messages -> text) and tokenizing (text -> ids), off the event loop (req T-8, T-9).

Both run on a pool of worker threads. Each job borrows a tokenizer copy from a pool that grows
on demand, because one shared tokenizer behind a lock would serialize every request's
tokenization across the threads.

A render that outlives --render-timeout fails its request, and its worker is retired and
replaced by a fresh thread, so a stuck template cannot hold a worker (or, with one thread,
the whole pool). CPython cannot kill a thread; we ask the stuck one to stop by raising an
exception in it, which works whenever the template loops in Python (Jinja compiles to
Python), and otherwise leave it to finish on its own: the workers are daemon threads, so a
stuck one never blocks the process from exiting.
"""

from __future__ import annotations

import asyncio
import copy
import ctypes
import itertools
import logging
import queue
import threading
from concurrent.futures import Executor, Future
from contextlib import contextmanager

import msgspec

from frontend.base.api_models import ChatMessage
from frontend.input import input_metrics
from frontend.input.budgets import (
    BudgetError,
    FittedText,
    PromptTokens,
    Side,
    TokenizeParams,
    finish,
    fit_pair,
    fit_text,
    shift_offsets,
)
from frontend.input.harmony_render import render_for_harmony
from frontend.input.mistral_render import render_for_mistral
from frontend.input.rendering import RenderedPrompt, RenderParams, TemplateSettings, render
from frontend.input.structured import StructuredSettings

log = logging.getLogger("sluice.frontend")


class InputSettings(msgspec.Struct, frozen=True, kw_only=True):
    max_chars_per_token: int  # TokenizerFacts, computed once at load (req T-11)
    pad_token_id: int | None = None
    pad_side: Side = "right"  # the tokenizer's padding_side
    # An encoder's sentence_bert_config.json `do_lower_case`: the model was trained on
    # lowercased text its tokenizer does not lowercase. Applied after the character ceiling
    # (which counts what the client sent), before tokenizing.
    do_lower_case: bool = False
    threads: int = 4
    render_timeout_s: float = 30.0
    templates: TemplateSettings = TemplateSettings()
    # Tool-call and reasoning parsers (and llguidance's tokenizer) for structured output; the
    # renderer injects a named tool_choice's begin marker (req C-3).
    structured: StructuredSettings = StructuredSettings()
    eos_token_ids: tuple[int, ...] = ()  # TokenizerFacts': what ends a beam (beam search)


class RenderTimeout(Exception):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"Rendering the chat template took longer than {timeout_s:g} s and was stopped: "
            "the template or the messages are too expensive to render. (Server operators can "
            "raise --render-timeout.)"
        )


class RenderQueueTimeout(Exception):
    """No worker was free to start the render in time: overload, not the template's fault."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"The server is overloaded: no worker could start rendering this request within "
            f"{timeout_s:g} s. Try again shortly.")


class RenderInterrupted(BaseException):
    """Raised inside a stuck render's thread. A BaseException, so `except Exception` in
    template or library code cannot swallow it."""


# ---------------------------------------------------------------- tokenizer copies


class TokenizerPool:
    """Tokenizer copies, one per concurrent job; grows on demand when all are lent out.

    The prototype is never lent, so copying it never races with a job using it.
    """

    def __init__(self, tokenizer) -> None:
        self._prototype = tokenizer
        self._grow_lock = threading.Lock()
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self.copies = 0
        self._idle.put(self._new_copy())

    def _new_copy(self):
        with self._grow_lock:
            self.copies += 1
            return copy.deepcopy(self._prototype)

    @contextmanager
    def borrow(self):
        try:
            tok = self._idle.get_nowait()
        except queue.Empty:
            tok = self._new_copy()
        try:
            yield tok
        finally:
            self._idle.put(tok)


# ---------------------------------------------------------------- worker threads


class _WorkerState:
    retired = False  # set by WorkerPool.replace; the worker leaves after its current job


class WorkerPool(Executor):
    """Daemon worker threads over one queue; a stuck worker can be swapped for a fresh one.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit (a stuck one would
    hang shutdown), and work queued behind a stuck thread of an abandoned executor would
    wait forever. Here the queue stays and only the stuck thread leaves.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = threads
        self._name = name
        self._serial = itertools.count()
        # Live workers by thread id. Ids are reused once a thread ends, so a worker's state
        # is its own object, registered when it starts, not a set of retired ids.
        self._workers: dict[int, _WorkerState] = {}
        self._lock = threading.Lock()
        for _ in range(threads):
            self._spawn()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def replace(self, ident: int) -> None:
        """Retire the worker `ident` (it exits when its job ends) and start a new one."""
        with self._lock:
            state = self._workers.get(ident)
            if state is None or state.retired:
                return
            state.retired = True
        self._spawn()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in range(self._threads):
            self._work.put(None)

    def _spawn(self) -> None:
        name = f"{self._name}-{next(self._serial)}"
        threading.Thread(target=self._worker, name=name, daemon=True).start()

    def _worker(self) -> None:
        me = _WorkerState()
        with self._lock:
            self._workers[threading.get_ident()] = me
        try:
            while not me.retired:
                item = self._work.get()
                if item is None:
                    return
                _run_item(*item)
        except RenderInterrupted:
            pass  # landed between jobs of a retired worker: it was leaving anyway


def _run_item(future: Future, fn, args, kwargs) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled while queued (its request timed out first)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class _RenderJob:
    """Which thread runs a render, so a timeout can stop that thread and only that one."""

    def __init__(self, on_start) -> None:
        self.lock = threading.Lock()
        self.ident: int | None = None
        self.done = False
        self.on_start = on_start  # called on the worker thread as the render begins


def _set_once(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _interrupt(ident: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(RenderInterrupted)
    )


def _encode(tok, fitted: FittedText, params: TokenizeParams, num_chars: int):
    """Token ids (and offsets) of a fitted text, capped at params.encode_cap; returns
    (PromptTokens, whether the cap cut anything)."""
    # encode_batch releases the GIL while the Rust tokenizer works; encode holds it, which
    # would stall the event loop for a whole long prompt even from a worker thread.
    [encoding] = tok.backend_tokenizer.encode_batch(
        [fitted.text], add_special_tokens=params.add_special_tokens
    )
    input_metrics.TOKENIZER_CHARS.inc(len(fitted.text))
    cap = params.encode_cap
    capped = cap is not None and len(encoding) > cap
    keep = slice(0, cap if capped else None)
    offsets = None
    if params.return_offsets:
        offsets = shift_offsets(encoding.offsets[keep], fitted.cut_left)
    tokens = PromptTokens(
        ids=encoding.ids[keep], offsets=offsets, num_chars=num_chars,
        chars_cut=fitted.cut_left + fitted.cut_right,
    )
    return tokens, capped


def _check_room(tok, params: TokenizeParams, pair: bool) -> None:
    """Truncation cuts text only: it must leave room for the tokens the tokenizer adds."""
    needed = tok.num_special_tokens_to_add(pair=pair)
    if params.keep_tokens is not None and params.keep_tokens < needed:
        raise BudgetError(
            f"truncate_prompt_tokens={params.keep_tokens} leaves no room for the "
            f"{needed} special tokens this model's tokenizer adds around the input",
            "truncate_prompt_tokens")


# ---------------------------------------------------------------- the stage


class Tokenization:
    """The frontend's input stage workers; every public method is a coroutine."""

    def __init__(self, tokenizer, settings: InputSettings) -> None:
        self.settings = settings
        self.pool = TokenizerPool(tokenizer)
        self.workers = WorkerPool(settings.threads, "tokenize")

    async def _run(self, fn, *args):
        return await asyncio.wrap_future(self.workers.submit(fn, *args))

    # -------------------------------------------------------- rendering

    async def render_chat(
        self, messages: list[ChatMessage], params: RenderParams
    ) -> RenderedPrompt:
        """The rendered prompt. --render-timeout bounds the wait for a free worker and then,
        separately, the render itself: only the second is the template's fault (a 400);
        the first is overload (RenderQueueTimeout, a 503)."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        job = _RenderJob(lambda: loop.call_soon_threadsafe(_set_once, started))
        future = self.workers.submit(self._render, job, messages, params)
        result = asyncio.wrap_future(future)
        timeout_s = self.settings.render_timeout_s
        try:
            await asyncio.wait({started, result}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not started.done() and not result.done() and future.cancel():
                raise RenderQueueTimeout(timeout_s)
            return await asyncio.wait_for(result, timeout_s)
        except TimeoutError:
            self._abandon(job)
            raise RenderTimeout(timeout_s) from None
        except asyncio.CancelledError:
            result.cancel()  # the client left: a render still queued never runs
            raise

    def _render(self, job: _RenderJob, messages, params: RenderParams) -> RenderedPrompt:
        job.on_start()
        with job.lock:
            job.ident = threading.get_ident()
        try:
            with self.pool.borrow() as tok:
                templates = self.settings.templates
                renderer = (render_for_mistral if templates.mistral else
                            render_for_harmony if templates.harmony else render)
                return renderer(tok, messages, params, templates)
        finally:
            with job.lock:
                job.done = True

    def _abandon(self, job: _RenderJob) -> None:
        input_metrics.RENDER_TIMEOUTS.inc()
        with job.lock:  # the job cannot finish (and its thread move on) while we decide
            if job.ident is None or job.done:
                return  # never started (wait_for cancelled it) or finished just now
            log.warning("chat template render timed out; replacing its worker thread")
            self.workers.replace(job.ident)
            _interrupt(job.ident)

    # -------------------------------------------------------- tokenizing

    async def tokenize(self, text: str, params: TokenizeParams) -> PromptTokens:
        return await self._run(self.tokenize_sync, text, params)

    def tokenize_sync(self, text: str, params: TokenizeParams) -> PromptTokens:
        """The pool job behind `tokenize` (tests call it directly)."""
        # The ceiling comes first: an over-long text never reaches the tokenizer.
        fitted = self._lowered(fit_text(text, params, self.settings.max_chars_per_token))
        with self.pool.borrow() as tok:
            tokens, capped = _encode(tok, fitted, params, len(text))
            tokens = self._finish(tokens, params, capped)
            if params.needs_detokenization:
                tokens.text = tok.decode(tokens.ids, skip_special_tokens=False)
        return tokens

    def _lowered(self, fitted: FittedText) -> FittedText:
        # str.lower() may change the length (a few Unicode letters), so offsets then refer to
        # the lowercased text, as in vLLM.
        if not self.settings.do_lower_case:
            return fitted
        return msgspec.structs.replace(fitted, text=fitted.text.lower())

    def _finish(self, tokens: PromptTokens, params: TokenizeParams, capped: bool
                ) -> PromptTokens:
        return finish(tokens, params, capped=capped, pad_token_id=self.settings.pad_token_id,
                      pad_side=self.settings.pad_side)

    async def tokenize_pair(self, first: str, second: str | None, params: TokenizeParams,
                            segments: bool = True) -> PromptTokens:
        return await self._run(self.tokenize_pair_sync, first, second, params, segments)

    def tokenize_pair_sync(self, first: str, second: str | None, params: TokenizeParams,
                           segments: bool = True) -> PromptTokens:
        """A cross-encoder's input: two segments (or one) joined as the tokenizer joins them,
        with their token types, under the same three budgets as a prompt. Truncation cuts
        the segments' text (the longer first, as HF's longest_first), never the separators
        the tokenizer adds, so a cut pair keeps its second segment and its closing token.
        `segments` False (a decoder reranker has no token types): every type is 0."""
        a, b = fit_pair(first, second or "", params, self.settings.max_chars_per_token)
        a, b = self._lowered(a), self._lowered(b)
        with self.pool.borrow() as tok:
            _check_room(tok, params, pair=second is not None)
            try:
                enc = tok(a.text, b.text if second is not None else None, truncation=True,
                          max_length=params.pair_max_length, return_token_type_ids=True)
            finally:  # transformers leaves truncation set on the copy; _encode would obey it
                tok.backend_tokenizer.no_truncation()
        input_metrics.TOKENIZER_CHARS.inc(len(a.text) + len(b.text))
        ids = list(enc["input_ids"])
        types = (segments and enc.get("token_type_ids")) or [0] * len(ids)
        tokens = PromptTokens(ids=ids, token_types=list(types),
                              num_chars=len(first) + len(second or ""),
                              chars_cut=a.cut_left + a.cut_right + b.cut_left + b.cut_right)
        return self._finish(tokens, params, capped=params.keep_tokens is None)

    async def fit_ids(self, ids: list[int], params: TokenizeParams) -> PromptTokens:
        """prompt_token_ids passthrough: budgets only, no rendering (req T-10)."""
        tokens = self._finish(PromptTokens(ids=ids), params, capped=False)
        if params.needs_detokenization:  # after truncation: the text matches the ids sent
            tokens.text = await self.decode(tokens.ids, skip_special_tokens=False)
        return tokens

    async def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word as it starts a text and, when
        that tokenizes differently, after a space, as in mid-text."""
        return await self._run(self._bad_word_ids, words)

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        sequences: list[list[int]] = []
        with self.pool.borrow() as tok:
            for word in words:
                bare = tok.encode(word.lstrip(), add_special_tokens=False)
                spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
                for ids in (bare, spaced):
                    if ids and ids not in sequences:
                        sequences.append(ids)
        return sequences

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it (byte-level: "Ġword")."""
        return await self._run(self._token_strs, ids)

    def _token_strs(self, ids: list[int]) -> list[str]:
        with self.pool.borrow() as tok:
            return tok.convert_ids_to_tokens(ids)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self._decode, ids, skip_special_tokens)

    def _decode(self, ids, skip_special_tokens) -> str:
        with self.pool.borrow() as tok:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def shutdown(self) -> None:
        self.workers.shutdown(wait=False)
        checker = self.settings.structured.checker
        if checker is not None:  # its worker process, so none outlives the frontend
            checker.close()
