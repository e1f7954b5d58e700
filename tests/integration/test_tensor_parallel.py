"""Tensor parallelism through the HTTP API (engine.parallel): `sluice engine -tp N` and a
`sluice frontend`, separate processes, as `serve` or an orchestrator runs them.

- a tiny Llama at -tp 2 serves completions and streams; a rank killed mid-stream takes its
  engine down at once (the engine exits non-zero), the frontend ends the stream with its
  503 error and answers 503 after, nothing hangs;
- a rank stopped while the engine is idle (SIGSTOP: alive, never answering) takes its
  engine down once rank 0's next command gives up on it (SLUICE_TP_TIMEOUT_S, 5 s here),
  the engine naming the rank and killing it, the request in flight answered 503;
- the default model (SmolLM2-135M, 9 heads over 3 KV heads) at -tp 3 gives the greedy text
  the session's one-rank engine gives (slow: three ranks load it on a 2-core machine).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch
import transformers

from tests.conftest import SHARED_ENGINE_ARGS
from tests.servers import engine_and_frontend, wait_until
from tests.tiny_vlm import tiny_vlm_tokenizer

STREAM = {"prompt": "hello world", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def _tiny_llama(path) -> str:
    tok = tiny_vlm_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the ranks an engine started)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return _tiny_llama(tmp_path_factory.mktemp("tp-model"))


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("tp")
    model = tiny_llama
    engine, frontend = engine_and_frontend(
        str(tmp), ("--model", model, "-tp", "2", "--dtype", "float32", "--threads", "2"),
        "frontend", "--model", model, "--engine-timeout", "2")
    yield engine, frontend
    frontend.stop()
    engine.stop()


def _stream(frontend) -> tuple[threading.Thread, list[str]]:
    """A long greedy stream, read on a thread, once its first tokens have come."""
    events: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{frontend.base_url}/v1/completions",
                          json={**STREAM, "stream": True}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(events) >= 3, 60, "the stream's first tokens")
    return reader, events


@pytest.mark.slow  # a 2-rank engine and a frontend of its own: ~15 s
def test_a_killed_rank_ends_its_engine_and_the_stream(tp_engine):
    engine, frontend = tp_engine
    r = httpx.post(f"{frontend.base_url}/v1/completions",
                   json={**STREAM, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    [rank] = _children(engine.proc.popen.pid)  # -tp 2: one rank beside the engine

    reader, events = _stream(frontend)
    os.kill(rank, 9)
    killed = time.monotonic()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream hangs after its engine's rank died"
    assert time.monotonic() - killed < 20
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503, error
    assert engine.proc.popen.wait(timeout=10) != 0
    assert "tensor-parallel rank 1 exited" in engine.proc.log()
    r = httpx.post(f"{frontend.base_url}/v1/completions", json={**STREAM, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503


@pytest.mark.slow
def test_default_model_at_three_ranks_matches_one(base_url, tmp_path):
    engine, frontend = engine_and_frontend(str(tmp_path), (*SHARED_ENGINE_ARGS, "-tp", "3"),
                                           "frontend")
    prompts = ("The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a land far away, there lived")

    def text(url: str, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        # All at once, to both engines: each decodes the three in one batch (float32 greedy
        # does not change with the batch: test_reference), a third of the steps of one at a
        # time, and the ranks' all-reduces carry several rows.
        with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
            want = [pool.submit(text, base_url, p) for p in prompts]
            got = [pool.submit(text, frontend.base_url, p) for p in prompts]
            for prompt, w, g in zip(prompts, want, got, strict=True):
                assert g.result() == w.result(), prompt
    finally:
        frontend.stop()
        engine.stop()


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T: stopped, Z: exited), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie)."""
    return _state(pid) in (None, "Z")


@pytest.mark.slow  # its own engine and frontend, and the 5 s wait: ~40 s
def test_a_hung_rank_ends_its_engine_naming_it(tiny_llama, tmp_path, monkeypatch):
    """The rank is stopped while the engine is idle: rank 0's next command to it (the
    step's plan) waits at most SLUICE_TP_TIMEOUT_S, then the engine stops naming the rank,
    and the request in flight gets its 503."""
    monkeypatch.setenv("SLUICE_TP_TIMEOUT_S", "5")
    engine, frontend = engine_and_frontend(
        str(tmp_path), ("--model", tiny_llama, "-tp", "2", "--dtype", "float32", "--threads",
                        "2"), "frontend", "--model", tiny_llama, "--engine-timeout", "2")
    [rank] = _children(engine.proc.popen.pid)
    try:
        url = f"{frontend.base_url}/v1/completions"
        r = httpx.post(url, json={**STREAM, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        os.kill(rank, signal.SIGSTOP)
        wait_until(lambda: _state(rank) == "T", 10, "the rank's stop")
        stopped = time.monotonic()
        r = httpx.post(url, json={**STREAM, "max_tokens": 4}, timeout=90)
        assert r.status_code == 503, r.text
        assert time.monotonic() - stopped < 60  # the 5 s timeout, then the 503
        assert engine.proc.popen.wait(timeout=10) != 0
        assert "tensor-parallel rank 1 is stopped" in engine.proc.log()
        wait_until(lambda: _gone(rank), 10, "the stopped rank's end")
    finally:
        frontend.stop()
        if not _gone(rank):
            os.kill(rank, signal.SIGKILL)
        engine.stop()
