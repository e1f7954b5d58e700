"""use_beam_search (vLLM's extra field) through the HTTP API on the session's shared stack
(float32), token for token against transformers' beam search on the same GGUF in float32
(`generate(num_beams=..., length_penalty=..., early_stopping=..., num_return_sequences=n)`),
for completions and chat, n and best_of; logprobs per beam; stop strings per beam, cut as
the sampling path cuts them; every field that cannot combine a 400 naming it; the new
fields' bounds; and no KV page left owned afterwards.

transformers' references run on a thread from the moment the module starts, beside the
server's first requests.
"""

from __future__ import annotations

import concurrent.futures
import math

import httpx
import pytest
import torch

from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from tests.hf_default_model import hf_default_model
from tests.servers import metrics, wait_until

pytestmark = pytest.mark.timeout(600)

FRANCE = "The capital of France is"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]

# (name, prompt: text for completions or messages for chat, width, n, max_tokens,
#  length_penalty, early_stopping): each early_stopping mode, length penalties below, at and
# above 1, n below the width (best_of), beams that end on EOS and at max_tokens. (The modes'
# differences are tests/unit/test_beam_bookkeeping.py's: on prompts this short they agree.)
CASES = [
    ("completion-n3", FRANCE, 3, 3, 8, 1.0, False),
    ("completion-best_of-never", FRANCE, 3, 2, 8, 2.0, "never"),
    ("chat-n2-true", PARIS, 2, 2, 12, 0.5, True),
    ("chat-n3-false", PARIS, 3, 3, 12, 1.0, False),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _hf_beams(tokenizer, case) -> list[list[int]]:
    """transformers' returned beams, each cut after its EOS (shorter ones come padded)."""
    _, prompt, width, n, max_tokens, penalty, early = case
    ids = _prompt_ids(tokenizer, prompt)
    model = hf_default_model()
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=n,
                             max_new_tokens=max_tokens, do_sample=False,
                             length_penalty=penalty, early_stopping=early,
                             eos_token_id=eos, pad_token_id=eos)
    beams = []
    for row in out[:, len(ids):].tolist():
        beams.append(row[:row.index(eos) + 1] if eos in row else row)
    return beams


@pytest.fixture(scope="module")
def reference(tokenizer):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(lambda: {c[0]: _hf_beams(tokenizer, c) for c in CASES})
        yield job


def _ask(base_url, case, **extra) -> httpx.Response:
    _, prompt, width, n, max_tokens, penalty, early = case
    body = {"max_tokens": max_tokens, "n": n, "use_beam_search": True,
            "length_penalty": penalty, "early_stopping": early, "return_token_ids": True,
            **extra}
    if isinstance(prompt, str):
        if width != n:
            body["best_of"] = width
        return httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, **body},
                          timeout=120)
    return httpx.post(f"{base_url}/v1/chat/completions", json={"messages": prompt, **body},
                      timeout=120)


@pytest.mark.slow  # transformers' beam search on the CPU: seconds a case
def test_beams_match_transformers_token_for_token(base_url, reference, tokenizer):
    before = metrics(base_url)
    ours = {}
    for case in CASES:
        r = _ask(base_url, case)
        assert r.status_code == 200, r.text
        ours[case[0]] = [c["token_ids"] for c in r.json()["choices"]]
    want = reference.result()
    assert ours == want
    assert any(beam[-1] == tokenizer.eos_token_id for beam in want["chat-n3-false"])
    after = metrics(base_url)
    # Beams share their prompt's pages (and each other's) through the prefix cache.
    assert after["sluice:prefix_cache_hits_total"] - before["sluice:prefix_cache_hits_total"] > 200


def test_answers_carry_text_finish_usage_and_logprobs_per_beam(base_url, tokenizer):
    case = ("chat", PARIS, 2, 2, 16, 1.0, False)
    r = _ask(base_url, case, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    scores = []
    for c in choices:
        ids = c["token_ids"]
        stopped = ids[-1] == tokenizer.eos_token_id
        assert c["finish_reason"] == ("stop" if stopped else "length")
        assert c["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
        entries = c["logprobs"]["content"]
        assert len(entries) == len(ids)
        assert all(len(e["top_logprobs"]) == 2 for e in entries)
        total = sum(e["logprob"] for e in entries)
        scores.append(total / len(ids))
    assert scores == sorted(scores, reverse=True)  # best first
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    # A batch of prompts: n choices per prompt, in prompt order.
    r = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "prompt": [FRANCE, "La tour Eiffel est"], "n": 2, "max_tokens": 4,
        "use_beam_search": True, "echo": True})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert texts[0].startswith(FRANCE) and texts[2].startswith("La tour Eiffel est")
    assert texts[0] != texts[1]


