"""Input-side visibility (req L-4): prompt sizes and truncation, as metrics and a log line.

Truncation cuts what the model sees without failing the request, so it must be counted
somewhere a person looks; with --enable-log-requests each accepted prompt also gets one INFO
line on `sluice.requests` (`frontend.engine_client.request_log.log_requests`).
The names carry `input_` so they cannot collide with the engine-side request histograms
(req L-3, e.g. `sluice:request_prompt_tokens`).
"""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

request_log = logging.getLogger("sluice.requests")

_SIZES = tuple(float(4**i) for i in range(1, 12))  # 4 .. 4M: chat turns to pasted books

PROMPT_CHARS = Histogram(
    "sluice:input_prompt_chars", "Characters of each rendered or given prompt text.",
    ["endpoint"], buckets=_SIZES, registry=None,
)
PROMPT_TOKENS = Histogram(
    "sluice:input_prompt_tokens", "Tokens of each accepted prompt, after truncation.",
    ["endpoint"], buckets=_SIZES, registry=None,
)
TRUNCATED_TOKENS = Counter(
    "sluice:input_truncated_tokens", "Prompt tokens dropped by truncate_prompt_tokens.",
    ["endpoint"], registry=None,
)
TRUNCATED_REQUESTS = Counter(
    "sluice:input_truncated_requests", "Prompts that truncation shortened.",
    ["endpoint"], registry=None,
)
REJECTED = Counter(
    "sluice:input_rejected", "Prompts refused by the input stage, by reason.",
    ["reason"], registry=None,
)
TOKENIZER_CHARS = Counter(
    "sluice:input_tokenizer_chars", "Characters handed to the tokenizer.", registry=None,
)
RENDER_TIMEOUTS = Counter(
    "sluice:input_render_timeouts", "Chat renders stopped by --render-timeout.", registry=None,
)

_ALL = (PROMPT_CHARS, PROMPT_TOKENS, TRUNCATED_TOKENS, TRUNCATED_REQUESTS, REJECTED,
        TOKENIZER_CHARS, RENDER_TIMEOUTS)


class InputRecord(msgspec.Struct, frozen=True):
    endpoint: str  # "chat" or "completions"
    request: str  # the client's request_id, which the engine request id ends with
    rendered: bool  # False for prompt_token_ids passthrough
    chars: int
    prompt_tokens: int
    truncated_tokens: int
    truncated_chars: int


def register_input_metrics(registry: CollectorRegistry) -> None:
    for metric in _ALL:
        registry.register(metric)


def record(entry: InputRecord) -> None:
    PROMPT_CHARS.labels(entry.endpoint).observe(entry.chars)
    PROMPT_TOKENS.labels(entry.endpoint).observe(entry.prompt_tokens)
    if entry.truncated_tokens or entry.truncated_chars:
        TRUNCATED_REQUESTS.labels(entry.endpoint).inc()
        TRUNCATED_TOKENS.labels(entry.endpoint).inc(entry.truncated_tokens)
    request_log.info(
        "input request=%s endpoint=%s rendered=%s chars=%d prompt_tokens=%d "
        "truncated_tokens=%d truncated_chars=%d",
        entry.request, entry.endpoint, entry.rendered, entry.chars, entry.prompt_tokens,
        entry.truncated_tokens, entry.truncated_chars,
    )
