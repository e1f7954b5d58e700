"""Engine features through real processes: prefix caching and preemption under memory
pressure, on the real model."""

import concurrent.futures
import time

import httpx
import pytest

from tests.servers import Stack, metrics

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
def starved(tmp_path_factory):
    # 16 pages of 16 tokens: any one request fits, six at once do not.
    stack = Stack(str(tmp_path_factory.mktemp("starved")), "--num-kv-pages", "16",
                  "--max-model-len", "256", "--dtype", "float32")
    yield stack.base_url
    stack.stop()


@pytest.mark.slow
def test_memory_starved_engine_preempts_and_completes_everything(starved):
    prompts = [f"Write a short poem about the number {i}." for i in range(6)]

    def ask(prompt: str) -> str:
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True}
        r = httpx.post(f"{starved}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    deadline = time.monotonic() + 10  # stats arrive with the next heartbeat
    while time.monotonic() < deadline:
        stats = metrics(starved)
        if stats["sluice:kv_cache_free_pages"] == stats["sluice:kv_cache_total_pages"]:
            break
        time.sleep(0.5)
    assert stats["sluice:num_preemptions_total"] > 0
    assert stats["sluice:kv_cache_free_pages"] == stats["sluice:kv_cache_total_pages"]
