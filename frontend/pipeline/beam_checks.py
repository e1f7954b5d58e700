"""What `use_beam_search` cannot be combined with: a 400 naming the field, before any work.

Beam search ranks beams by the model's own log-probabilities and answers once, whole
(`frontend.pipeline.beam_runner`), so what would stream, constrain, penalise or reshape
those log-probabilities is refused rather than silently dropped, as vLLM refuses a
stream, structured output and a forced tool call with beam search. Fields that only steer
sampling (temperature, top_p, top_k, min_p, seed) are accepted and change nothing: beam
search does not sample (vLLM takes them too).
"""

from __future__ import annotations

import math

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from frontend.base.errors import bad_request

LENGTH_PENALTY_LIMIT = 20.0  # |length_penalty|: length ** 20 stays finite for any int32 length

# (field, the value that asks for nothing): any other value is refused with beam search.
_REFUSED_UNLESS = (
    ("stream", False),
    ("prompt_logprobs", None),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("logit_bias", None),
    ("allowed_token_ids", None),
    ("bad_words", None),
    ("guided_json", None),
    ("guided_regex", None),
    ("guided_choice", None),
    ("guided_grammar", None),
    ("structured_outputs", None),
)
_WHY = {
    "stream": "beam search answers once, when every beam is done",
    "prompt_logprobs": "beam steps do not report the prompt's logprobs",
}


def check_beam_fields(request: ChatCompletionRequest | CompletionRequest) -> None:
    """The beam fields' own ranges (also when use_beam_search is off, so a bad value is
    never silently kept), then, with use_beam_search, what cannot combine with it."""
    penalty = request.length_penalty
    if not math.isfinite(penalty) or abs(penalty) > LENGTH_PENALTY_LIMIT:
        raise bad_request(f"length_penalty must be finite and lie in [-{LENGTH_PENALTY_LIMIT:g},"
                          f" {LENGTH_PENALTY_LIMIT:g}], not {penalty}", "length_penalty")
    if not request.use_beam_search:
        return
    for field, neutral in _REFUSED_UNLESS:
        value = getattr(request, field)
        if value not in (neutral, None, [], {}):
            why = _WHY.get(field, "beam search ranks the model's own log-probabilities")
            raise bad_request(f"{field} cannot be combined with use_beam_search: {why}", field)
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request("response_format cannot be combined with use_beam_search: "
                          "structured output is not available with beam search",
                          "response_format")
    if isinstance(request, ChatCompletionRequest):
        _check_chat(request)
    elif request.best_of is not None and request.best_of < 2:
        # vLLM's older API: the beam width is best_of, and one beam is no search.
        raise bad_request("best_of must be greater than 1 when using beam search", "best_of")
    elif request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs cannot be combined with use_beam_search: beam "
                          "steps do not report the prompt's logprobs", "echo")


def _check_chat(request: ChatCompletionRequest) -> None:
    if request.tools and (request.tool_choice == "required"
                          or isinstance(request.tool_choice, NamedToolChoice)):
        raise bad_request("a required or named tool_choice cannot be combined with "
                          "use_beam_search: it constrains the output", "tool_choice")
    if request.thinking_token_budget is not None:
        raise bad_request("thinking_token_budget cannot be combined with use_beam_search",
                          "thinking_token_budget")


def beam_width(request: ChatCompletionRequest | CompletionRequest) -> tuple[int, str]:
    """(beams kept, the field that set it): best_of where the completions API gives it."""
    if isinstance(request, CompletionRequest) and request.best_of is not None:
        return request.best_of, "best_of"
    return request.n, "n"
