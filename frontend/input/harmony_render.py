"""Our Harmony renderer, for a gpt-oss checkpoint that carries no chat template (one that
does is rendered by its own template). It writes what openai-harmony's
`render_conversation_for_completion` writes (tests/unit/test_harmony_render.py compares
them):

- a system message with the model identity, `Reasoning: <effort>` (the request's
  `reasoning_effort`, medium by default) and the valid channels;
- a developer message with the request's system / developer text as `# Instructions` and
  its tools as a TypeScript-like `namespace functions`;
- the conversation: an assistant's answer on the `final` channel, its calls as
  `to=functions.NAME` commentary messages (`<|constrain|>json`) ending in `<|call|>`, and a
  tool result as a message from `functions.NAME` (the call its tool_call_id names: a
  tool message naming no earlier call is a 400). An assistant's reasoning is kept as its
  `analysis` message only in the turn still in progress (after the last user message):
  earlier turns' analysis is dropped, as the format requires;
- `<|start|>assistant`, for the model to continue.

Message text that spells a Harmony marker (`<|channel|>` ...) is escaped (`escape_markers`), so
a user cannot forge a message: the prompt is tokenized as one text, where a marker would
otherwise become the special token.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from frontend.input.rendering import (
    RenderedPrompt,
    RenderError,
    RenderParams,
    TemplateSettings,
    render_with_template,
    template_messages,
)

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>", "<|endoftext|>", "<|startoftext|>")
# U+2060 WORD JOINER after `<|`: the text reads the same, and no longer tokenizes as the
# special token.
_JOINER = "\u2060"

GENERATION_OPENER = "<|start|>assistant"  # where the model's answer begins
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")


def escape_markers(text: str) -> str:
    for marker in MARKERS:
        if marker in text:
            text = text.replace(marker, "<|" + _JOINER + marker[2:])
    return text


def _text(content: Any) -> str:
    """A message's content (a string or text parts, as template_messages gives) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if isinstance(p, dict))


def render_for_harmony(tok, messages, params: RenderParams, settings: TemplateSettings
                       ) -> RenderedPrompt:
    """The checkpoint's own template (or the configured one) when there is one, else ours;
    message text escaped either way."""
    conversation = [_escaped(m) for m in template_messages(messages)]
    call_names(conversation)  # a tool message naming no call is a 400 either way
    if params.request_template or settings.chat_template:  # a template the server chose
        return render_with_template(tok, conversation, params, settings)
    if tok.chat_template:
        rendered = render_with_template(tok, conversation, params, settings)
    else:
        rendered = RenderedPrompt(render_harmony(conversation, params.tools,
                                                 params.template_kwargs,
                                                 params.add_generation_prompt),
                                  params.injected_prefix)
    return _without_opener_usage(tok, rendered, params)


def _without_opener_usage(tok, rendered: RenderedPrompt, params: RenderParams
                          ) -> RenderedPrompt:
    """The model's own template ends a prompt with the generation opener it adds; its
    tokens are not the client's prompt and usage leaves them out (TensorRT-LLM's
    prompt_tokens_excluded_from_usage), only when the template wrote it last."""
    if not params.add_generation_prompt or params.continue_final_message:
        return rendered
    if not rendered.template_text.endswith(GENERATION_OPENER):
        return rendered
    opener = tuple(tok.encode(GENERATION_OPENER, add_special_tokens=False))
    return msgspec.structs.replace(rendered, usage_excluded_ids=opener)


def _escaped(m: dict[str, Any]) -> dict[str, Any]:
    out = dict(m)
    if isinstance(m["content"], str):
        out["content"] = escape_markers(m["content"])
    if m.get("reasoning_content"):
        # gpt-oss's own template reads an assistant's analysis as `thinking`.
        out["reasoning_content"] = out["thinking"] = escape_markers(m["reasoning_content"])
    return out


def call_names(conversation: list[dict[str, Any]]) -> list[str | None]:
    """Per message, the function a tool message answers (None for other roles): the call
    of an earlier assistant message its tool_call_id names. RenderError when none does."""
    calls: dict[str, str] = {}
    names: list[str | None] = []
    for i, m in enumerate(conversation):
        name = None
        if m["role"] == "assistant":
            for call in m.get("tool_calls") or ():
                if call.get("id"):
                    calls[call["id"]] = (call.get("function") or {}).get("name") or ""
        elif m["role"] == "tool":
            name = calls.get(m.get("tool_call_id") or "")
            if name is None:
                raise RenderError(
                    f"messages[{i}]: the tool message's tool_call_id "
                    f"{m.get('tool_call_id')!r} names no tool call of an earlier assistant "
                    "message", "messages")
        names.append(name)
    return names


