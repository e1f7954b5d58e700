"""The input stage end to end, in process: BOS handling (req T-4), passthrough (T-10),
error mapping, and the request log line (L-4)."""

import asyncio
import base64
import logging
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError
from frontend.input.rendering import TemplateSettings
from frontend.input.tokenization import InputSettings, Tokenization
from frontend.pipeline.input_stage import chat_input, completion_input
from shared.tokenizer import load_tokenizer, tokenizer_facts
from tests.tiny_tokenizer import BOS_ID, MAX_CHARS_PER_TOKEN, tiny_tokenizer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("default")


def context(tokenizer, max_chars, **settings):
    stage = Tokenization(tokenizer, InputSettings(max_chars_per_token=max_chars, threads=2,
                                                  **settings))
    client = SimpleNamespace(stats=SimpleNamespace(max_model_len=MAX_MODEL_LEN), may_serve=True,
                             engine_alive=True)
    return SimpleNamespace(client=client, tokenization=stage, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def smol_ctx(smol):
    ctx = context(smol, tokenizer_facts(smol, "default").max_chars_per_token)
    yield ctx
    ctx.tokenization.shutdown()


@pytest.fixture(scope="module")
def tiny_ctx():
    ctx = context(tiny_tokenizer(), MAX_CHARS_PER_TOKEN)
    yield ctx
    ctx.tokenization.shutdown()


def chat(ctx, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return asyncio.run(chat_input(ctx, msgspec.convert(body, ChatCompletionRequest)))


def complete(ctx, **body):
    return asyncio.run(completion_input(ctx, msgspec.convert(body, CompletionRequest)))


def error_of(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------- BOS (T-4)


def test_chat_has_the_templates_single_bos_and_completions_the_tokenizers(tiny_ctx):
    ids = chat(tiny_ctx).tokens.ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1  # from the template, not doubled
    assert complete(tiny_ctx, prompt="hello world").tokens.ids == [BOS_ID, 9, 10]


def test_smollm2_bos_is_whatever_the_template_writes(smol_ctx, smol):
    # SmolLM2's "BOS" is <|im_start|>, which its template opens every turn with, and its
    # tokenizer adds no special tokens to plain text.
    prompt = chat(smol_ctx)
    assert prompt.tokens.ids == smol.encode(prompt.rendered.text, add_special_tokens=False)
    assert prompt.tokens.ids[0] == smol.bos_token_id and prompt.tokens.ids[1] != smol.bos_token_id
    assert prompt.tokens.ids.count(smol.bos_token_id) == prompt.rendered.text.count("<|im_start|>")
    plain = complete(smol_ctx, prompt="Hello world").tokens.ids
    assert plain == smol.encode("Hello world", add_special_tokens=False)
    assert smol.bos_token_id not in plain


def test_chat_can_opt_into_special_tokens(tiny_ctx):
    """vLLM's chat add_special_tokens (default false): the tokenizer's BOS on top of the
    template's, for templates that leave it out."""
    ids = chat(tiny_ctx, add_special_tokens=True).tokens.ids
    assert ids[:2] == [BOS_ID, BOS_ID]
    assert chat(tiny_ctx, add_special_tokens=False).tokens.ids == chat(tiny_ctx).tokens.ids


def test_completion_can_opt_out_of_special_tokens(tiny_ctx):
    ids = complete(tiny_ctx, prompt="hello", add_special_tokens=False).tokens.ids
    assert ids == [9]


# ---------------------------------------------------------------- passthrough (T-10)


def test_token_ids_skip_rendering(smol_ctx):
    assert chat(smol_ctx, prompt_token_ids=[5, 6, 7]).rendered is None
    assert complete(smol_ctx, prompt=[5, 6, 7]).tokens.ids == [5, 6, 7]
    packed = base64.b64encode(np.array([5, 6, 7], dtype="<i4").tobytes()).decode()
    assert complete(smol_ctx, prompt_token_ids=packed).tokens.ids == [5, 6, 7]


def test_token_ids_are_budgeted_too(smol_ctx):
    too_long = list(range(1, MAX_MODEL_LEN + 3))
    err = error_of(complete, smol_ctx, prompt=too_long)
    assert err.status == 400 and f"{MAX_MODEL_LEN + 2} tokens" in err.message
    cut = complete(smol_ctx, prompt=too_long, truncate_prompt_tokens=-1).tokens
    assert cut.ids == too_long[-(MAX_MODEL_LEN - 1):]
    assert cut.tokens_cut == 3


def test_bad_token_ids(smol_ctx):
    assert "base64" in error_of(complete, smol_ctx, prompt_token_ids="not base64!").message
    assert "lie in" in error_of(complete, smol_ctx, prompt=[10**7]).message
    # vLLM's wording, which clients' tests match: out of vocabulary, and >= 0.
    for prompt, words in (([5, 10**7], "10000000 is out of vocabulary"),
                          ([-1], "greater than or equal to 0"), ([[-1]], "-1 is negative")):
        error = error_of(complete, smol_ctx, prompt=prompt)
        assert error.status == 400 and error.param == "prompt" and words in error.message


# ---------------------------------------------------------------- errors become 400s


def test_request_template_needs_the_servers_consent(smol_ctx):
    err = error_of(chat, smol_ctx, chat_template="{{ 'x' }}")
    assert err.param == "chat_template" and "--trust-request-chat-template" in err.message


def test_trusted_request_template(smol):
    ctx = context(smol, 10, templates=TemplateSettings(trust_request_chat_template=True))
    try:
        out = chat(ctx, chat_template="U:{{ messages[0].content }}")
        assert out.rendered.text == "U:hi"
        err = error_of(chat, ctx, chat_template="{{ raise_exception('effort must be low') }}")
        assert err.status == 400 and "effort must be low" in err.message
    finally:
        ctx.tokenization.shutdown()


def test_field_errors_name_the_field(smol_ctx):
    err = error_of(complete, smol_ctx, prompt="x", truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    assert err.param == "truncate_prompt_tokens"
    err = error_of(chat, smol_ctx, continue_final_message=True)
    assert err.param == "continue_final_message"
    err = error_of(chat, smol_ctx, messages=[{"role": "user", "content": "word " * 500}])
    assert err.param == "messages" and "at least" in err.message


def test_no_engine_is_a_503(smol):
    ctx = context(smol, 10)
    ctx.client.stats = None
    try:
        assert error_of(complete, ctx, prompt="x").status == 503
    finally:
        ctx.tokenization.shutdown()


# ---------------------------------------------------------------- visibility (L-4)


def test_request_log_line_shows_truncation(smol_ctx, smol, caplog):
    caplog.set_level(logging.INFO, logger="sluice.requests")
    text = "word " * 500
    cut = len(smol.encode(text)) - 10
    request = msgspec.convert({"prompt": text, "truncate_prompt_tokens": 10}, CompletionRequest)
    asyncio.run(completion_input(smol_ctx, request))
    [line] = [r.getMessage() for r in caplog.records if r.name == "sluice.requests"]
    assert f"request={request.request_id}" in line  # the engine id ends with this
    assert f"chars=2500 prompt_tokens=10 truncated_tokens={cut}" in line


def test_frontend_flags_reach_the_config():
    from sluice.cli import build_parser, frontend_config

    args = build_parser().parse_args([
        "frontend", "--render-timeout", "2.5", "--chat-template", "{{ x }}",
        "--trust-request-chat-template",
    ])
    config = frontend_config(args, "ipc:///tmp/x", None)
    assert (config.render_timeout_s, config.chat_template, config.trust_request_chat_template) \
        == (2.5, "{{ x }}", True)
    defaults = frontend_config(build_parser().parse_args(["frontend"]), "ipc:///tmp/x", None)
    assert (defaults.render_timeout_s, defaults.chat_template,
            defaults.trust_request_chat_template) == (30.0, None, False)
