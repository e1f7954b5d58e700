"""OpenAI request bodies as msgspec Structs (the response bodies: `postproc.openai_shapes`).

Requests forbid unknown fields so a typo is a 400 naming the field, before any work (req P-1).
Every field of the current OpenAI API is known: the ones we cannot honour are listed in the
`*UNSUPPORTED_WHEN_SET` tuples (a non-default value is a 400 saying so, rather than silently
ignored), the ones that change nothing about the tokens in `ACCEPTED_AND_IGNORED`.
`docs/openai-compat.md` lists every field with its status; a unit test keeps it true.

OpenAI marks most optional fields nullable, and clients do send `"n": null`: a null in a field
with a non-null default means that default (`NullMeansDefault`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from shared.tool_specs import ChatTool, ToolName

_NULL_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


class NullMeansDefault(msgspec.Struct):
    """After decoding, a field sent as null that has a non-null default takes that default."""

    def __post_init__(self) -> None:
        cls = type(self)
        defaults = _NULL_DEFAULTS.get(cls)
        if defaults is None:
            # A mutable default (`= []`) is a factory: each request gets its own.
            defaults = _NULL_DEFAULTS[cls] = tuple(
                (f.name, f.default_factory if f.default is msgspec.NODEFAULT
                 else lambda default=f.default: default)
                for f in msgspec.structs.fields(cls)
                if f.default_factory is not msgspec.NODEFAULT
                or (f.default is not msgspec.NODEFAULT and f.default is not None)
            )
        for name, default in defaults:
            if getattr(self, name) is None:
                setattr(self, name, default())


class StreamOptions(NullMeansDefault, forbid_unknown_fields=True):
    # vLLM's default: once stream_options is sent at all, the usage chunk comes unless
    # include_usage is false.
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk
    # Newer OpenAI clients send it; we never add obfuscation padding, so it changes nothing.
    include_obfuscation: bool | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None
    prompt_cache_breakpoint: Any = None  # a caching hint: changes nothing about the tokens
    image_embeds: Any = None  # vLLM's precomputed embeddings: refused (frontend.input.multimodal)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    # OpenAI's roles (system, developer, user, assistant, tool, function), or a custom one,
    # as vLLM takes: the chat template renders it (`input_bounds` bounds its size).
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # vLLM's newer name for the same thing (--reasoning-field reasoning answers with it, so
    # clients send it back); reasoning_content wins when both are given.
    reasoning: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None


class StructuredOutputs(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json: Any = None  # a JSON schema, as an object or as its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None
    structural_tag: str | None = None  # not supported: a 400 when set
    disable_fallback: bool | None = False  # one backend here: nothing to fall back from
    disable_any_whitespace: bool | None = False  # our JSON has no free whitespace anyway
    disable_additional_properties: bool | None = False
    whitespace_pattern: str | None = None  # a regex for the whitespace JSON may use


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None  # absent: any JSON object
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: ToolName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`tool_choice` naming the function to call: `{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: NamedFunction


class ConversationParams(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """TensorRT-LLM's conversation_params: a multi-turn conversation's stable id, which
    routing keeps on one engine (where its earlier turns' pages are cached), and a
    sub-agent's parent session id, which keeps the sub-agent beside its parent."""

    conversation_id: str
    subagent_affinity_id: str | None = None


class SchedulingParams(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """TensorRT-LLM's scheduling_params (its llmapi SchedulingParams). Sluice's engines are
    its attention-DP ranks: `attention_dp_rank` pins the request to that engine (in
    --engine-address order), `attention_dp_relax` lets it go elsewhere when that one is
    not live or is past the load bound; `priority_tier` (0-15, higher first) orders the
    priority scheduler's queue before `priority`; `organization_id` is accepted and checked
    but used for nothing (no per-organization spike protection here)."""

    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None
    priority_tier: int | None = 0
    organization_id: str | None = None


class _SamplingFields(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None
    # vLLM-compatible extensions
    top_k: int | None = None
    min_p: float | None = None  # None: left out (the model's default, else 0)
    repetition_penalty: float | None = None  # None: left out (the model's default, else 1)
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # default: left (keep the end)
    prompt_token_ids: list[int] | str | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's chat field; vLLM takes it on completions too.
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None
    priority: int | None = 0
    request_id: str | None = None
    allowed_token_ids: list[int] | None = None  # only these may be generated (vLLM's)
    bad_words: list[str] | None = None  # words that must not be generated (vLLM's)
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"
    return_token_ids: bool | None = False  # answers carry prompt and output ids (vLLM's)
    prompt_logprobs: int | None = None  # logprobs of the prompt's tokens too (vLLM's)
    # vLLM's beam search (frontend.pipeline.beam_search): n beams (best_of on completions),
    # scored sum logprob / length**length_penalty, stopping as transformers' early_stopping.
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    early_stopping: bool | Literal["never"] | None = False
    # TensorRT-LLM's routing and scheduling fields (frontend.input.scheduling_hints).
    conversation_params: ConversationParams | None = None
    scheduling_params: SchedulingParams | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage] | None = []  # required unless prompt_token_ids is given
    # vLLM's: the tokenizer's special tokens (BOS) on top of what the template writes.
    add_special_tokens: bool | None = False
    # vLLM's: after this many thinking tokens the reasoning parser's end tag is written.
    thinking_token_budget: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" when there are tools (after the checks), as OpenAI's default.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    # Accepted and ignored (ACCEPTED_AND_IGNORED) or rejected when set (the UNSUPPORTED lists).
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    # vLLM-compatible chat extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False
    # RAG documents for templates that take them (vLLM's): [{"title": ..., "text": ...}]
    documents: list[dict[str, str]] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str, list[str], list[int] or list[list[int]]; msgspec allows one array type per
    # union, so the element kinds are checked when the prompt is read.
    prompt: str | list[str | int | list[int]] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True


class TokenizeRequest(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (rendered with the chat
    template first), never both. add_special_tokens defaults as on the generation endpoints:
    True for a prompt, False for messages (the template already holds BOS, req T-4)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool | None = False  # also each token's own string (vLLM's)


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


# Fields we know but cannot honour yet: (field, default) — a different value is a 400
# (unless it means the same as the default: `NEUTRAL_VALUES`).
# Entries leave these lists as the features land; docs/openai-compat.md is checked against them.
UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = ()
CHAT_UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = (
    ("functions", None),
    ("function_call", None),
    ("audio", None),
    ("modalities", None),
    ("moderation", None),
    ("web_search_options", None),
)
COMPLETION_UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = (
    ("suffix", None),  # req P-6: reject, don't ignore
)
# Values of unsupported fields that ask for nothing beyond the default, so they pass.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
}
# Fields accepted with any value because they change nothing about the tokens we produce
# (bookkeeping, billing, caching and routing hints, or knobs of features we never run).
ACCEPTED_AND_IGNORED: frozenset[str] = frozenset({
    "user",
    "spaces_between_special_tokens",
    # chat only
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "verbosity",
    "prediction",
    # stream_options
    "include_obfuscation",
})
