"""LoRA adapters over HTTP, on one engine with two frontends (module-scoped): --lora-modules
served by `model` with peft's merged tokens, /v1/models listing adapters with their parent
and root, run-time load / unload / reload with a request in flight, vLLM's error statuses,
auth on the new routes, a load past --max-cpu-loras refused, and a frontend started after
a load seeing the adapter (the engines are the truth)."""

import copy
import json
import threading

import httpx
import pytest
import torch

from tests.servers import engine_and_frontend
from tests.tiny_vlm import tiny_vlm_tokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# An engine and a frontend of its own (~10 s to start); the engine side of LoRA is checked in
# the fast tier by tests/unit/test_lora.py.
pytestmark = pytest.mark.slow

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 9, 17, 33, 2, 21, 8]
STEPS = 6
MAX_CPU_LORAS = 4  # the engine's bound on adapters loaded at once
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _greedy(model, prompt, steps=STEPS):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    tokenizer = tiny_vlm_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # spread-out logits: no near ties between greedy candidates
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / p.shape[1] ** 0.5)
    base.save_pretrained(root / "base", safe_serialization=True)
    tokenizer.save_pretrained(root / "base")
    merged = {"base": base}
    for name, seed, extra in (("a", 1, {}), ("b", 2, {"use_rslora": True})):
        torch.manual_seed(seed)
        lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **extra))
        lora.save_pretrained(root / name)
        merged[name] = lora.merge_and_unload().eval()
    engine, front = engine_and_frontend(
        str(root), ("--model", str(root / "base"), "--served-model-name", "tiny",
                    "--dtype", "float32", "--enable-lora",
                    "--max-loras", "2", "--max-cpu-loras", str(MAX_CPU_LORAS),
                    "--lora-modules", f"a={root / 'a'}",
                    json.dumps({"name": "b", "path": str(root / "b"),
                                "base_model_name": "tinybase"})),
        "front", "--model", str(root / "base"), "--served-model-name", "tiny",
        "--allow-runtime-lora-updating", "--api-key", KEY, "--return-tokens-as-token-ids")
    yield root, merged, engine, front
    front.stop()
    engine.stop()


def _complete(url, model, max_tokens=STEPS, **extra):
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, **extra})
    return r


