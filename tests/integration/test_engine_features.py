"""Engine features on the real model: prefix caching through real processes (the shared
stack), and preemption under memory pressure in an in-process engine (no process boundary is
under test there, so it loads no server of its own)."""

import httpx
import pytest

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from tests.servers import metrics
from tests.unit.engine_builders import request, run

SYSTEM = ("You are a meticulous assistant for a shipping company. Answer briefly, cite the "
          "relevant policy number, and never invent policies. ") * 12


def _chat(base_url: str, question: str, **extra) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 8, **extra}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_repeated_system_prompt_is_prefilled_once(base_url):
    first = _chat(base_url, "Can I ship batteries?")
    before = metrics(base_url)
    second = _chat(base_url, "Can I ship batteries?")
    after = metrics(base_url)
    prompt = second["usage"]["prompt_tokens"]
    assert prompt > 200
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    hits = after["sluice:prefix_cache_hits_total"] - before["sluice:prefix_cache_hits_total"]
    fed = after["sluice:computed_tokens_total"] - before["sluice:computed_tokens_total"]
    assert hits >= prompt - 16  # every full page of the prompt came from the cache
    assert fed < 16 + second["usage"]["completion_tokens"]


def test_cache_salt_keeps_tenants_apart(base_url):
    _chat(base_url, "Do you ship to Iceland?", cache_salt="tenant-a")
    before = metrics(base_url)
    _chat(base_url, "Do you ship to Iceland?", cache_salt="tenant-b")
    after = metrics(base_url)
    assert after["sluice:prefix_cache_hits_total"] == before["sluice:prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def starved():
    # 8 pages of 16 tokens: any one request (3 pages at its end) fits, six at once do not.
    return build_engine(EngineConfig(
        model=default_model_path(), served_model_name="m", request_address="inproc://starved",
        dtype="float32", num_pages=8, max_model_len=128))


@pytest.mark.slow
def test_memory_starved_engine_preempts_and_completes_everything(starved):
    tokenizer = load_tokenizer(default_model_path())
    prompts = [tokenizer.encode(f"Write a short poem about the number {i}.") for i in range(6)]

    def asks(tag: str) -> list:
        return [request(f"{tag}{i}", p, max_tokens=20, ignore_eos=True)
                for i, p in enumerate(prompts)]

    alone = [run(starved, [r])[r.request_id].tokens for r in asks("alone")]
    together = run(starved, asks("together"))  # run() checks every page is free again
    assert [together[f"together{i}"].tokens for i in range(6)] == alone
    assert all(len(tokens) == 20 for tokens in alone)
    assert starved.num_preemptions > 0
