"""The renderer: chat messages -> prompt text (req T-1 to T-3).

It only makes text; tokenizing is the next stage, with its own parameters
(`frontend.input.budgets`). `render` is synchronous and runs in
`frontend.input.tokenization`'s pool, under the render timeout.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import msgspec

from frontend.base.api_models import ChatMessage

# Arguments the renderer passes itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class RenderError(ValueError):
    """The request cannot be rendered; a 400 carrying the reason. `param` names the field."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


class TemplateSettings(msgspec.Struct, frozen=True):
    """Server-wide template choices, fixed at start-up."""

    chat_template: str | None = None  # --chat-template, already read from its file
    trust_request_chat_template: bool = False
    # --chat-template-content-format: how templates get content parts; auto reads the
    # template (`content_format`).
    content_format: str = "auto"
    # --default-chat-template-kwargs: every request's chat_template_kwargs start from these.
    default_kwargs: dict = {}
    # A gpt-oss model (Harmony format): its prompts go through frontend.input.harmony_render
    # (markers in message text escaped; our renderer where there is no chat template).
    harmony: bool = False
    # --tokenizer-mode mistral: mistral-common renders (frontend.input.mistral_render).
    mistral: bool = False


class RenderParams(msgspec.Struct, frozen=True, kw_only=True):
    """The renderer's own parameters (req T-1)."""

    request_template: str | None = None  # the request's chat_template, when trusted
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None  # RAG documents (vLLM's `documents`)
    template_kwargs: dict[str, Any] = {}
    # Text the server appends after the template's output (e.g. a forced tool-call opening).
    injected_prefix: str = ""
    # The model's image placeholder, set when the messages hold image parts (req T-13):
    # "openai" templates get {"type": "image"} parts and write it themselves; "string"
    # ones get it in the joined text.
    image_placeholder: str | None = None


class RenderedPrompt(msgspec.Struct, frozen=True):
    """The template's own text, kept apart from what the server injected: parsers read the
    template's view of the conversation, the model reads both (req T-1)."""

    template_text: str
    injected_prefix: str = ""
    # The prompt's ids when the renderer tokenized it itself (--tokenizer-mode mistral);
    # None: the tokenizer stage tokenizes `text`.
    token_ids: list[int] | None = None
    # Trailing prompt ids the model's own template adds that usage does not count (a Harmony
    # generation opener, `<|start|>assistant`; TensorRT-LLM's prompt_tokens_excluded_from_
    # usage); empty under a server or request template.
    usage_excluded_ids: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        return self.template_text + self.injected_prefix


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # not Jinja: a path that does not exist
        raise FileNotFoundError(f"--chat-template: no such file: {value}")
    return value


def check_render_params(params: RenderParams, messages: list[ChatMessage]) -> None:
    if params.continue_final_message and params.add_generation_prompt:
        raise RenderError(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the last message",
            "continue_final_message",
        )
    if params.continue_final_message and (not messages or messages[-1].role != "assistant"):
        raise RenderError(
            "continue_final_message needs the last message to be the assistant's",
            "continue_final_message",
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(params.template_kwargs))
    if reserved:
        raise RenderError(
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request field",
            "chat_template_kwargs",
        )


# ---------------------------------------------------------------- template choice (req T-2)


def resolve_template(tok, params: RenderParams, settings: TemplateSettings) -> str:
    """The request's template (only when trusted; checked by the caller), the server's, then
    the tokenizer's. A tokenizer may hold several named ones; its own lookup picks one."""
    explicit = params.request_template or settings.chat_template
    if explicit is None and not tok.chat_template:
        raise RenderError(
            "This model has no chat template, and none was configured: start the server with "
            "--chat-template, or use /v1/completions with a prompt"
        )
    try:
        return tok.get_chat_template(explicit, params.tools)
    except ValueError as exc:  # several named templates and no default among them
        raise RenderError(str(exc), "chat_template") from exc


# ---------------------------------------------------------------- messages


_IMAGE_PARTS = ("image_url", "input_image")


