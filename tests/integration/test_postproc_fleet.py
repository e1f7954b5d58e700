"""The postproc fleet end to end (req S-1, S-3, S-4, O-5): an engine, two frontends and
postproc workers as separate processes. Workers do the per-token text work and push chunk
bytes to the frontends; a SIGKILLed worker's requests replay on another worker and every
stream still completes with the text an undisturbed run gives."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine_client import engine_stats
from tests.servers import Fleet

pytestmark = pytest.mark.slow

PROMPTS = [
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "What is 17 times 3?",
    "Give me a tip for learning Python.",
    "Describe a sunset in two sentences.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(str(tmp_path_factory.mktemp("fleet")), 3, ("--reasoning-parser", "qwen3"),
              "--dtype", "float32", "--max-num-batched-tokens", "256")
    _wait_for_workers(f, 3)
    yield f
    f.stop()


def _wait_for_workers(fleet: Fleet, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine_stats(fleet.engine_address).num_postproc_workers != count:
        assert time.monotonic() < deadline, "the workers did not register with the engine"
        time.sleep(0.2)


def _body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


class Streamed:
    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.chunks = 0
        self.done = False


def stream_chat(base_url: str, body: dict, seen: Streamed | None = None) -> Streamed:
    seen = seen or Streamed()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                seen.done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            seen.chunks += 1
            for choice in event["choices"]:
                delta = choice["delta"]
                seen.content.append(delta.get("content") or "")
                seen.reasoning.append(delta.get("reasoning_content") or "")
                seen.finish_reason = choice["finish_reason"] or seen.finish_reason
    return seen


def complete_chat(base_url: str, body: dict) -> dict:
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_two_frontends_and_three_workers_serve_concurrent_streams(fleet):
    before = engine_stats(fleet.engine_address).postproc_assigned
    expected = [complete_chat(fleet.base_urls[1], _body(p, 40))["message"]["content"]
                for p in PROMPTS]
    jobs = [(url, _body(p, 40)) for url in fleet.base_urls for p in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: stream_chat(*job), jobs))
    for i, seen in enumerate(results):
        assert seen.done and seen.finish_reason in ("stop", "length")
        assert "".join(seen.content) == expected[i % len(PROMPTS)]
    stats = engine_stats(fleet.engine_address)
    # Every request, plain and streamed, went through a worker, none was replayed.
    assert stats.postproc_assigned - before == len(PROMPTS) + len(jobs)
    assert stats.num_postproc_workers == 3 and stats.postproc_replayed == 0


def test_reasoning_from_a_prefilled_think_block(fleet):
    """The template's text ends inside `<think>` (continue_final_message), so the output is
    thinking: the frontend with --reasoning-parser puts it in reasoning_content, the one
    without leaves it in content (same engine, greedy, same tokens)."""
    body = {
        "messages": [{"role": "user", "content": "Is 91 a prime number?"},
                     {"role": "assistant", "content": "<think>\nLet me check"}],
        "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 30, "temperature": 0,
    }
    parsed = complete_chat(fleet.base_urls[0], body)
    plain = complete_chat(fleet.base_urls[1], body)
    thinking = plain["message"]["content"]
    assert thinking.strip()
    assert parsed["message"]["reasoning_content"] == thinking.strip()
    assert parsed["message"]["content"] == ""
    streamed = stream_chat(fleet.base_urls[0], body)
    assert "".join(streamed.reasoning) == thinking.strip()
    assert "".join(streamed.content) == ""


def test_a_killed_worker_loses_nothing(fleet):
    bodies = [_body(p, 64, ignore_eos=True) for p in PROMPTS]
    with ThreadPoolExecutor(len(bodies)) as pool:
        undisturbed = [("".join(s.content)) for s in
                       pool.map(lambda b: stream_chat(fleet.base_urls[0], b), bodies)]
    replayed_before = engine_stats(fleet.engine_address).postproc_replayed
    seen = [Streamed() for _ in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(stream_chat, fleet.base_urls[i % 2], b, s)
                   for i, (b, s) in enumerate(zip(bodies, seen, strict=True))]
        deadline = time.monotonic() + 120
        while min(s.chunks for s in seen) < 5:  # every stream under way
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.05)
        victim = fleet.workers[0]
        victim.popen.send_signal(signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    for got, want in zip(results, undisturbed, strict=True):
        assert got.done and got.finish_reason == "length"
        assert "".join(got.content) == want  # every byte exactly once
    stats = engine_stats(fleet.engine_address)
    assert stats.postproc_replayed > replayed_before
    assert stats.num_postproc_workers == 2
    # The fleet heals: a new worker registers and takes requests.
    fleet.add_worker("postproc-replacement")
    _wait_for_workers(fleet, 3)
    assert stream_chat(fleet.base_urls[1], bodies[0]).done


def test_streams_without_workers_fall_back_to_the_frontend(fleet):
    """Kill every worker: the engine sends tokens to the frontends, which post-process them."""
    for worker in fleet.workers:
        if worker.popen.poll() is None:
            worker.popen.send_signal(signal.SIGKILL)
    _wait_for_workers(fleet, 0)
    expected = complete_chat(fleet.base_urls[1], _body(PROMPTS[0], 40))["message"]["content"]
    assert "".join(stream_chat(fleet.base_urls[0], _body(PROMPTS[0], 40)).content) == expected


