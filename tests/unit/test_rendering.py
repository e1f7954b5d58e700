"""The renderer (req T-1 to T-3): template choice, developer messages, parts, template errors."""

import json

import msgspec
import pytest

from frontend.base.api_models import ChatMessage
from frontend.input.rendering import (
    RenderError,
    RenderParams,
    TemplateSettings,
    check_render_params,
    developer_as_system,
    load_chat_template,
    render,
    template_messages,
)
from shared.tokenizer import load_tokenizer
from tests.tiny_tokenizer import tiny_tokenizer

NO_SETTINGS = TemplateSettings()
ECHO = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def msgs(*pairs) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_renders_the_tokenizers_template(tokenizer):
    out = render(tokenizer, msgs(("user", "hi")), RenderParams(), NO_SETTINGS)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert out.template_text == expected and out.text == expected


def test_injected_prefix_stays_apart(tokenizer):
    out = render(tokenizer, msgs(("user", "hi")), RenderParams(injected_prefix="<tool_call>"),
                 NO_SETTINGS)
    assert not out.template_text.endswith("<tool_call>")
    assert out.text == out.template_text + "<tool_call>"


def test_template_precedence(tokenizer):
    server = TemplateSettings(chat_template="SERVER{{ messages[0].content }}")
    both = RenderParams(request_template="REQUEST{{ messages[0].content }}")
    assert render(tokenizer, msgs(("user", "x")), both, server).text == "REQUESTx"
    assert render(tokenizer, msgs(("user", "x")), RenderParams(), server).text == "SERVERx"


def test_no_template_anywhere_is_a_clear_error():
    with pytest.raises(RenderError, match="no chat template.*--chat-template"):
        render(tiny_tokenizer(chat_template=None), msgs(("user", "hi")), RenderParams(),
               NO_SETTINGS)


def test_template_exception_carries_the_templates_reason(tokenizer):
    template = "{{ raise_exception('reasoning_effort must be one of: low, high') }}"
    with pytest.raises(RenderError, match="reasoning_effort must be one of: low, high"):
        render(tokenizer, msgs(("user", "hi")), RenderParams(request_template=template),
               NO_SETTINGS)


def test_template_syntax_error_is_a_render_error(tokenizer):
    with pytest.raises(RenderError, match="rejected"):
        render(tokenizer, msgs(("user", "hi")), RenderParams(request_template="{% for %}"),
               NO_SETTINGS)


def test_developer_becomes_system_and_merges(tokenizer):
    conv = template_messages(msgs(("system", "A"), ("developer", "B"), ("user", "hi")))
    assert developer_as_system(conv, ECHO) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"},
    ]
    out = render(tokenizer, msgs(("developer", "Be brief."), ("user", "hi")), RenderParams(),
                 NO_SETTINGS)
    # SmolLM2's template has no developer branch: one system turn, not its default one.
    assert out.text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert out.text.count("<|im_start|>system") == 1


def test_developer_kept_when_the_template_knows_it():
    template = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    conv = template_messages(msgs(("developer", "B"), ("user", "hi")))
    assert developer_as_system(conv, template) == conv


def test_content_parts_are_joined():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    m = msgspec.convert({"role": "user", "content": parts}, ChatMessage)
    assert template_messages([m])[0]["content"] == "one\ntwo"
    image = msgspec.convert(
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        ChatMessage,
    )
    with pytest.raises(RenderError, match="image_url"):
        template_messages([image])


def test_tools_and_kwargs_reach_the_template(tokenizer):
    template = ("{{ tools | map(attribute='function.name') | join(',') }}|{{ flavour }}|"
                "{{ messages[0].tool_calls[0].function.arguments.city }}")
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [ChatMessage(role="assistant", content=None, tool_calls=[call])]
    params = RenderParams(request_template=template, tools=tools,
                          template_kwargs={"flavour": "mint"})
    assert render(tokenizer, messages, params, NO_SETTINGS).text == "weather|mint|Paris"


def test_continue_final_message(tokenizer):
    params = RenderParams(add_generation_prompt=False, continue_final_message=True)
    conv = msgs(("user", "Count:"), ("assistant", "1, 2,"))
    out = render(tokenizer, conv, params, NO_SETTINGS)
    assert out.text.endswith("<|im_start|>assistant\n1, 2,")