def render_harmony(conversation: list[dict[str, Any]], tools: list[dict] | None,
                   kwargs: dict[str, Any], add_generation_prompt: bool = True) -> str:
    """`conversation`: messages as `frontend.input.rendering.template_messages` gives them."""
    effort = kwargs.get("reasoning_effort") or "medium"
    if effort not in EFFORTS:
        raise RenderError(f"reasoning_effort must be one of {', '.join(EFFORTS)} for this "
                          f"model; got {effort!r}", "reasoning_effort")
    system = f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\n\nReasoning: {effort}\n\n"
    system += ("# Valid channels: analysis, commentary, final. "
               "Channel must be included for every message.")
    if tools:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [_message("system", system)]
    instructions = [escape_markers(_text(m["content"])) for m in conversation
                    if m["role"] in ("system", "developer")]
    developer = ""
    if any(instructions):
        developer = "# Instructions\n\n" + "\n\n".join(i for i in instructions if i)
    if tools:
        developer += ("\n\n" if developer else "") + tools_namespace(tools)
    if developer:
        out.append(_message("developer", developer))
    rest = [m for m in conversation if m["role"] not in ("system", "developer")]
    last_user = max((i for i, m in enumerate(rest) if m["role"] == "user"), default=-1)
    names = call_names(rest)
    for i, m in enumerate(rest):
        role = m["role"]
        if role == "user":
            out.append(_message("user", escape_markers(_text(m["content"]))))
        elif role == "assistant":
            out += _assistant(m, in_progress=i > last_user)
        elif role == "tool":
            out.append(f"<|start|>functions.{names[i]} to=assistant<|channel|>commentary"
                       f"<|message|>{escape_markers(_text(m['content']))}<|end|>")
        else:
            raise RenderError(f"messages[{i}]: role {role!r} is not supported by this model")
    if add_generation_prompt:
        out.append(GENERATION_OPENER)
    return "".join(out)


def _message(role: str, body: str) -> str:
    return f"<|start|>{role}<|message|>{body}<|end|>"


def _assistant(m: dict[str, Any], *, in_progress: bool) -> list[str]:
    out = []
    reasoning = m.get("reasoning_content")
    if reasoning and in_progress:
        out.append(f"<|start|>assistant<|channel|>analysis<|message|>"
                   f"{escape_markers(reasoning)}<|end|>")
    text = escape_markers(_text(m.get("content")))
    tool_calls = m.get("tool_calls") or []
    if text:
        # Text beside calls is a preamble (commentary); alone it is the answer.
        channel = "commentary" if tool_calls else "final"
        out.append(f"<|start|>assistant<|channel|>{channel}<|message|>{text}<|end|>")
    for call in tool_calls:
        function = call.get("function") or {}
        name = function.get("name") or ""
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {},
                                   ensure_ascii=False)
        out.append(f"<|start|>assistant to=functions.{name}<|channel|>commentary "
                   f"<|constrain|>json<|message|>{escape_markers(arguments)}<|call|>")
    return out


# ---------------------------------------------------------------- tools as TypeScript


def tools_namespace(tools: list[dict]) -> str:
    lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
    for tool in tools:
        function = tool.get("function") or {}
        description = function.get("description")
        if description:
            lines += [f"// {line}" for line in escape_markers(description).splitlines()]
        params = function.get("parameters")
        if params is None:
            lines.append(f"type {function.get('name')} = () => any;")
        else:
            lines.append(f"type {function.get('name')} = (_: {_type(params, 0)}) => any;")
        lines.append("")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _literal(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _type(schema: Any, depth: int) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"]) or "never"
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type(s, depth) for s in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type({**schema, "type": k}, depth) for k in kind)
    if kind == "object":
        props = schema.get("properties") or {}
        if not props and depth:
            return "object"
        required = set(schema.get("required") or ())
        pad = "    " * depth  # openai-harmony's layout: nested members and brace indented
        lines = ["{"]
        for name, sub in props.items():
            if isinstance(sub, dict) and sub.get("description"):
                lines += [f"{pad}// {line}"
                          for line in escape_markers(sub["description"]).splitlines()]
            mark = "" if name in required else "?"
            default = (f", // default: {_literal(sub['default'])}"
                       if isinstance(sub, dict) and "default" in sub else ",")
            lines.append(f"{pad}{name}{mark}: {_type(sub, depth + 1)}{default}")
        lines.append(pad + "}")
        return "\n".join(lines)
    if kind == "array":
        return f"{_type(schema.get('items'), depth)}[]"
    if kind in ("integer", "number"):
        return "number"
    if kind in ("string", "boolean", "null"):
        return kind
    return "any"
