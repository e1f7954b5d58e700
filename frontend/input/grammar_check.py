"""Validating a request's grammar where a crash costs one request: a small process pool.

The limits in `shared.grammar_limits` keep every grammar we know of from crashing llguidance,
but llguidance is native code, and a grammar that still crashes it must not take the frontend
(and every request on it) down. So the frontend never runs llguidance's validation itself:
a worker process compiles the grammar against the model's tokenizer and computes its first
mask (what the engine will do), under the same limits, on a deep-stack thread. A worker that
dies fails only the request it was checking (a 400: the grammar broke the validator), one that
takes longer than `timeout_s` is killed (a 400 as well), and either way the pool is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import msgspec

from shared.grammar_limits import DeepStackThreads, validation_problem
from shared.log_format import setup_from_environment

log = logging.getLogger("sluice.frontend")

STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports llguidance and builds the tokenizer


class TokenizerSpec(msgspec.Struct, frozen=True):
    """What a worker needs to build llguidance's tokenizer for the model (LLTokenizer does
    not pickle): the HF tokenizer's JSON, the vocabulary size and the EOS ids."""

    tokenizer_json: str
    n_vocab: int
    eos_token_ids: list[int]

    @classmethod
    def from_hf(cls, tokenizer, n_vocab: int, eos_token_ids: list[int]) -> TokenizerSpec:
        from copy import copy

        backend = copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), n_vocab, list(eos_token_ids))


class GrammarCheckFailed(Exception):
    """The check itself did not finish: the worker crashed or ran past the timeout (the
    grammar's doing: a 400)."""


class GrammarCheckUnavailable(Exception):
    """No worker could start (the server's fault, not the grammar's: a 503)."""


class GrammarChecker:
    def __init__(self, spec: TokenizerSpec | None, *, workers: int = 1,
                 timeout_s: float = 10.0, check: Callable[[str], str | None] | None = None
                 ) -> None:
        """`check`: what a worker runs on a grammar (a module-level function; tests pass
        one that crashes or hangs)."""
        self.spec = spec
        self._check = check or _check
        self.workers = workers
        self.timeout_s = timeout_s
        self.num_checks = 0  # grammars checked (tests count them)
        self._pool: ProcessPoolExecutor | None = None
        self._started = None  # the current pool's first job: done once its workers are up
        self._slots: asyncio.Semaphore | None = None

    def start(self) -> None:
        """Starts the workers now (each builds the tokenizer, about a second), not on the
        first grammar."""
        self._current_pool()

    async def problem(self, grammar: str) -> str | None:
        """llguidance's objection to `grammar`, or None; GrammarCheckFailed if the check
        crashed or timed out."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:  # queued checks wait here, so the timeout is the check's own
            self.num_checks += 1
            for attempt in range(2):
                pool = await self._started_pool()
                try:
                    future = asyncio.wrap_future(pool.submit(self._check, grammar))
                    return await asyncio.wait_for(future, self.timeout_s)
                except TimeoutError:
                    self._replace(pool)
                    raise GrammarCheckFailed(
                        f"checking the grammar took longer than {self.timeout_s:g} s") from None
                except BrokenProcessPool:
                    replaced_by_another = pool is not self._pool
                    self._replace(pool)
                    if attempt == 0 and replaced_by_another:
                        continue  # another check broke that pool; this one gets a new one
                    raise GrammarCheckFailed("the grammar crashed the grammar checker") from None
        raise AssertionError("unreachable")

    async def _started_pool(self) -> ProcessPoolExecutor:
        """The pool once its workers are up: their start-up is not the grammar's time."""
        pool = self._current_pool()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._started), STARTUP_TIMEOUT_S)
        except (TimeoutError, BrokenProcessPool) as exc:
            self._replace(pool)
            raise GrammarCheckUnavailable(
                "the grammar checker could not start; try again shortly") from exc
        return pool

    def close(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)
            self._pool = None

    def _current_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fresh interpreter, none of the frontend's threads or sockets.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context,
                                             initializer=_init_worker, initargs=(self.spec,))
            self._started = self._pool.submit(_ready)
        return self._pool

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        if pool is self._pool:
            log.warning("grammar checker replaced (a worker crashed or hung)")
            self._pool = None
        self._kill(pool)

    @staticmethod
    def _kill(pool: ProcessPoolExecutor) -> None:
        # A hung worker never returns, so shutdown alone would leave it running.
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- in the worker process

_tokenizer = None
_threads: DeepStackThreads | None = None


def _init_worker(spec: TokenizerSpec | None) -> None:
    global _tokenizer, _threads
    setup_from_environment()  # a spawned interpreter: it logs as the frontend does
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if spec is not None:
        from llguidance import LLTokenizer

        _tokenizer = LLTokenizer(spec.tokenizer_json, n_vocab=spec.n_vocab,
                                 eos_token=spec.eos_token_ids)
    _threads = DeepStackThreads(1, "grammar-check")


def _exit_with_parent(parent: int) -> None:
    """A frontend killed outright (SIGKILL) cannot stop its workers; they stop themselves."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _ready() -> None:
    return None


def _check(grammar: str) -> str | None:
    return _threads.submit(validation_problem, _tokenizer, grammar).result()
