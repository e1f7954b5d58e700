"""The input stage: from a request to prompt token ids (req T-*, L-4).

Chat requests are rendered with a chat template (`frontend.input.rendering`), then tokenized
without special tokens, because the template already holds BOS (req T-4); completion prompts
are tokenized with them; `prompt_token_ids` skip rendering. Every path then goes through the
same budgets (`frontend.input.budgets`). Rendering and tokenizing run in
`frontend.input.tokenization`'s worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

import msgspec
import numpy as np

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError, bad_request
from frontend.input import input_metrics
from frontend.input.budgets import (
    BudgetError,
    PromptTokens,
    TokenizeParams,
    check_truncation,
    fit_text,
)
from frontend.input.media import MediaError
from frontend.input.multimodal import (
    ImagePart,
    MultimodalError,
    expand_placeholders,
    image_inputs,
    image_parts,
)
from frontend.input.rendering import RenderedPrompt, RenderError, RenderParams, check_render_params
from frontend.input.structured import forced_call_prefix
from frontend.input.tokenization import RenderQueueTimeout, RenderTimeout
from frontend.pipeline.serving_context import ServingContext, max_model_len
from frontend.pipeline.tracing import phase
from shared.protocol import ImageInput
from shared.tool_specs import template_tools

Request = ChatCompletionRequest | CompletionRequest


class PromptInput(msgspec.Struct):
    tokens: PromptTokens
    rendered: RenderedPrompt | None = None  # None when the client sent token ids
    source_text: str | None = None  # a completions prompt as the client wrote it (echo)
    images: list[ImageInput] = []  # a multimodal chat prompt's images, in prompt order

    @property
    def num_tokens(self) -> int:
        """The prompt's length in tokens: what token counts and budgets report."""
        return len(self.tokens.ids)

    @property
    def usage_tokens(self) -> int:
        """What usage reports as prompt_tokens: less the trailing generation opener the
        model's own template adds, when the prompt still ends with it (Harmony)."""
        opener = self.rendered.usage_excluded_ids if self.rendered is not None else ()
        ids = self.tokens.ids
        if opener and len(ids) > len(opener) and tuple(ids[-len(opener):]) == opener:
            return len(ids) - len(opener)
        return len(ids)


async def chat_prompt_ids(ctx: ServingContext, request: ChatCompletionRequest) -> list[int]:
    return (await chat_input(ctx, request)).tokens.ids


async def completion_prompt_ids(ctx: ServingContext, request: CompletionRequest) -> list[int]:
    return (await completion_input(ctx, request)).tokens.ids


# ---------------------------------------------------------------- chat


async def chat_input(ctx: ServingContext, request: ChatCompletionRequest) -> PromptInput:
    # The template already writes BOS (req T-4), unless the request asks for more.
    params = _tokenize_params(ctx, request, add_special_tokens=bool(request.add_special_tokens))
    if request.prompt_token_ids is not None:
        return await _passthrough(ctx, request, request.prompt_token_ids, params, "chat")
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    parts = _image_parts(ctx, request)
    if parts:
        return await _multimodal_input(ctx, request, params, parts)
    rendered = await _render(ctx, request)
    if rendered.token_ids is not None:  # the renderer tokenized (mistral-common)
        tokens = await _fit_rendered(ctx, rendered, params)
    else:
        tokens = await _tokenize(ctx, rendered.text, params, "messages")
    _record(request, "chat", tokens, rendered=True)
    return PromptInput(tokens, rendered)


def _template_kwargs(request: ChatCompletionRequest, settings) -> dict:
    """--default-chat-template-kwargs, under the request's; reasoning_effort reaches the
    template as vLLM passes it (a chat_template_kwargs entry of that name wins)."""
    kwargs = dict(settings.default_kwargs)
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    return {**kwargs, **(request.chat_template_kwargs or {})}


def _image_parts(ctx: ServingContext, request: ChatCompletionRequest) -> list[ImagePart]:
    """The request's image parts, counted at parse time (req T-13), before any loading."""
    try:
        parts = image_parts(request.messages)
    except MultimodalError as exc:
        raise bad_request(str(exc), exc.param) from exc
    if not parts:
        return parts
    if ctx.vision is None:
        raise bad_request(f"the model {ctx.model_name!r} takes no images (text only)",
                          parts[0].param)
    limit = ctx.media.max_images_per_prompt
    if len(parts) > limit:
        raise bad_request(f"at most {limit} images per prompt (--limit-mm-per-prompt); this "
                          f"request has {len(parts)}", parts[limit].param)
    return parts


