"""Greedy tokens of our engine equal HF transformers' greedy generate (fp32, same GGUF).

Eight varied prompts: short and long (several KV pages and several prefill chunks, since the
cluster's step budget is 256 tokens), raw text and multi-turn chat; 64 new tokens each, sent
to the engine one at a time and all at once, and through both frontends over HTTP.
"""

import concurrent.futures

import httpx
import pytest
import torch

from shared.model_source import default_model_path
from shared.protocol import SamplingParams
from shared.tokenizer import load_tokenizer
from tests.engine_client import RawEngineClient
from tests.hf_default_model import hf_default_model

# pytest-timeout counts a test's setup: the first test's is transformers' reference (~200
# CPU-seconds on an AVX2-only or loaded machine), which with the test itself can pass 600 s.
# `reference_job` first: transformers' reference runs on a thread while the cluster's engine
# starts (another process), instead of after it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.usefixtures("reference_job")]
NEW_TOKENS = 64

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting each of "
    "the one hundred and twelve steps. The lamp above needed oil, the lens needed polishing, "
    "and the logbook needed an entry about the weather, the ships that passed and the birds. "
)


def chat(*turns: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return messages


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return reference_prompts()


def reference_prompts(model_path: str | None = None) -> list[list[int]]:
    """The eight prompts (tests/gpu/test_flashinfer.py checks a GPU engine on them too, in
    its model's tokenizer)."""
    tok = load_tokenizer(model_path or default_model_path())

    def render(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    long_text = "".join(f"Chapter {i}. {STORY}" for i in range(12)) + "What happened next?"
    built = [
        tok.encode("The capital of France is"),
        render(chat("What is the capital of France?")),
        render(chat("Hi! Who are you?", "I am SmolLM, an assistant.",
                    "Tell me a fun fact about octopuses.")),
        render(chat("Write a Python function that reverses a string.",
                    system="You are a terse senior engineer.")),
        tok.encode(long_text),
        render(chat(STORY * 3 + "Summarise this story in two sentences.")),
        tok.encode("def fibonacci(n):\n"),
        tok.encode("La tour Eiffel est"),
    ]
    assert len(built[4]) > 600  # spans several pages and three 256-token prefill chunks
    return built


@pytest.fixture(scope="session")
def reference_job(prompts):
    """transformers' greedy tokens, computed on a thread from the moment this module starts
    (session scope, so it is set up before the session's `cluster`, whose engine start it
    overlaps; defined here, so only this module starts it)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(transformers_greedy, prompts)
        yield job


@pytest.fixture(scope="module")
def reference(reference_job) -> list[list[int]]:
    return reference_job.result()


def transformers_greedy(prompts: list[list[int]]) -> list[list[int]]:
    model = hf_default_model()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outputs.append(out[0, len(ids):].tolist())
    assert all(len(o) == NEW_TOKENS for o in outputs)
    return outputs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_one_at_a_time_matches_transformers(cluster, prompts, reference):
    client = RawEngineClient(cluster.engine_address)
    try:
        ours = [client.generate([p], GREEDY)[0] for p in prompts]
    finally:
        client.close()
    for i, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert mine == theirs, f"prompt {i} diverges at {_first_difference(mine, theirs)}"


def test_all_at_once_matches_transformers(cluster, prompts, reference):
    client = RawEngineClient(cluster.engine_address)
    try:
        ours = client.generate(prompts, GREEDY)
    finally:
        client.close()
    for i, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert mine == theirs, f"prompt {i} diverges at {_first_difference(mine, theirs)}"


def test_http_text_through_both_frontends_matches(cluster, prompts, reference):
    tok = load_tokenizer(default_model_path())
    expected = [tok.decode(r, skip_special_tokens=True) for r in reference]

    def ask(i: int) -> str:
        url = cluster.base_urls[i % 2]
        body = {"prompt": prompts[i], "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(ask, range(len(prompts))))
    assert texts == expected


def _first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
