"""--generation-config auto (issue 19): a generation_config.json beside the GGUF supplies
defaults for the fields a request leaves out; the request's own values win."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from shared.model_source import DEFAULT_MODEL_FILE, default_model_path

PROMPT = "Once upon a time"


def _text(base_url: str, **fields) -> str:
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **fields}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_top_k_1_from_generation_config_makes_sampling_greedy(shared_engine, tmp_path):
    """The defaults are the frontend's (it reads the file and fills the requests in): a
    frontend over the session's engine, on the same GGUF through a folder of its own."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.symlink(default_model_path(), model_dir / DEFAULT_MODEL_FILE)
    (model_dir / "generation_config.json").write_text(json.dumps({"top_k": 1}))
    stack = shared_engine.frontend(str(tmp_path), "frontend", "--model",
                                   str(model_dir / DEFAULT_MODEL_FILE))
    try:
        assert "generation defaults in force" in stack.proc.log()
        assert "'top_k': 1" in stack.proc.log()
        greedy = _text(stack.base_url, temperature=0)
        for seed in range(3):  # top_k=1 from the file: sampling at temperature 1 is greedy
            assert _text(stack.base_url, temperature=1, seed=seed) == greedy
        # The request's own top_k (0: no top-k) wins over the file's.
        own = [_text(stack.base_url, temperature=1, top_k=0, seed=seed) for seed in range(5)]
        assert any(text != greedy for text in own), own
    finally:
        stack.stop()
