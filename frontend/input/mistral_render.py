"""Chat rendering for --tokenizer-mode mistral: mistral-common's own request encoding.

Mistral's models were trained on what mistral-common's `encode_chat_completion` produces,
so the prompt's tokens come from it directly (control tokens as ids, message text never
read as control tokens), not from a Jinja template re-tokenized. The text kept beside the
ids (control tokens spelled out) is what output parsers read as the template's view.
"""

from __future__ import annotations

from frontend.base.api_models import ChatMessage
from frontend.input.rendering import (
    RenderedPrompt,
    RenderError,
    RenderParams,
    TemplateSettings,
    developer_as_system,
    template_messages,
)


def render_for_mistral(tok, messages: list[ChatMessage], params: RenderParams,
                       settings: TemplateSettings) -> RenderedPrompt:
    if params.request_template is not None:
        raise RenderError("chat_template does not apply to this model: mistral-common "
                          "renders its prompts (--tokenizer-mode mistral)", "chat_template")
    if params.documents:
        raise RenderError("documents are not supported with --tokenizer-mode mistral",
                          "documents")
    # No template mentions developer here: it becomes system, as mistral-common expects.
    conversation = developer_as_system(template_messages(messages), template="")
    for message in conversation:
        message.pop("reasoning_content", None)  # mistral-common has no such field
    try:
        ids, text = tok.mistral.encode_chat(conversation, params.tools,
                                            params.continue_final_message)
    except Exception as exc:  # mistral-common validates the conversation: the client's 400
        raise RenderError(f"mistral-common rejected the messages: {exc}") from exc
    if params.injected_prefix:  # a forced tool call's opening, after the rendered prompt
        ids = ids + tok.encode(params.injected_prefix, add_special_tokens=False)
    return RenderedPrompt(text, params.injected_prefix, token_ids=ids)
