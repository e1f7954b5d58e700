"""One streamed candidate's frames -> ready-to-write SSE bytes (OpenAI chat or completion
chunks), so the HTTP layer only forwards bytes (req S-4, O-1).

The frontend writes what is once per request: the role-only opening chunk, the usage chunk,
`[DONE]` and error events. Everything per token is written here.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from msgspec import UNSET

from postproc.openai_shapes import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionTokensDetails,
    Delta,
    Usage,
    chat_logprobs,
    completion_logprobs,
    reasoning_delta,
)
from shared.protocol import ChunkFormat, LogprobEntry, ToolCallDelta

_json = msgspec.json.Encoder()


def sse_event(body: msgspec.Struct) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


class Piece(msgspec.Struct):
    """What one frame adds to a candidate's answer."""

    content: str
    reasoning: str
    tool_calls: list[ToolCallDelta]
    logprobs: list[LogprobEntry]
    prompt_logprobs: list[LogprobEntry] | None
    token_ids: list[int]  # the frame's new tokens (read only with return_token_ids)
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_reasoning_tokens: int | None = None  # None: the request runs no reasoning parser


class ChunkWriter:
    def __init__(self, fmt: ChunkFormat, prompt_ids: Sequence[int] = ()) -> None:
        self.fmt = fmt
        self._prompt_ids = prompt_ids  # a completion's first chunk names them (token_ids)
        # Logprobs and ids of tokens whose text is still held back (a possible stop string
        # or tag): they ride with the next chunk that has text, so none is lost.
        self._held: list[LogprobEntry] = []
        self._held_ids: list[int] = []
        self._position = 0  # completions text_offset: characters of tokens written so far
        self._first = True

    def write(self, piece: Piece) -> bytes:
        """The SSE bytes for this piece; b"" when it adds nothing a client could see yet."""
        first, self._first = self._first, False
        entries = self._held + piece.logprobs
        ids = self._held_ids + piece.token_ids if self.fmt.token_ids else []
        echo = self.fmt.kind == "completion" and first and self.fmt.echo
        if echo and piece.prompt_logprobs:
            entries = piece.prompt_logprobs + entries
        has_news = piece.content or piece.reasoning or piece.tool_calls or echo
        if piece.finish_reason is None and not has_news:
            self._held, self._held_ids = entries, ids
            self._first = first  # the first chunk written is the one with the prompt's ids
            return b""
        self._held, self._held_ids = [], []
        usage = None
        if self.fmt.continuous_usage:
            usage = Usage(piece.num_prompt_tokens, piece.num_output_tokens,
                          piece.num_prompt_tokens + piece.num_output_tokens)
            if piece.num_reasoning_tokens is not None:
                usage.completion_tokens_details = CompletionTokensDetails(
                    piece.num_reasoning_tokens)
        if self.fmt.kind == "chat":
            return self._chat(piece, entries, ids, usage)
        text = (self.fmt.echo if echo else "") + piece.content
        return self._completion(piece, text, entries, ids, usage, first)

    def _chat(self, piece: Piece, entries, ids: list[int], usage) -> bytes:
        delta = Delta(
            content=piece.content or None,
            tool_calls=piece.tool_calls or None,
            **reasoning_delta(self.fmt.reasoning_field, piece.reasoning),
        )
        logprobs = chat_logprobs(entries) if self.fmt.logprobs else None
        choice = ChatChunkChoice(self.fmt.index, delta, piece.finish_reason, piece.stop_reason,
                                 logprobs, ids if self.fmt.token_ids else UNSET)
        fmt = self.fmt
        return sse_event(ChatCompletionChunk(fmt.response_id, fmt.created, fmt.model, [choice],
                                             usage))

    def _completion(self, piece: Piece, text: str, entries, ids: list[int], usage,
                    first: bool) -> bytes:
        logprobs = None
        if self.fmt.logprobs:
            logprobs = completion_logprobs(entries, start_offset=self._position)
            self._position += sum(len(e.token) for e in entries)
        choice = CompletionChoice(self.fmt.index, text, piece.finish_reason, piece.stop_reason,
                                  logprobs)
        if self.fmt.token_ids:
            choice.token_ids = ids
            if first:
                choice.prompt_token_ids = list(self._prompt_ids)
        fmt = self.fmt
        return sse_event(Completion(fmt.response_id, fmt.created, fmt.model, [choice], usage))
