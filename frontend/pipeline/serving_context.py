"""The serving context: what every route needs from the running server, in one typed place.

`ServingContext` holds the engine client, the tokenization stage, the model's name and the
server's settings (output parsers, per-request limits); the three protocol faces (OpenAI,
Responses, Messages) and the input stage all take it as `ctx`. The small checks that read
only the context and the helpers every face shares (an error frame's APIError, the SSE
response) live here too, so no face imports another to get them.
"""

from __future__ import annotations

import msgspec
from starlette.responses import StreamingResponse

from frontend.base.errors import APIError
from frontend.engine_client import lora_client
from frontend.engine_client.client import EngineClient
from frontend.input.input_bounds import RequestLimits
from frontend.input.media import MediaSettings
from frontend.input.multimodal import VisionProcessor
from frontend.input.structured import StructuredSettings
from frontend.input.tokenization import Tokenization
from shared.generation_config import GenerationDefaults
from shared.protocol import TextFrame


class OutputSettings(msgspec.Struct, frozen=True):
    """The server's output parsers (flags); applied to chat requests."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    reasoning_field: str = "reasoning_content"
    response_role: str = "assistant"  # --response-role: the role chat answers carry
    # The reasoning parser's start and end tags as token ids (thinking_token_budget).
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" for every request.
    return_tokens_as_token_ids: bool = False
    # --enable-prompt-tokens-details: usage says how many prompt tokens were found cached.
    prompt_tokens_details: bool = False
    # --enable-force-include-usage: every stream ends with a usage chunk, asked for or not.
    force_include_usage: bool = False


class ServingContext(msgspec.Struct):
    client: EngineClient
    tokenization: Tokenization
    model_name: str  # the name responses carry (the first --served-model-name)
    vocab_size: int
    model_aliases: tuple[str, ...] = ()  # further names requests may send as `model`
    model_source: str = ""  # what --model named: the model cards' `root`
    started: int = 0  # when the server started (epoch seconds): the model cards' `created`
    output: OutputSettings = OutputSettings()
    limits: RequestLimits = RequestLimits()  # the server's maxima per request (flags)
    # --generation-config's defaults for fields a request leaves out (request values win).
    generation_defaults: GenerationDefaults = GenerationDefaults()
    # The model's image processor (req T-13); None: a text-only model, images are a 400.
    vision: VisionProcessor | None = None
    media: MediaSettings = MediaSettings()


def structured_settings(ctx: ServingContext) -> StructuredSettings:
    """The server's tool-call / reasoning parsers and llguidance tokenizer, for the checks
    and grammars of structured output."""
    return ctx.tokenization.settings.structured


def check_model(ctx: ServingContext, model: str | None) -> None:
    """The base model's names, or a LoRA adapter an engine serves; else a 404."""
    if (model is not None and model != ctx.model_name and model not in ctx.model_aliases
            and model not in lora_client.adapters(ctx.client)):
        raise APIError(404, f"The model '{model}' does not exist.", "model")


def max_model_len(ctx: ServingContext) -> int:
    """The engine's context length; a 503 while no engine is there to say it (one frozen
    or restarting for less than --engine-timeout still counts: the request waits for it)."""
    stats = ctx.client.stats
    if stats is None or not ctx.client.may_serve:
        raise APIError(503, "The engine is not available; try again shortly.")
    return stats.max_model_len


def frame_error(frame: TextFrame) -> APIError:
    """The APIError an error frame stands for."""
    return APIError(frame.error_status or 500, frame.error or "the request failed")


def sse_response(events) -> StreamingResponse:
    """A Server-Sent Events response; proxies must neither cache nor buffer it."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