@pytest.mark.parametrize(("extra", "field"), [
    ({"stream": True}, "stream"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"n": 11}, "n"),  # 2 * 11 alternatives per step: past --max-logprobs (20)
    ({"length_penalty": 21}, "length_penalty"),
    ({"length_penalty": -21}, "length_penalty"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"early_stopping": "always"}, "early_stopping"),
    ({"early_stopping": 1}, "early_stopping"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"n": 0}, "n"),
])
def test_what_cannot_combine_is_a_400_naming_the_field(base_url, extra, field):
    body = {"messages": PARIS, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_completion_bounds(base_url):
    def ask(**extra):
        body = {"prompt": FRANCE, "max_tokens": 4, "use_beam_search": True, **extra}
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)

    for extra, field in [({"best_of": 1}, "best_of"), ({"best_of": 2, "n": 3}, "best_of"),
                         ({"echo": True, "logprobs": 1}, "echo"),
                         ({"best_of": 11}, "best_of")]:
        r = ask(**extra)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == field
    # A non-finite length_penalty cannot be written in JSON but can arrive (1e999 reads inf).
    r = httpx.post(f"{base_url}/v1/completions", timeout=30, headers={
        "content-type": "application/json"}, content=b'{"prompt": "a", "max_tokens": 2, '
        b'"use_beam_search": true, "length_penalty": 1e999}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    # Greedy is what beam search wants: temperature 0 with best_of > 1 is fine here.
    r = ask(best_of=2, temperature=0, length_penalty=-1.5, early_stopping="never")
    assert r.status_code == 200, r.text
    assert math.isfinite(len(r.json()["choices"]))


def _complete(base_url, **extra) -> dict:
    body = {"prompt": FRANCE, "max_tokens": 12, **extra}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_strings_cut_one_beam_as_greedy_sampling_cuts_them(base_url):
    """One beam is greedy decoding: with stop strings (include_stop_str_in_output, and a
    min_tokens gate that skips the first match) its text, finish_reason and stop_reason are
    the sampling path's, to the character."""
    free = _complete(base_url, temperature=0)["choices"][0]["text"]
    middle = free[len(free) // 2:len(free) // 2 + 2]
    assert middle.strip() and free.count(" ") >= 3, free
    for extra in ({"stop": [middle]}, {"stop": ["zzz", middle], "include_stop_str_in_output": True},
                  {"stop": [" "], "min_tokens": 3}):
        greedy = _complete(base_url, temperature=0, **extra)["choices"][0]
        beam = _complete(base_url, use_beam_search=True, n=1, **extra)["choices"][0]
        got = (beam["text"], beam["finish_reason"], beam["stop_reason"])
        assert got == (greedy["text"], "stop", extra["stop"][-1]), (extra, free)
    assert got[0].startswith(free[:free.index(" ", 1)])  # min_tokens: not the first space


@pytest.mark.parametrize(("stop", "include"), [(" The", False), (" The", True), ("is", False)])
def test_each_beam_ends_at_its_stop_string(base_url, tokenizer, stop, include):
    """Three beams: one ends on the token that completes the stop string (" The" a token
    of its own after " Paris." or after " Paris.\n-"; "is" inside " Paris"), its text cut
    there; the others run on to max_tokens and never show it."""
    body = _complete(base_url, use_beam_search=True, n=3, stop=[stop], max_tokens=8,
                     include_stop_str_in_output=include, return_token_ids=True)
    ended = []
    for c in body["choices"]:
        ids = c["token_ids"]
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if c["finish_reason"] == "stop":
            assert c["stop_reason"] == stop
            ended.append(c["text"])
            assert c["text"] == decoded[:decoded.index(stop) + (len(stop) if include else 0)]
            assert stop not in tokenizer.decode(ids[:-1], skip_special_tokens=True)
        else:
            assert stop not in c["text"] and c["finish_reason"] == "length"
            assert len(ids) == 8
    assert 1 <= len(ended) < 3, body["choices"]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"])
                                                     for c in body["choices"])


@pytest.mark.parametrize(("stop", "status"), [([""], 400), (["a"] * 65, 400), (["a"] * 64, 200)])
def test_stop_strings_bounds_with_beams(base_url, stop, status):
    body = {"prompt": FRANCE, "max_tokens": 2, "n": 2, "use_beam_search": True, "stop": stop}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "stop"


def test_no_page_stays_owned(base_url):
    def idle() -> bool:
        m = metrics(base_url)
        return m["sluice:kv_cache_free_pages"] == m["sluice:kv_cache_total_pages"]

    wait_until(idle, 10, "every KV page free after the beam requests")