async def _multimodal_input(ctx: ServingContext, request: ChatCompletionRequest,
                            params: TokenizeParams, parts: list[ImagePart]) -> PromptInput:
    """Images load (fetch, decode, the model's processor) while the template renders, not
    after it; then each placeholder becomes its image's exact tokens, and the budgets apply
    to the expanded prompt, which truncation may not cut through an image of."""
    vision = ctx.vision
    loads = [asyncio.ensure_future(vision.prepare(p)) for p in parts]
    try:
        rendered = await _render(ctx, request, vision.placeholder)
        images = await asyncio.gather(*loads)
    except MediaError as exc:
        input_metrics.REJECTED.labels("bad_media").inc()
        raise bad_request(f"{exc.param}: {exc}", exc.param) from exc
    finally:
        for load in loads:  # after a failure the others are not worth finishing
            load.cancel()
    try:
        text, spans = expand_placeholders(rendered.text, vision.placeholder, images)
        params = msgspec.structs.replace(params, return_offsets=True)
        tokens = await _tokenize(ctx, text, params, "messages")
        inputs = image_inputs(tokens, spans, images, vision.image_token_id)
    except MultimodalError as exc:
        raise bad_request(str(exc), exc.param) from exc
    tokens.offsets = None  # only the image spans needed them
    _record(request, "chat", tokens, rendered=True)
    return PromptInput(tokens, rendered, images=inputs)


async def _render(ctx: ServingContext, request: ChatCompletionRequest,
                  image_placeholder: str | None = None) -> RenderedPrompt:
    settings = ctx.tokenization.settings.templates
    structured = ctx.tokenization.settings.structured
    if request.chat_template is not None and not settings.trust_request_chat_template:
        raise bad_request(
            "this server does not accept a chat_template in requests (the operator can allow "
            "it with --trust-request-chat-template)",
            "chat_template",
        )
    params = RenderParams(
        request_template=request.chat_template,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=template_tools(request.tools),
        documents=request.documents,
        template_kwargs=_template_kwargs(request, settings),
        # A named tool_choice: the output starts inside the call (req C-3).
        injected_prefix=forced_call_prefix(request, structured),
        image_placeholder=image_placeholder,
    )
    try:
        check_render_params(params, request.messages)
        with phase("render"):
            return await ctx.tokenization.render_chat(request.messages, params)
    except RenderError as exc:
        raise bad_request(str(exc), exc.param) from exc
    except RenderTimeout as exc:
        # A 400, not a 5xx: the same request would time out again, and clients retry 5xx
        # automatically, each retry stranding another thread on the same template.
        input_metrics.REJECTED.labels("render_timeout").inc()
        raise bad_request(str(exc), "messages") from exc
    except RenderQueueTimeout as exc:
        # Every worker was busy for the whole timeout: overload, which a retry can cure.
        input_metrics.REJECTED.labels("render_queue_timeout").inc()
        raise APIError(503, str(exc)) from exc


# ---------------------------------------------------------------- completions


async def completion_input(ctx: ServingContext, request: CompletionRequest) -> PromptInput:
    """The one prompt of a request that has one; a batch is a 400 here."""
    inputs = await completion_inputs(ctx, request)
    if len(inputs) != 1:
        raise bad_request("send one prompt here", "prompt")
    return inputs[0]


async def completion_inputs(ctx: ServingContext, request: CompletionRequest) -> list[PromptInput]:
    """One PromptInput per prompt: a string, token ids, or a list of either (a batch, whose
    choices come back in prompt order, n per prompt; its size was bounded by check_bounds,
    --max-prompts-per-request)."""
    params = _tokenize_params(ctx, request, add_special_tokens=request.add_special_tokens)
    prompt = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str) and request.prompt_token_ids is None:
        return [await _completion_text(ctx, request, prompt, params)]
    if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
        return [await _passthrough(ctx, request, prompt, params, "completions")]
    inputs = []
    for single in prompt:
        if isinstance(single, str):
            inputs.append(await _completion_text(ctx, request, single, params))
        elif isinstance(single, list):
            inputs.append(await _passthrough(ctx, request, single, params, "completions"))
        else:
            raise bad_request(
                "prompt must be a string, token ids, or a list of strings or of token-id "
                "lists", "prompt")
    return inputs