def _text_parts(message: ChatMessage, image_placeholder: str | None = None
                ) -> str | list[dict[str, str]] | None:
    """The content as sent, with parts as {"type": "text", "text": ...} (a refusal is text)
    and images, when the model takes them, as {"type": "image"}, as HF templates expect."""
    if message.content is None or isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.type in _IMAGE_PARTS and image_placeholder is not None:
            parts.append({"type": "image"})
            continue
        if part.type not in ("text", "refusal"):
            raise RenderError(f"content parts of type {part.type!r} are not supported")
        text = (part.text if part.type == "text" else part.refusal) or ""
        parts.append({"type": "text", "text": text})
    return parts


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (it wants the parts, as
    vLLM detects), else "string". Unparseable templates are left for the render to report."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter | nodes.Test) and target.node is not None:
            target = target.node  # `message.content | list` and the like
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return "openai"
        if (isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const)
                and target.arg.value == "content"):
            return "openai"
    return "string"


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # OpenAI sends arguments as a JSON string; HF templates iterate them as a mapping.
    out = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass  # not JSON: the template gets the string as sent
            call = {**call, "function": function}
        out.append(call)
    return out


def template_messages(messages: list[ChatMessage], parts: bool = False,
                      image_placeholder: str | None = None) -> list[dict[str, Any]]:
    """Messages as HF templates read them; `parts`: content as a list of text parts (for
    "openai" templates), else one string (an image as the model's placeholder)."""
    out = []
    for m in messages:
        # OpenAI's tool loop sends an assistant's calls back with content null; templates
        # that use the content as text (SmolLM2's) fail on it, and "" means the same.
        content = _text_parts(m, image_placeholder)
        if content is None:
            content = [] if parts else ""
        elif parts and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not parts and not isinstance(content, str):
            content = "\n".join(p["text"] if p["type"] == "text" else image_placeholder
                                for p in content)
        entry: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls is not None:
            entry["tool_calls"] = _tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            entry["reasoning_content"] = reasoning  # the name templates read
        out.append(entry)
    return out


def developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """req T-3: a template with no developer branch would treat one as a user turn (or
    reject it), so it becomes system, merged with system messages next to it, because many
    templates only accept one system message, first."""
    if "developer" in template or not any(m["role"] == "developer" for m in messages):
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        m = {**m, "role": "system"} if m["role"] == "developer" else m
        if m["role"] == "system" and out and out[-1]["role"] == "system":
            before, content = out[-1]["content"], m["content"]
            merged = (before + content if isinstance(before, list)  # "openai" parts
                      else "\n\n".join(p for p in (before, content) if p))
            out[-1] = {**out[-1], "content": merged}
        else:
            out.append(m)
    return out


# ---------------------------------------------------------------- rendering


def render(
    tok, messages: list[ChatMessage], params: RenderParams, settings: TemplateSettings
) -> RenderedPrompt:
    """Messages through the chat template. A Harmony model's prompts come from
    frontend.input.harmony_render instead; frontend.input.tokenization picks which."""
    template = resolve_template(tok, params, settings)
    wanted = settings.content_format
    parts = (content_format(template) if wanted == "auto" else wanted) == "openai"
    conversation = developer_as_system(
        template_messages(messages, parts, params.image_placeholder), template)
    return _apply(tok, template, conversation, params)


def render_with_template(tok, conversation: list[dict[str, Any]], params: RenderParams,
                         settings: TemplateSettings) -> RenderedPrompt:
    """`conversation` (template_messages' dicts, content as text) through the template."""
    template = resolve_template(tok, params, settings)
    return _apply(tok, template, developer_as_system(conversation, template), params)


def _apply(tok, template: str, conversation: list[dict[str, Any]], params: RenderParams
           ) -> RenderedPrompt:
    try:
        text = tok.apply_chat_template(
            conversation,
            tools=params.tools,
            documents=params.documents,
            chat_template=template,
            add_generation_prompt=params.add_generation_prompt,
            continue_final_message=params.continue_final_message,
            tokenize=False,
            return_dict=False,  # explicit: transformers v5 changed the default
            **params.template_kwargs,
        )
    except Exception as exc:  # templates reject bad input by raising: the client's 400
        raise RenderError(f"The chat template rejected the request: {_reason(exc)}") from exc
    return RenderedPrompt(text, params.injected_prefix)


def _reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__
