"""`sluice serve DIR` on a tiny random DeepSeek-V3 checkpoint (issue 52: it was refused):
the engine process serves it over the latent KV cache, and the completions API's greedy
token ids, every prompt sent at once, equal transformers' `generate` in float32; the same
prompts again hit the prefix cache and give the same ids."""

from __future__ import annotations

import httpx
import pytest
import transformers

from tests.servers import Stack, metrics
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.test_deepseek_mla import CASES
from tests.unit.test_model_reference import STEPS, make_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    config_cls, model_cls, kwargs = CASES["deepseek_v3"]
    ref = make_reference(tmp / "model", config_cls, model_cls, kwargs, seed=8)
    tiny_vlm_tokenizer().save_pretrained(ref.path)
    stack = Stack(str(tmp), "--model", ref.path, "--dtype", "float32", "--threads", "1",
                  "--max-num-batched-tokens", "8", "--page-size", "4")
    yield stack, ref
    stack.stop()


def _greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompts, "max_tokens": STEPS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def test_serve_matches_transformers(served):
    stack, ref = served
    assert transformers.AutoConfig.from_pretrained(ref.path).architectures == [
        "DeepseekV3ForCausalLM"]
    assert _greedy(stack.base_url, ref.prompts) == ref.tokens
    hits = _prefix_hits(stack.base_url)
    assert _greedy(stack.base_url, ref.prompts) == ref.tokens
    assert _prefix_hits(stack.base_url) > hits  # the latent pages were reused


def _prefix_hits(url: str) -> float:
    values = metrics(url)
    return next(v for k, v in values.items() if k.startswith("sluice:prefix_cache_hits"))
