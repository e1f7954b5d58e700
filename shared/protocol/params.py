"""Sampling and output parameters that travel with a request, and the token-id buffers."""

from __future__ import annotations

import msgspec
import numpy as np

# Raw int32 little-endian token ids. Use `pack_ids` / `unpack_ids`.
TokenIds = bytes


def pack_ids(ids) -> TokenIds:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: TokenIds) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


class Constraint(msgspec.Struct, frozen=True):
    """A grammar the output must follow (req P-8, C-1 to C-3).

    The frontend translates the request (response_format, structured_outputs, guided_*, forced
    tool calls) into one llguidance grammar and validates it, so the engine only compiles it.
    """

    kind: str  # what asked for it: json_object | json_schema | regex | choice | grammar | tools
    grammar: str  # llguidance's grammar format (a JSON document or a Lark grammar)


class ThinkingBudget(msgspec.Struct, frozen=True):
    """vLLM's thinking_token_budget: after `budget` thinking tokens the engine writes
    `end_ids` (the reasoning parser's end tag) to close the section (engine.request.thinking)."""

    budget: int
    start_ids: list[int]  # the parser's start tag, which opens a section
    end_ids: list[int]
    starts_inside: bool = False  # the rendered prompt already opened one


# One definition of greedy for every tier: a temperature below this takes the argmax (as
# vLLM's _SAMPLING_EPS); dividing logits by it would only overflow float32 anyway.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the engine needs to pick and stop tokens; the frontend pins every default."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    # Penalties: presence/frequency count output tokens only; repetition counts prompt and
    # output (req P-11).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, ids already checked against the vocabulary, bias in [-100, 100].
    logit_bias: list[tuple[int, float]] = []
    # Top alternatives to report per generated token; None = no logprobs at all, 0 = only the
    # sampled token's logprob.
    logprobs: int | None = None
    # Same for prompt tokens (completions `echo` with logprobs).
    prompt_logprobs: int | None = None
    # The output must follow this grammar: a mask on the logits before sampling.
    constraint: Constraint | None = None
    # vLLM's allowed_token_ids: only these may be drawn (empty: any).
    allowed_token_ids: list[int] = []
    # vLLM's bad_words, tokenized by the frontend: the last token of each sequence is
    # banned wherever the output so far ends with the ones before it.
    bad_words: list[list[int]] = []
    thinking: ThinkingBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of k consecutive tokens, as raw buffers.

    token_logprobs: float32[k], the chosen token's logprob (NaN for a prompt's first token);
    top_ids: int32[k * n] and top_logprobs: float32[k * n], the n best alternatives of each
    position in descending order (n = the request's logprobs; 0 leaves them empty).
    """

    token_logprobs: bytes
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    ranks: bytes = b""  # int32[k], prompt logprobs only: each token's rank (0: none)


class ChunkFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to write a streamed candidate's OpenAI chunks, so whoever post-processes it (a
    postproc worker, or the frontend's receiver thread) hands the HTTP layer finished bytes."""

    kind: str  # "chat" | "completion"
    response_id: str
    created: int
    model: str
    index: int  # the choice index this candidate streams as
    logprobs: bool = False  # put logprobs in the chunks
    continuous_usage: bool = False  # usage in every chunk (stream_options)
    echo: str = ""  # completions: the prompt text, before the first chunk's text
    reasoning_field: str = "reasoning_content"
    # vLLM's return_token_ids: each chunk names its tokens' ids; a completion's first chunk
    # also the prompt's (a chat stream's opening chunk, written by the frontend, has those).
    token_ids: bool = False


class OutputParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a request's tokens become text: what the postproc step needs, not the engine."""

    skip_special_tokens: bool = True
    stop: list[str] = []  # stop strings, matched on detokenized text
    include_stop_str_in_output: bool = False
    # The request's min_tokens: no stop string ends it before that many tokens (req P-9).
    min_tokens: int = 0
    logprobs: bool = False  # attach token strings to the logprobs the engine sends
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", not their text
    # (for tokens whose text is not valid UTF-8 on its own).
    tokens_as_ids: bool = False
    # Output parsers by registered name (req O-5, O-6); None = off for this request.
    reasoning_parser: str | None = None
    # Whether the output starts inside a thinking block, as the frontend read it from the
    # rendered prompt (a template may pre-fill `<think>` or a closed block).
    starts_in_reasoning: bool = False
    tool_parser: str | None = None
    tools: bytes = b""  # the request's `tools` as JSON (parsers read parameter types)
    # Text the server put after the rendered prompt that the output continues (a forced
    # call's opening, req C-3): parsed as output, never returned as content.
    tool_prefill: str = ""
    chunk: ChunkFormat | None = None  # set for streamed requests only
