"""The fields vLLM's answers carry beyond OpenAI's core: return_token_ids whole and streamed,
the always-present null fields, the model card's root, through the HTTP API with the official
client on the session's shared stack (float32, greedy: streamed and whole answers agree token
for token)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE = "The capital of France is"
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_a_chat_stream_names_the_prompt_once_and_every_token(client, tokenizer):
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=40,
                                           temperature=0, extra_body=IDS)
    stream = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=40,
                                            temperature=0, stream=True, extra_body=IDS)
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump(exclude_unset=True) for c in chunks[1:])
    ids = [t for c in chunks[1:] for t in c.choices[0].token_ids]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert ids == whole.choices[0].token_ids and len(ids) == whole.usage.completion_tokens
    assert content == whole.choices[0].message.content
    ending = "" if whole.choices[0].finish_reason == "length" else tokenizer.eos_token
    assert tokenizer.decode(ids) == content + ending  # the stop token is named too


def test_a_completion_stream_names_the_prompt_in_its_first_chunk(client, tokenizer):
    """As vLLM's own test: with return_tokens_as_token_ids, each chunk's token ids are the
    ones its logprobs name, also while a stop string holds text back."""
    body = {**IDS, "return_tokens_as_token_ids": True}
    stream = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16,
                                       temperature=0, stream=True, logprobs=1,
                                       stop=["answer is"], extra_body=body)
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.prompt_token_ids == tokenizer.encode(FRANCE)
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    named = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    ids = [t for c in chunks for t in c.choices[0].token_ids]
    assert ids == named and ids
    whole = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0,
                                      stop=["answer is"], extra_body=IDS).choices[0]
    assert ids == whole.token_ids
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_each_streamed_choice_names_its_own_tokens(client):
    stream = client.completions.create(model=MODEL, prompt=["Hi", FRANCE], max_tokens=5,
                                       temperature=0, stream=True, extra_body=IDS)
    prompts: dict[int, list[int]] = {}
    ids: dict[int, list[int]] = {}
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.prompt_token_ids is not None:
            assert choice.index not in prompts  # once per choice
            prompts[choice.index] = choice.prompt_token_ids
        ids.setdefault(choice.index, []).extend(choice.token_ids)
    assert len(prompts[0]) < len(prompts[1])
    assert all(len(v) == 5 for v in ids.values())


def test_id_fields_are_null_unless_asked_for(client):
    """vLLM's answers always carry its id fields, so code written against vLLM can read
    `answer.prompt_token_ids` and `choice.token_ids` whether it asked or not."""
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2)
    assert chat.prompt_token_ids is None and chat.choices[0].token_ids is None
    assert chat.prompt_logprobs is None
    text = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2).choices[0]
    assert text.prompt_token_ids is None and text.token_ids is None
    assert text.prompt_logprobs is None
    for chunk in client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2,
                                                stream=True):
        dumped = chunk.model_dump(exclude_unset=True)
        assert "prompt_token_ids" not in dumped
        assert all("token_ids" not in c for c in dumped["choices"])


@pytest.mark.parametrize("value", ["yes", 1, [True], {"a": 1}])
def test_return_token_ids_must_be_a_bool(client, value):
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1, stream=True,
                                       extra_body={"return_token_ids": value})


def test_prompt_logprobs_stay_refused_in_streams(client):
    """As vLLM: a stream cannot carry prompt logprobs; 0 asks for none and is fine."""
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    chunks = list(client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=1,
                                            stream=True, extra_body={"prompt_logprobs": 0}))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_answers_and_chunks_carry_a_null_system_fingerprint(base_url):
    """OpenAI's field, null as vLLM's (no fingerprint to name): present in whole answers and
    in every chunk, so a client reads it without a KeyError."""
    body = {"model": MODEL, "max_tokens": 2}
    for path, extra in (("chat/completions", {"messages": PARIS}),
                        ("completions", {"prompt": FRANCE})):
        answer = httpx.post(f"{base_url}/v1/{path}", json={**body, **extra}, timeout=60).json()
        assert "system_fingerprint" in answer and answer["system_fingerprint"] is None
        with httpx.stream("POST", f"{base_url}/v1/{path}", timeout=60,
                          json={**body, **extra, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and all('"system_fingerprint":null' in c for c in chunks)


def test_the_model_card_names_its_root_and_start(base_url):
    """vLLM's card: `root` is the model loaded, `parent` null, `created` the server's start
    (not 0: a client sorting or caching by it sees a real time)."""
    listed = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]
    one = httpx.get(f"{base_url}/v1/models/{MODEL}", timeout=10).json()
    assert listed == one
    assert one["root"] == default_model_path() and one["parent"] is None
    assert 0 < time.time() - one["created"] < 24 * 3600
    assert isinstance(one["max_model_len"], int) and one["owned_by"] == "sluice"


@pytest.fixture(scope="module")
def detailed(shared_engine, tmp_path_factory):
    """`sluice frontend --enable-prompt-tokens-details --enable-force-include-usage` over the
    session's shared float32 engine (both flags are the frontend's)."""
    s = shared_engine.frontend(str(tmp_path_factory.mktemp("details")), "details",
                               "--enable-prompt-tokens-details", "--enable-force-include-usage")
    yield openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)
    s.stop()


LONG = [{"role": "user", "content": "Tell me about rivers. " * 20 + "Which is longest?"}]


def test_usage_says_how_many_prompt_tokens_were_cached(detailed):
    """vLLM's --enable-prompt-tokens-details: the first request with a salt finds nothing
    cached; the same prompt again finds all its full pages but the last token's."""
    salt = {"cache_salt": f"details-{time.time()}"}
    first = detailed.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1,
                                             extra_body=salt).usage
    again = detailed.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1,
                                             extra_body=salt).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert again.prompt_tokens == first.prompt_tokens > 100
    assert again.prompt_tokens - 32 < cached < again.prompt_tokens  # whole pages, not the last
    # n candidates share one prompt, counted once in prompt_tokens and in cached_tokens.
    many = detailed.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1, n=3,
                                            extra_body=salt).usage
    assert many.prompt_tokens == first.prompt_tokens
    assert many.prompt_tokens_details.cached_tokens == cached
    text = detailed.completions.create(model=MODEL, prompt=["Hi there", FRANCE * 12],
                                       max_tokens=1, extra_body={"cache_salt": "t"}).usage
    assert 0 <= text.prompt_tokens_details.cached_tokens < text.prompt_tokens


