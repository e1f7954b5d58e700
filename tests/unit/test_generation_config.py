"""--generation-config and --override-generation-config (issue 19 item 3): the model's
generation_config.json supplies defaults for fields a request leaves out; request values win."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.pipeline.sampling import plan_request
from shared.generation_config import GenerationDefaults, load_generation_defaults


def _folder(tmp_path, **values):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_auto_reads_the_models_file_and_vllm_ignores_it(tmp_path):
    folder = _folder(tmp_path, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                     repetition_penalty=1.1, max_new_tokens=64, do_sample=True,
                     bos_token_id=1)
    d = load_generation_defaults(folder, "auto")
    assert d.in_force() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1, "max_tokens": 64}
    assert load_generation_defaults(folder, "vllm").in_force() == {}


def test_gguf_without_a_file_beside_it_has_no_defaults(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert load_generation_defaults(str(tmp_path / "m.gguf"), "auto").in_force() == {}
    _folder(tmp_path, top_k=5)  # a generation_config.json beside the .gguf counts
    assert load_generation_defaults(str(tmp_path / "m.gguf"), "auto").top_k == 5


def test_a_folder_and_an_override(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.2}')
    d = load_generation_defaults(str(tmp_path), str(other), '{"top_k": 3, "temperature": 0.5}')
    assert d.in_force() == {"temperature": 0.5, "top_k": 3}
    assert load_generation_defaults(str(tmp_path), "vllm", '{"top_k": 0}').in_force() == {}


@pytest.mark.parametrize("source, override, message", [
    ("/no/such/folder", None, "not a folder"),
    ("vllm", "{", "not JSON"),
    ("vllm", "[1]", "must be a JSON object"),
    ("vllm", '{"tempreature": 1}', "unknown fields"),
    ("vllm", '{"temperature": -1}', "out of range"),
    ("vllm", '{"top_p": 0}', "out of range"),
    ("vllm", '{"top_k": 1.5}', "must be an integer"),
    ("vllm", '{"max_new_tokens": 0}', "out of range"),
    ("vllm", '{"temperature": "hot"}', "must be a number"),
])
def test_bad_values_fail_naming_the_source(tmp_path, source, override, message):
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(str(tmp_path), source, override)


def test_a_folder_without_the_file_fails(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_generation_defaults(str(tmp_path), str(tmp_path))


def _plan(body: dict, defaults, endpoint="chat"):
    kind = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    base = ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            if endpoint == "chat" else {"model": "m", "prompt": "hi"})
    request = msgspec.convert({**base, **body}, kind)
    return plan_request(request, endpoint=endpoint, prompt_len=4, max_model_len=100,
                        vocab_size=1000, defaults=defaults).params


def test_defaults_fill_what_the_request_leaves_out_and_request_values_win():
    d = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=1, min_p=0.05,
                           repetition_penalty=1.1, max_tokens=20)
    p = _plan({}, d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.9, 1, 0.05, 1.1, 20)
    p = _plan({"temperature": 1.0, "top_p": 0.5, "top_k": 7, "min_p": 0.2,
               "repetition_penalty": 1.3, "max_tokens": 5}, d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        1.0, 0.5, 7, 0.2, 1.3, 5)
    assert _plan({"top_k": -1}, d).top_k == 0  # -1 asks for no top-k, over the default
    # Explicit neutral values are values too: they win over the model's defaults.
    neutral = _plan({"min_p": 0.0, "repetition_penalty": 1.0, "top_k": 0}, d)
    assert (neutral.min_p, neutral.repetition_penalty, neutral.top_k) == (0.0, 1.0, 0)
    assert _plan({}, GenerationDefaults(max_tokens=500)).max_tokens == 96  # within the room
    assert _plan({}, d, "completions").max_tokens == 20


def test_without_defaults_nothing_changes():
    p = _plan({}, None)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 96)
    assert (p.min_p, p.repetition_penalty) == (0.0, 1.0)
