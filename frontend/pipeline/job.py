"""A job's data: the engine work one HTTP request becomes (`Job`), and what one of its
candidates produced (`Candidate`), as the pipeline (`frontend.pipeline.pipeline`) builds and
gathers them and the faces read them."""

from __future__ import annotations

import msgspec

from frontend.engine_client.placement import RoutingHints
from frontend.pipeline.input_stage import PromptInput
from frontend.pipeline.sampling import Plan
from shared.protocol import EngineRequest, LogprobEntry, TextFrame, ToolCallDelta, unpack_ids


class Job(msgspec.Struct):
    """One HTTP request's engine work: `plan.candidates` engine requests per prompt.

    Candidate c belongs to prompt c // plan.candidates; when every candidate is returned
    (best_of == n), c is also its choice index.
    """

    request_id: str
    created: int
    prompts: list[PromptInput]
    plan: Plan
    candidates: list[EngineRequest]
    index_of: dict[str, int]  # engine request id -> candidate number
    # The name responses carry: the LoRA adapter's when the request named one (as vLLM),
    # else the served model's.
    model: str = ""
    # Where its candidates go (conversation_params, scheduling_params); None: as usual.
    routing: RoutingHints | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Usage's prompt_tokens (PromptInput.usage_tokens)."""
        return sum(p.usage_tokens for p in self.prompts)


class Candidate(msgspec.Struct):
    """Everything one candidate produced, for non-streaming answers and best_of ranking."""

    texts: list[str] = msgspec.field(default_factory=list)
    reasoning: list[str] = msgspec.field(default_factory=list)
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)
    logprobs: list[LogprobEntry] = msgspec.field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held (first frame says)
    last: TextFrame | None = None

    def add(self, frame: TextFrame) -> None:
        self.texts.append(frame.text)
        self.token_ids.extend(unpack_ids(frame.token_ids).tolist())
        if frame.reasoning:
            self.reasoning.append(frame.reasoning)
        self.tool_calls.extend(frame.tool_calls)
        self.logprobs.extend(frame.logprobs or ())
        if frame.prompt_logprobs is not None:
            self.prompt_logprobs = frame.prompt_logprobs
        if frame.num_cached_tokens is not None:
            self.num_cached_tokens = frame.num_cached_tokens
        self.last = frame

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    @property
    def reasoning_tokens(self) -> int | None:
        """Its output tokens read as reasoning; None when it ran no reasoning parser."""
        return self.last.num_reasoning_tokens if self.last is not None else None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def score(self) -> float:
        if self.last is None or self.last.cumulative_logprob is None:
            return float("-inf")
        return self.last.cumulative_logprob
