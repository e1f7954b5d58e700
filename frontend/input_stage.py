"""The input stage: from a request to prompt token ids (SPEC T-*).

Chat requests are rendered with the chat template and tokenized without special tokens (the
template holds BOS); completion prompts are tokenized with them; `prompt_token_ids` skip
rendering entirely. Rendering and tokenizing run in `frontend.tokenization`'s thread pool.
"""

from __future__ import annotations

import base64

import numpy as np

from frontend.api_models import ChatCompletionRequest, CompletionRequest
from frontend.errors import bad_request


async def chat_prompt_ids(ctx, request: ChatCompletionRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        return _passthrough_ids(request.prompt_token_ids, ctx.vocab_size)
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    try:
        text = await ctx.tokenization.render_chat(
            request.messages, request.add_generation_prompt, request.chat_template_kwargs
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    except Exception as exc:  # a template that raises is the request's problem (SPEC T-2)
        raise bad_request(f"chat template error: {exc}", "messages") from exc
    # The template already holds BOS; adding special tokens would double it (SPEC T-4).
    return await ctx.tokenization.encode(text, add_special_tokens=False)


async def completion_prompt_ids(ctx, request: CompletionRequest) -> list[int]:
    prompt = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        if request.prompt_token_ids is not None:
            return _passthrough_ids(prompt, ctx.vocab_size)
        return await ctx.tokenization.encode(prompt, request.add_special_tokens)
    if not prompt:
        raise bad_request("the prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return _passthrough_ids(prompt, ctx.vocab_size)
    if len(prompt) != 1:
        raise bad_request("batched prompts are not supported yet; send one prompt", "prompt")
    single = prompt[0]
    if isinstance(single, str):
        return await ctx.tokenization.encode(single, request.add_special_tokens)
    if isinstance(single, list):
        return _passthrough_ids(single, ctx.vocab_size)
    raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")


def _passthrough_ids(ids: list[int] | str, vocab_size: int) -> list[int]:
    if isinstance(ids, str):
        try:
            ids = np.frombuffer(base64.b64decode(ids, validate=True), dtype="<i4").tolist()
        except ValueError as exc:
            raise bad_request("prompt_token_ids is not valid base64 int32", "prompt") from exc
    if not ids:
        raise bad_request("the prompt must not be empty", "prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise bad_request(f"token ids must lie in [0, {vocab_size})", "prompt")
    return list(ids)