async def _completion_text(ctx: ServingContext, request, text: str,
                           params: TokenizeParams) -> PromptInput:
    tokens = await _tokenize(ctx, text, params, "prompt")
    _record(request, "completions", tokens, rendered=False)
    # A cut prompt echoes as the ids that were sent (pipeline.add_echo_texts decodes them),
    # so the echo agrees with its logprobs and offsets.
    cut = tokens.tokens_cut or tokens.chars_cut
    return PromptInput(tokens, source_text=None if cut else text)


# ---------------------------------------------------------------- shared steps


def _tokenize_params(ctx: ServingContext, request: Request, *,
                     add_special_tokens: bool) -> TokenizeParams:
    params = TokenizeParams(
        max_total_tokens=max_model_len(ctx),
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        truncation_side=request.truncation_side,
        add_special_tokens=add_special_tokens,
    )
    try:
        check_truncation(params)
    except BudgetError as exc:
        raise bad_request(str(exc), exc.param) from exc
    return params


async def _tokenize(ctx: ServingContext, text: str, params: TokenizeParams,
                    field: str) -> PromptTokens:
    try:
        with phase("tokenize"):
            return await ctx.tokenization.tokenize(text, params)
    except BudgetError as exc:
        input_metrics.REJECTED.labels("too_long").inc()
        raise bad_request(str(exc), exc.param or field) from exc


async def _fit_rendered(ctx: ServingContext, rendered: RenderedPrompt,
                        params: TokenizeParams) -> PromptTokens:
    """A prompt the renderer already tokenized: the character ceiling on its text, then the
    same truncation and length check as any prompt."""
    try:
        fit_text(rendered.text, params, ctx.tokenization.settings.max_chars_per_token)
        tokens = await ctx.tokenization.fit_ids(rendered.token_ids, params)
    except BudgetError as exc:
        input_metrics.REJECTED.labels("too_long").inc()
        raise bad_request(str(exc), exc.param or "messages") from exc
    tokens.num_chars = len(rendered.text)
    return tokens


async def _passthrough(ctx: ServingContext, request, ids, params: TokenizeParams,
                       endpoint: str) -> PromptInput:
    ids = _decode_ids(ids, ctx.vocab_size)
    try:
        tokens = await ctx.tokenization.fit_ids(ids, params)
    except BudgetError as exc:
        input_metrics.REJECTED.labels("too_long").inc()
        raise bad_request(str(exc), exc.param or "prompt_token_ids") from exc
    _record(request, endpoint, tokens, rendered=False)
    return PromptInput(tokens)


def _decode_ids(ids: list[int] | str, vocab_size: int) -> list[int]:
    if isinstance(ids, str):
        try:
            ids = np.frombuffer(base64.b64decode(ids, validate=True), dtype="<i4").tolist()
        except ValueError as exc:
            raise bad_request("prompt_token_ids is not valid base64 int32", "prompt") from exc
    if not ids:
        raise bad_request("the prompt must not be empty", "prompt")
    low, high = min(ids), max(ids)
    if low < 0:  # the wording of vLLM's errors, which clients' tests match
        raise bad_request(f"token id {low} is negative: token ids must be greater than or "
                          f"equal to 0 and less than {vocab_size}", "prompt")
    if high >= vocab_size:
        raise bad_request(f"token id {high} is out of vocabulary: token ids must lie in "
                          f"[0, {vocab_size})", "prompt")
    return list(ids)


def _record(request: Request, endpoint: str, tokens: PromptTokens, *, rendered: bool) -> None:
    # The engine request id ends with request.request_id; fixing it here when the client sent
    # none lets the log line and the engine's id be matched.
    if request.request_id is None:
        request.request_id = uuid.uuid4().hex
    input_metrics.record(input_metrics.InputRecord(
        endpoint=endpoint,
        request=request.request_id,
        rendered=rendered,
        chars=tokens.num_chars,
        prompt_tokens=len(tokens.ids),
        truncated_tokens=tokens.tokens_cut,
        truncated_chars=tokens.chars_cut,
    ))
