"""Builders for frontend tests: a real, typed ServingContext without an engine process.

The context holds a real tokenization stage (a real tokenizer on worker threads), so the code
under test runs exactly as it does in the server; only the engine client is a stand-in that
says what `max_model_len` and `build_job` read from it before anything is submitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from frontend.input.tokenization import InputSettings, Tokenization
from frontend.pipeline.serving_context import ServingContext
from shared.protocol import EngineStats


class EngineStub:
    """An engine that is alive, with a context of `max_model_len` tokens; nothing is sent."""

    def __init__(self, max_model_len: int) -> None:
        self.stats = EngineStats(
            engine_id="stub", model_name="m", max_model_len=max_model_len, num_total_pages=0,
            num_free_pages=0, num_running=0, num_waiting=0, num_steps=0, max_seqs_in_step=0,
            num_finished=0, num_aborted=0, sent_at=0.0)
        self.engine_alive = self.may_serve = True
        self.result_address = "tcp://127.0.0.1:1"


@contextmanager
def serving_context(tokenizer, *, max_model_len: int, max_chars_per_token: int,
                    vocab_size: int | None = None) -> Iterator[ServingContext]:
    """A ServingContext over `tokenizer`; its worker threads stop when the block ends."""
    tokenization = Tokenization(
        tokenizer, InputSettings(max_chars_per_token=max_chars_per_token, threads=1))
    try:
        yield ServingContext(
            client=EngineStub(max_model_len), tokenization=tokenization, model_name="m",
            vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
        )
    finally:
        tokenization.shutdown()
