"""The ranges every engine sampling parameter must lie in, checked in one place.

The frontend checks a request's `SamplingParams` here after translating it (so chat,
completions, Responses and Messages get the same 400s), and the engine checks every
`EngineRequest` here again before it touches a tensor: a custom client can speak the wire
protocol, and one bad value must fail one request, never a step.

Floats must be finite and stay finite in the sampler's float32 math: a temperature or a
repetition penalty below the floor, divided into a logit, could overflow float32; a top_p that
rounds to 0 in float32 would drop every token. Integers must fit the wire (msgpack int64) and
the int64 tensors the sampler builds from them.
"""

from __future__ import annotations

import math

from shared.protocol import SamplingParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TEMPERATURE_MAX = 100.0
TOP_P_MIN = 1e-6  # (0, 1] in principle; below this float32 sums lose the first token
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 2.0
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as vLLM does
MAX_LOGPROBS = 20  # top alternatives per token: --max-logprobs' default, as vLLM's
UNBOUNDED_LOGPROBS = -1  # --max-logprobs -1: up to the whole vocabulary
TOP_K_MAX = INT32_MAX
MAX_TOKENS_MAX = INT32_MAX
SEED_RANGE = 2**64  # engine seeds lie in [0, 2**64): torch generators take no more
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORD_SEQUENCES = 256  # token sequences (the frontend sends 2 per word: with and
MAX_BAD_WORD_TOKENS = 64  # without a leading space), each at most this long
MAX_TAG_TOKENS = 16  # a thinking budget's start and end tags


class RangeProblem(Exception):
    """A parameter outside its range: `field` names it, the message says the range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _finite_in(value: float, low: float, high: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and low <= value <= high


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs a request may ask for: --max-logprobs, never past the vocabulary."""
    return vocab_size if max_logprobs == UNBOUNDED_LOGPROBS else min(max_logprobs, vocab_size)


def check_sampling_params(p: SamplingParams, vocab_size: int,
                          max_logprobs: int = MAX_LOGPROBS) -> None:
    """Raises RangeProblem for the first parameter outside its range."""
    ints = (
        ("max_tokens", p.max_tokens, 1, MAX_TOKENS_MAX),
        ("top_k", p.top_k, 0, TOP_K_MAX),
        ("min_tokens", p.min_tokens, 0, MAX_TOKENS_MAX),
    )
    for field, value, low, high in ints:
        if not low <= value <= high:
            raise RangeProblem(field, f"{field} must lie in [{low}, {high}], not {value}")
    if p.min_tokens > p.max_tokens:
        raise RangeProblem("min_tokens", "min_tokens must not exceed max_tokens")
    floats = (
        ("temperature", p.temperature, 0.0, TEMPERATURE_MAX),
        ("top_p", p.top_p, TOP_P_MIN, 1.0),
        ("min_p", p.min_p, 0.0, 1.0),
        ("presence_penalty", p.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT),
        ("frequency_penalty", p.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT),
        ("repetition_penalty", p.repetition_penalty,
         REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX),
    )
    for field, value, low, high in floats:
        if not _finite_in(value, low, high):
            raise RangeProblem(field, f"{field} must be a finite number in [{low:g}, {high:g}]")
    if p.seed is not None and not 0 <= p.seed < SEED_RANGE:
        raise RangeProblem("seed", "seed must lie in [0, 2**64) in the engine")
    cap = logprobs_cap(max_logprobs, vocab_size)
    for field, n in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if n is not None and not 0 <= n <= cap:
            raise RangeProblem(field, f"{field} must lie in [0, {cap}] (--max-logprobs)")
    _check_token_ids(p, vocab_size)


def _check_token_ids(p: SamplingParams, vocab_size: int) -> None:
    thinking = p.thinking
    if thinking is not None:
        if not 0 <= thinking.budget <= INT32_MAX:
            raise RangeProblem("thinking_token_budget",
                               f"thinking_token_budget must lie in [0, {INT32_MAX}]")
        for ids in (thinking.start_ids, thinking.end_ids):
            if not 1 <= len(ids) <= MAX_TAG_TOKENS or any(
                    not 0 <= t < vocab_size for t in ids):
                raise RangeProblem("thinking_token_budget",
                                   f"thinking tags must be 1 to {MAX_TAG_TOKENS} token ids "
                                   f"in [0, {vocab_size})")
    _check_id_list("allowed_token_ids", p.allowed_token_ids, vocab_size, vocab_size)
    if len(p.bad_words) > MAX_BAD_WORD_SEQUENCES:
        raise RangeProblem("bad_words",
                           f"at most {MAX_BAD_WORD_SEQUENCES} bad_words token sequences")
    for ids in p.bad_words:
        if not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS:
            raise RangeProblem("bad_words", f"each of bad_words must be 1 to "
                               f"{MAX_BAD_WORD_TOKENS} tokens long")
        if any(not 0 <= t < vocab_size for t in ids):
            raise RangeProblem("bad_words", f"bad_words token ids must lie in [0, {vocab_size})")
    _check_id_list("stop_token_ids", p.stop_token_ids, MAX_STOP_TOKEN_IDS, vocab_size)
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RangeProblem("logit_bias",
                           f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for token_id, bias in p.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise RangeProblem("logit_bias", f"logit_bias token ids must lie in [0, {vocab_size})")
        if not _finite_in(bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT):
            raise RangeProblem("logit_bias",
                               f"logit_bias values must be finite, in [-{LOGIT_BIAS_LIMIT:g}, "
                               f"{LOGIT_BIAS_LIMIT:g}]")


def _check_id_list(field: str, ids: list[int], most: int, vocab_size: int) -> None:
    if len(ids) > most:
        raise RangeProblem(field, f"{field} may hold at most {most} token ids")
    if any(not 0 <= t < vocab_size for t in ids):
        raise RangeProblem(field, f"{field} entries must lie in [0, {vocab_size})")


def check_priority(priority: int) -> None:
    if not INT64_MIN <= priority <= INT64_MAX:
        raise RangeProblem("priority", "priority must fit in a signed 64-bit integer")


MAX_PRIORITY_TIER = 15  # TensorRT-LLM's bound on scheduling_params.priority_tier


def check_priority_tier(tier: int) -> None:
    if not 0 <= tier <= MAX_PRIORITY_TIER:
        raise RangeProblem("scheduling_params.priority_tier",
                           f"scheduling_params.priority_tier must lie in [0, {MAX_PRIORITY_TIER}]")
