"""--tokenizer-mode auto on a Mistral-format folder (tekken.json built offline, no HF
tokenizer files; tests/tiny_mistral.py): `sluice serve` tokenizes and renders chat with
mistral-common, and every count and id matches mistral-common itself. One server."""

import os

import httpx
import pytest

from tests.servers import Stack
from tests.tiny_mistral import build_tiny_mistral

TEXTS = ["hello world", "Hello World, the [INST] thing!", "héllo 日本 there", " "]
CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "be the hi"}, {"role": "user", "content": "hello [INST]"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "the world"}],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi there"}],
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    folder = build_tiny_mistral(str(tmp_path_factory.mktemp("tiny-mistral")))
    assert not os.path.exists(os.path.join(folder, "tokenizer.json"))
    s = Stack(str(tmp_path_factory.mktemp("mistral-serve")), "--model", folder,
              "--served-model-name", "tiny-mistral", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "256", "--num-kv-pages", "64", "--page-size", "4")
    yield s.base_url, MistralTokenizer.from_file(os.path.join(folder, "tekken.json"))
    s.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}{path}", json=body, timeout=60)


def _reference_chat(mistral, messages, tools=None) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    request = ChatCompletionRequest.from_openai(messages, tools=tools)
    return mistral.encode_chat_completion(request).tokens


def test_prompts_tokenize_as_mistral_common(server):
    tekken = server[1].instruct_tokenizer.tokenizer
    for text in TEXTS:
        with_bos = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
        assert with_bos == tekken.encode(text, bos=True, eos=False), text
        bare = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
        assert bare.json()["tokens"] == tekken.encode(text, bos=False, eos=False)
    ids = tekken.encode(TEXTS[1], bos=False, eos=False)
    out = _post(server, "/detokenize", {"tokens": ids}).json()
    assert out["prompt"] == tekken.decode(ids) == TEXTS[1]


def test_chat_renders_as_mistral_common(server):
    for messages in CONVERSATIONS:
        ours = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
        assert ours == _reference_chat(server[1], messages), messages
    with_tools = _post(server, "/tokenize", {"messages": CONVERSATIONS[0], "tools": TOOLS})
    assert with_tools.json()["tokens"] == _reference_chat(server[1], CONVERSATIONS[0], TOOLS)
    chat = _post(server, "/v1/chat/completions", {"messages": CONVERSATIONS[1],
                                                  "max_tokens": 3, "temperature": 0})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] == len(_reference_chat(server[1], CONVERSATIONS[1]))
    completion = _post(server, "/v1/completions", {"prompt": TEXTS[1], "max_tokens": 2})
    assert completion.json()["usage"]["prompt_tokens"] == len(
        server[1].instruct_tokenizer.tokenizer.encode(TEXTS[1], bos=True, eos=False))


def test_what_mistral_common_cannot_render_is_a_400(server):
    cases = [
        ({"messages": CONVERSATIONS[0], "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 40_000}]}, "messages"),
    ]
    for body, param in cases:
        r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 1})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    cut = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi " * 300}]})
    assert cut.status_code == 400  # longer than the context: the same length check
    kept = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi " * 300}], "max_tokens": 1,
        "truncate_prompt_tokens": 20})
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 20
