"""TensorRT-LLM's conversation_params and scheduling_params (seed 000): fields that change
no token of the answer, only where and when it runs, so they pass through to what schedules
(frontend placement, the engine's queue). Checked here, each problem a 400 naming the field;
an unknown key inside either object is refused by the request's decoder, as TensorRT-LLM's
models forbid extra fields."""

from __future__ import annotations

from frontend.base.errors import bad_request
from shared.param_ranges import MAX_PRIORITY_TIER

MAX_ID_CHARS = 1024  # a conversation, session or organization id
MAX_ENGINE_RANK = 2**31 - 1


def check_scheduling_fields(request) -> None:
    conversation = request.conversation_params
    if conversation is not None:
        _check_id(conversation.conversation_id, "conversation_params.conversation_id")
        if conversation.subagent_affinity_id is not None:
            _check_id(conversation.subagent_affinity_id,
                      "conversation_params.subagent_affinity_id")
    scheduling = request.scheduling_params
    if scheduling is None:
        return
    rank = scheduling.attention_dp_rank
    if rank is not None and not 0 <= rank <= MAX_ENGINE_RANK:
        raise bad_request("scheduling_params.attention_dp_rank must be a non-negative "
                          "engine rank", "scheduling_params.attention_dp_rank")
    if scheduling.attention_dp_relax is not None and rank is None:
        raise bad_request("scheduling_params.attention_dp_relax needs attention_dp_rank",
                          "scheduling_params.attention_dp_relax")
    tier = scheduling.priority_tier
    if tier is not None and not 0 <= tier <= MAX_PRIORITY_TIER:
        raise bad_request(f"scheduling_params.priority_tier must lie in [0, "
                          f"{MAX_PRIORITY_TIER}]", "scheduling_params.priority_tier")
    if scheduling.organization_id is not None:
        _check_id(scheduling.organization_id, "scheduling_params.organization_id")


def _check_id(value: str, field: str) -> None:
    if not value.strip():
        raise bad_request(f"{field} must be a non-empty string", field)
    if len(value) > MAX_ID_CHARS:
        raise bad_request(f"{field} may have at most {MAX_ID_CHARS} characters", field)


def affinity_id(request) -> str | None:
    """The id routing keeps together: a sub-agent's parent session, else its conversation
    (TensorRT-LLM strips the conversation id)."""
    conversation = request.conversation_params
    if conversation is None:
        return None
    return (conversation.subagent_affinity_id or conversation.conversation_id).strip()


def priority_tier(request) -> int:
    scheduling = request.scheduling_params
    return (scheduling.priority_tier or 0) if scheduling is not None else 0