@pytest.mark.parametrize("params,conv,field", [
    (RenderParams(continue_final_message=True), msgs(("assistant", "a")),
     "continue_final_message"),  # add_generation_prompt defaults to true
    (RenderParams(add_generation_prompt=False, continue_final_message=True),
     msgs(("user", "a")), "continue_final_message"),
    (RenderParams(template_kwargs={"add_generation_prompt": False}), msgs(("user", "a")),
     "chat_template_kwargs"),
])
def test_render_params_checks(params, conv, field):
    with pytest.raises(RenderError) as info:
        check_render_params(params, conv)
    assert info.value.param == field


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ inline }}") == "{{ inline }}"
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_a_tool_round_trip_renders_with_the_default_template(tokenizer):
    """The OpenAI tool loop sends the assistant's call back with content null; templates
    that concatenate content (SmolLM2's does) must still render it."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": "Paris"})}}
    messages = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="c1"),
    ]
    out = render(tokenizer, messages, RenderParams(), NO_SETTINGS)
    assert "Weather in Paris?" in out.text and '{"temp": 21}' in out.text
    assert template_messages(messages)[1]["content"] == ""


# ---------------------------------------------------------------- template inputs (issue 17)

PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}"
                  "S:{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]"
                  "{% endfor %}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template, expected", [
    (ECHO, "string"),
    (PARTS_TEMPLATE, "openai"),
    ("{% for p in message['content'] %}{{ p.text }}{% endfor %}", "openai"),
    ("{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}",
     "openai"),
    ("{% for m in messages %}{% for x in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %", "string"),  # unparseable: the render reports it
])
def test_content_format_is_read_from_the_template(template, expected):
    from frontend.input.rendering import content_format

    assert content_format(template) == expected


def test_templates_that_loop_over_content_get_parts(tokenizer):
    parts = [{"type": "text", "text": "one"}, {"type": "refusal", "refusal": "no"}]
    messages = [msgspec.convert({"role": "user", "content": parts}, ChatMessage),
                ChatMessage(role="assistant", content="plain"),
                ChatMessage(role="assistant", content=None)]
    params = RenderParams(request_template=PARTS_TEMPLATE, add_generation_prompt=False)
    auto = render(tokenizer, messages, params, NO_SETTINGS).text
    assert auto == "<user>[one][no]<assistant>[plain]<assistant>"
    as_strings = render(tokenizer, messages, params, TemplateSettings(content_format="string"))
    assert as_strings.text == "<user>S:one\nno<assistant>S:plain<assistant>S:"
    forced = render(tokenizer, msgs(("user", "hi")), RenderParams(request_template=ECHO),
                    TemplateSettings(content_format="openai"))
    assert "'text': 'hi'" in forced.text  # a string template printing the parts it was given


def test_developer_messages_merge_as_parts_too():
    parts = template_messages(msgs(("system", "A"), ("developer", "B"), ("user", "hi")),
                              parts=True)
    merged = developer_as_system(parts, PARTS_TEMPLATE)
    assert merged[0] == {"role": "system", "content": [{"type": "text", "text": "A"},
                                                       {"type": "text", "text": "B"}]}


def test_documents_reach_the_template(tokenizer):
    template = "{% for d in documents %}{{ d.title }}={{ d.text }};{% endfor %}"
    out = render(tokenizer, msgs(("user", "hi")), RenderParams(
        request_template=template, documents=[{"title": "a", "text": "x"},
                                              {"title": "b", "text": "y"}]), NO_SETTINGS)
    assert out.text == "a=x;b=y;"


def test_reasoning_reaches_the_template_under_either_name(tokenizer):
    """vLLM's `reasoning` (what --reasoning-field reasoning answers with) and the older
    `reasoning_content` both come back to the template as reasoning_content."""
    template = ("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content | default('-') }}"
                ";{% endfor %}")
    sent = [msgspec.convert(m, ChatMessage) for m in (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r1"},
        {"role": "assistant", "content": "a", "reasoning_content": "r2"},
        {"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "r3"})]
    out = render(tokenizer, sent, RenderParams(request_template=template,
                                               add_generation_prompt=False), NO_SETTINGS)
    assert out.text == "user:-;assistant:r1;assistant:r2;assistant:r3;"
