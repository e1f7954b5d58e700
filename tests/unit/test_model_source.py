"""Model path resolution, served names, and the GGUF header scanner."""

import os

import pytest

from shared.model_source import (
    DEFAULT_MODEL_FILE,
    default_model_path,
    read_gguf_scalars,
    resolve_model_path,
    served_model_name,
)


def test_default_model_path():
    path = default_model_path()
    assert os.path.isabs(path)
    assert os.path.basename(path) == DEFAULT_MODEL_FILE
    assert os.path.isfile(path)


@pytest.mark.parametrize("model", [None, "default"])
def test_resolve_default(model):
    assert resolve_model_path(model) == default_model_path()


def test_resolve_gguf_file_is_absolute(monkeypatch):
    path = default_model_path()
    monkeypatch.chdir(os.path.dirname(path))
    assert resolve_model_path(DEFAULT_MODEL_FILE) == path


def test_resolve_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "stray.gguf").write_bytes(b"")  # config.json wins: it is an HF folder
    assert resolve_model_path(str(tmp_path) + "/") == str(tmp_path)


def test_resolve_folder_with_one_gguf(tmp_path):
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"")
    (tmp_path / "README.md").write_text("hi")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "model.Q8_0.gguf")


def test_resolve_folder_with_several_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several"):
        resolve_model_path(str(tmp_path))


def test_resolve_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="neither config.json nor a .gguf"):
        resolve_model_path(str(tmp_path))


def test_resolve_missing_path(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_resolve_other_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "model.bin"))


def test_served_model_name(tmp_path):
    assert served_model_name(default_model_path()) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == (
        "Qwen2.5-0.5B-Instruct-Q4_K_M"
    )
    assert served_model_name("/models/Llama-3.2-1B-Instruct/") == "Llama-3.2-1B-Instruct"
    assert served_model_name(str(tmp_path)) == tmp_path.name


def test_read_gguf_scalars_default_model():
    scalars, arrays = read_gguf_scalars(default_model_path())
    assert scalars["general.architecture"] == "llama"
    assert scalars["llama.vocab_size"] == 49152
    assert scalars["llama.context_length"] == 8192
    assert scalars["tokenizer.ggml.eos_token_id"] == 2
    assert scalars["tokenizer.ggml.bos_token_id"] == 1
    assert scalars["tokenizer.chat_template"].startswith("{% for message in messages %}")
    assert arrays["tokenizer.ggml.tokens"] == 49152


def test_read_gguf_scalars_rejects_other_files(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_scalars(str(path))