def _stream(url, model, max_tokens, started: threading.Event, done: dict) -> None:
    """A streamed completion: `started` once its first token is out; `done` gets its
    finish_reason and token count."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                done["tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                done["finish_reason"] = choice.get("finish_reason")
            started.set()


def _tokens(response) -> list[int]:
    assert response.status_code == 200, response.text
    names = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in names]


def _models(url) -> dict:
    r = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200
    return {m["id"]: m for m in r.json()["data"]}


def test_lora_modules_serve_peft_tokens_and_list_as_models(setup):
    root, merged, _, front = setup
    url = front.base_url
    for name in ("tiny", "a", "b"):
        expected = _greedy(merged["base" if name == "tiny" else name], PROMPT)
        assert _tokens(_complete(url, name)) == expected, name
    adapted, base = _complete(url, "a"), _complete(url, "tiny")
    assert _tokens(adapted) != _tokens(base)
    assert (adapted.json()["model"], base.json()["model"]) == ("a", "tiny")  # as vLLM
    models = _models(url)
    assert models["a"]["parent"] == "tiny" and models["a"]["root"] == str(root / "a")
    assert models["b"]["parent"] == "tinybase" and models["b"]["root"] == str(root / "b")
    assert models["tiny"]["parent"] is None
    one = httpx.get(f"{url}/v1/models/a", headers=AUTH, timeout=10).json()
    assert one["root"] == str(root / "a")
    assert _complete(url, "nope").status_code == 404


def test_runtime_load_unload_reload(setup):
    root, merged, _, front = setup
    url = front.base_url
    load = {"lora_name": "c", "lora_path": str(root / "a")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=10).status_code == 401
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=AUTH, timeout=60)
    assert r.status_code == 200 and "added successfully" in r.text
    assert "c" in _models(url)
    assert _tokens(_complete(url, "c")) == _greedy(merged["a"], PROMPT)
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=AUTH, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.text
    # Unloaded while a long request runs on it: that request still finishes.
    started, done = threading.Event(), {}
    runner = threading.Thread(target=_stream, args=(url, "c", 150, started, done))
    runner.start()
    assert started.wait(60), "the streamed request never started"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200 and "removed successfully" in r.text
    runner.join(120)
    assert done["finish_reason"] == "length" and done["tokens"] == 150, done
    assert "c" not in _models(url)
    assert _complete(url, "c").status_code == 404
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"}, headers=AUTH,
                      timeout=10)
    assert gone.status_code == 404 and "cannot be found" in gone.text
    # Reloaded under the same name from the other adapter: its tokens now.
    load_b = {"lora_name": "c", "lora_path": str(root / "b")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load_b, headers=AUTH,
                      timeout=60).status_code == 200
    assert _tokens(_complete(url, "c")) == _greedy(merged["b"], PROMPT)


ONLY_D = "sk-adapter-d-0123456789"  # a keys-file key that may use adapter d alone


@pytest.mark.slow  # a second frontend's start
def test_frontend_started_later_sees_loaded_adapters(setup):
    """The later frontend also takes an --api-keys-file (issue 54) whose key may reach
    adapter d only: never the base model, nor another adapter."""
    root, _, engine, front = setup
    load = {"lora_name": "d", "lora_path": str(root / "b")}
    r = httpx.post(f"{front.base_url}/v1/load_lora_adapter", json=load, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200
    keys = root / "keys.yaml"
    keys.write_text(f"- {{name: only-d, key: {ONLY_D}, models: [d]}}\n")
    later = engine.frontend(str(root), "later", "--model", str(root / "base"),
                            "--served-model-name", "tiny", "--api-key", KEY,
                            "--api-keys-file", str(keys))
    try:
        listed = httpx.get(f"{later.base_url}/v1/models", headers=AUTH,
                           timeout=10).json()["data"]
        assert {"a", "b", "d"} <= {m["id"] for m in listed}
        served = httpx.post(f"{later.base_url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": "d", "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
        assert served.status_code == 200, served.text
        # Without --allow-runtime-lora-updating the routes do not exist, as in vLLM.
        assert httpx.post(f"{later.base_url}/v1/load_lora_adapter", json=load,
                          headers=AUTH).status_code == 404
        _only_d(later.base_url)
    finally:
        later.stop()
    httpx.post(f"{front.base_url}/v1/unload_lora_adapter", json={"lora_name": "d"},
               headers=AUTH, timeout=60)


def _only_d(url: str) -> None:
    only = {"Authorization": f"Bearer {ONLY_D}"}
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    allowed = httpx.post(f"{url}/v1/completions", headers=only, timeout=60,
                         json={**body, "model": "d"})
    assert allowed.status_code == 200, allowed.text
    for model in ("tiny", "a", None):  # None: the served model, by default
        refused = httpx.post(f"{url}/v1/completions", headers=only, timeout=60,
                             json={**body, **({"model": model} if model else {})})
        assert refused.status_code == 404, (model, refused.text)
        assert refused.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/v1/models/tiny", headers=only, timeout=10).status_code == 404
    assert httpx.get(f"{url}/v1/models/d", headers=only, timeout=10).status_code == 200
    listed = httpx.get(f"{url}/v1/models", headers=only, timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["d"]  # the key lists what it may use


def test_a_load_past_max_cpu_loras_is_refused_until_one_is_unloaded(setup):
    """--max-cpu-loras: loads fill the engine to its bound, the next is a 400 naming the
    flag (the adapter not listed, the engine serving on), and an unload makes room."""
    root, merged, _, front = setup
    url = front.base_url

    def load(name):
        return httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                          json={"lora_name": name, "lora_path": str(root / "a")})

    fillers = [f"fill{i}" for i in range(MAX_CPU_LORAS - (len(_models(url)) - 1))]
    assert fillers, "the module loaded the bound already"
    try:
        for name in fillers:  # up to the bound: each taken
            assert load(name).status_code == 200, name
        over = load("over")
        assert over.status_code == 400 and "--max-cpu-loras" in over.text, over.text
        assert "over" not in _models(url)
        assert _tokens(_complete(url, fillers[-1])) == _greedy(merged["a"], PROMPT)
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": fillers.pop()},
                          headers=AUTH, timeout=60).status_code == 200
        assert load("over").status_code == 200
        fillers.append("over")
    finally:
        for name in fillers:
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name},
                       headers=AUTH, timeout=60)


@pytest.mark.parametrize("route,body,status,words", [
    ("load", {"lora_name": "x"}, 400, "must be provided"),
    ("load", {"lora_path": "/tmp"}, 400, "must be provided"),
    ("load", {"lora_name": "x", "lora_path": "/no/such/dir"}, 404, "No adapter found"),
    ("load", {"lora_name": "x", "lora_path": 3}, 400, "Invalid request"),
    ("load", {"lora_name": "tiny", "lora_path": "/tmp"}, 400, "already been loaded"),
    ("load", {"lora_name": "x" * 2000, "lora_path": "/tmp"}, 400, "at most"),
    ("unload", {}, 400, "needs to be provided"),
    ("unload", {"lora_name": "never"}, 404, "cannot be found"),
], ids=["no-path", "no-name", "missing-dir", "path-type", "base-name", "long-name", "unload-empty",
        "unload-unknown"])
def test_update_errors(setup, route, body, status, words):
    _, _, _, front = setup
    r = httpx.post(f"{front.base_url}/v1/{route}_lora_adapter", json=body, headers=AUTH,
                   timeout=60)
    assert r.status_code == status, r.text
    assert words in r.text


def test_bad_adapter_folder_is_a_400_naming_it(setup):
    root, _, _, front = setup
    bad = root / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 8}))
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = httpx.post(f"{front.base_url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "adapter_model.safetensors" in r.text
    assert "bad" not in _models(front.base_url)
    assert _complete(front.base_url, "a").status_code == 200  # the engine lives on
