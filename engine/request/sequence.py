"""A request's life inside the engine: its tokens, its pages, and how far the model has read it."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

from engine.request.records import DraftState, RequestTrace
from engine.request.thinking import ThinkingTracker
from shared.protocol import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from engine.request.grammar import RequestGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence(msgspec.Struct, kw_only=True):
    request_id: str
    token_ids: list[int]  # prompt followed by everything generated so far
    num_prompt_tokens: int
    params: SamplingParams
    reply_to: str
    arrival_time: float
    # Generated tokens may not exceed this; already capped by max_model_len.
    max_output_tokens: int
    cache_salt: str | None = None
    priority: int = 0  # lower runs first under the priority policy
    priority_tier: int = 0  # higher runs first under the priority policy, before `priority`
    # its LoRA adapter's engine-unique id (engine.step.lora_adapters); 0: the base model
    lora_id: int = 0
    lora_name: str | None = None  # its name, for the KV events (vLLM's lora_name)
    images: list = []  # engine.step.multimodal.SeqImage, in prompt order (req T-13)
    peer: bytes | None = None  # the ROUTER identity of the connection it came on
    order: int = 0  # arrival order in the engine, the FCFS key and the tie-breaker
    status: SequenceStatus = SequenceStatus.WAITING
    pages: list[int] = []
    # Tokens whose K/V are in the cache. Reset to 0 when preempted (recompute).
    num_computed: int = 0
    # Prefix-cache hashes of the full pages of token_ids, computed as pages fill.
    page_hashes: list[bytes] = []
    num_registered_pages: int = 0  # leading pages already recorded in the prefix cache
    # Leading pages given back because they lie wholly behind every layer's sliding window
    # (Scheduler's kv_window); their ids stay in `pages` so positions keep their index, but
    # they are no longer this sequence's and are only ever read masked out.
    num_released_pages: int = 0
    # Prompt tokens the prefix cache held when the request was first scheduled (usage's
    # prompt_tokens_details.cached_tokens); a preempted request's recompute does not count.
    num_cached_tokens: int | None = None
    # Outputs already reported to the frontend, so a step reports only what is new.
    num_reported: int = 0
    # The engine's clock (time.time()) at its phases, for vLLM's per-request histograms:
    # admitted (queued), first scheduled, first and latest token.
    queued_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None
    # Tokens that may not be drawn until min_tokens are out: stop token ids, plus EOS unless
    # ignore_eos. Empty when min_tokens is 0.
    min_tokens_banned: list[int] = []
    # Follows the thinking sections of a request with a thinking_token_budget.
    thinking: ThinkingTracker | None = None
    # Logprob bookkeeping, used only when the request asks for logprobs.
    cumulative_logprob: float = 0.0
    # Prompt logprobs by the start position of the prefill chunk that produced them;
    # keyed so a recomputed chunk (after preemption) overwrites instead of duplicating.
    prompt_logprob_parts: dict = {}
    # The request's grammar matcher (llguidance), when it has a constraint; None otherwise.
    grammar: RequestGrammar | None = None
    # Set with finish_reason "error": what went wrong, and whose fault (HTTP-style status).
    error: str | None = None
    error_status: int = 0
    # How its speculative drafts fare, once it has drafted (engine.step.spec_decode).
    draft_state: DraftState | None = None
    # A pooling request (engine.step.pooler): prefilled whole in one step, never cached, never
    # sampled; its result is the pooled vector.
    pooling: PoolingParams | None = None
    pooled: object = None  # numpy float32 vector, once computed
    # Set when the request came with a sampled trace context and tracing is on
    # (engine.step.tracing): the span it ends with, stamped as it runs, never per token.
    trace: RequestTrace | None = None

    @property
    def awaiting_grammar(self) -> bool:
        """True while its grammar compiles: the scheduler passes it over until then."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