def test_forced_usage_ends_every_stream(detailed, client):
    """--enable-force-include-usage: a stream without stream_options still ends with the
    usage chunk (details included); the shared stack, without the flag, sends none."""
    salt = {"cache_salt": f"forced-{time.time()}"}
    for _ in range(2):
        chunks = list(detailed.chat.completions.create(model=MODEL, messages=LONG,
                                                       max_tokens=3, stream=True,
                                                       extra_body=salt))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 3
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])  # not continuous: only the last
    chunks = list(detailed.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2,
                                              stream=True))
    assert chunks[-1].usage.completion_tokens == 2
    plain = list(client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2,
                                                stream=True))
    assert all(c.usage is None for c in plain)
    whole = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2).usage
    assert whole.prompt_tokens_details is None  # not asked for at start: left out


def test_prompt_logprobs_are_whole_when_the_prompt_is_cached(detailed):
    """A prompt whose pages sit in the prefix cache still gets a logprob for every prompt
    token, the same ones as when it was computed fresh: such a request skips the cache
    (the cached pages hold no logits), and still fills it for the requests after it."""
    prompt = "Once upon a time in a small village there lived a baker " * 4
    salt = {"cache_salt": f"plp-{time.time()}"}

    def ask(**extra):
        return detailed.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                           temperature=0, extra_body={**salt, **extra})

    first = ask(prompt_logprobs=1)
    warm = ask()  # reads the pages the prompt_logprobs request left in the cache
    again = ask(prompt_logprobs=1)
    echoed = detailed.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         temperature=0, echo=True, logprobs=0, extra_body=salt)
    n = first.usage.prompt_tokens
    assert warm.usage.prompt_tokens_details.cached_tokens > n // 2
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert len(first.choices[0].prompt_logprobs) == len(again.choices[0].prompt_logprobs) == n
    assert again.choices[0].prompt_logprobs == first.choices[0].prompt_logprobs
    assert len(echoed.choices[0].logprobs.tokens) == n + 1  # the prompt's and the answer's
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in echoed.choices[0].logprobs.token_logprobs[1:])
