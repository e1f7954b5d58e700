"""Logprob entries from postproc -> the two OpenAI logprobs shapes (SPEC O-4)."""

from __future__ import annotations

import math

from frontend.api_models import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    TopLogprobOut,
)
from shared.protocol import LogprobEntry


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatLogprobEntry(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprobOut(t.token, t.logprob, list(t.token.encode("utf-8")))
                    for t in e.top
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[LogprobEntry], start_offset: int) -> CompletionLogprobs:
    """text_offset counts characters from the start of the choice's text."""
    offsets, position = [], start_offset
    for e in entries:
        offsets.append(position)
        position += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[_finite(e.logprob) for e in entries],
        top_logprobs=[
            {t.token: t.logprob for t in e.top} if math.isfinite(e.logprob) else None
            for e in entries
        ],
        text_offset=offsets,
    )
