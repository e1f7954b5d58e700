"""load_tokenizer's on-disk cache for GGUF vocabularies, and TokenizerFacts."""

import json
import os
import time

import pytest

from shared import tokenizer as tokmod
from shared.model_source import default_model_path
from shared.tokenizer import TokenizerFacts, load_tokenizer, tokenizer_facts

SAMPLES = [
    "Hello, world!",
    "  Café naïve 你好 👨‍👩‍👧‍👦\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def same_tokenizer(a, b):
    for text in SAMPLES:
        assert a.encode(text) == b.encode(text)
    assert a.chat_template == b.chat_template
    assert a.apply_chat_template(MESSAGES, add_generation_prompt=True) == b.apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )
    assert (a.bos_token_id, a.eos_token_id, a.all_special_ids) == (
        b.bos_token_id,
        b.eos_token_id,
        b.all_special_ids,
    )
    assert len(a) == len(b)


@pytest.mark.slow
def test_cold_then_warm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    cold = load_tokenizer("default")  # converts the GGUF vocabulary (~10 s) and stores it
    entries = os.listdir(tmp_path / "tokenizers")
    assert len(entries) == 1 and entries[0].startswith("SmolLM2-135M-Instruct.Q4_1-")
    start = time.perf_counter()
    warm = load_tokenizer("default")
    assert time.perf_counter() - start < 3.0  # typically ~0.15 s, against ~10 s cold
    same_tokenizer(cold, warm)


def test_cache_hit_is_fast_and_identical(tokenizer):
    # The fixture filled the cache (or found it filled), so this load is a hit.
    start = time.perf_counter()
    again = load_tokenizer(default_model_path())
    assert time.perf_counter() - start < 3.0
    same_tokenizer(tokenizer, again)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_cache_key_tracks_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    key = tokmod.gguf_cache_key(str(path))
    assert key.startswith("m-")
    assert tokmod.gguf_cache_key(str(path)) == key
    os.utime(path, ns=(0, 1_000_000_000))
    assert tokmod.gguf_cache_key(str(path)) != key


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert tokmod.tokenizer_cache_root() == str(tmp_path / "tokenizers")
    monkeypatch.delenv("SLUICE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tokmod.tokenizer_cache_root() == str(tmp_path / "xdg" / "sluice" / "tokenizers")


def test_store_race_keeps_first_copy(tokenizer, tmp_path):
    # Two processes converting at once: the second rename fails and its copy is dropped.
    target = tmp_path / "tokenizers" / "key"
    tokmod._store_cache(tokenizer, str(target))
    first = sorted(os.listdir(target))
    assert "tokenizer.json" in first
    tokmod._store_cache(tokenizer, str(target))
    assert sorted(os.listdir(target)) == first
    assert os.listdir(target.parent) == ["key"]  # no temp folders left behind


def test_damaged_cache_is_rebuilt(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    cache_dir = tmp_path / "tokenizers" / tokmod.gguf_cache_key(default_model_path())
    cache_dir.mkdir(parents=True)
    (cache_dir / "tokenizer.json").write_text("{not json")
    monkeypatch.setattr(tokmod, "_convert_gguf", lambda path: tokenizer)  # skip the 10 s
    loaded = load_tokenizer("default")
    assert loaded is tokenizer
    same_tokenizer(tokenizer, load_tokenizer("default"))  # the rebuilt cache reads back


def test_unwritable_cache_still_loads(tokenizer, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(blocker))  # a file, so makedirs fails
    monkeypatch.setattr(tokmod, "_convert_gguf", lambda path: tokenizer)
    assert load_tokenizer("default") is tokenizer


def test_facts_default_model(tokenizer):
    facts = tokenizer_facts(tokenizer, default_model_path())
    assert isinstance(facts, TokenizerFacts)
    assert facts.vocab_size == 49152
    assert facts.max_token_id == 49151
    assert 2 in facts.eos_token_ids
    assert facts.bos_token_id == 1
    assert {0, 1, 2} <= set(facts.special_token_ids)
    longest = max(
        len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(facts.vocab_size)
    )
    assert facts.max_chars_per_token == longest


def test_facts_hf_folder(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    # The model's embedding is padded past the vocabulary, and generation stops on two ids.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49280}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    folder_tok = load_tokenizer(str(tmp_path))
    facts = tokenizer_facts(folder_tok, str(tmp_path))
    assert facts.vocab_size == 49152
    assert facts.max_token_id == 49279
    assert facts.eos_token_ids == [0, 2]
    assert facts.bos_token_id == 1


def test_facts_hf_folder_scalar_eos_and_no_config_vocab(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 100}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    facts = tokenizer_facts(load_tokenizer(str(tmp_path)), str(tmp_path))
    assert facts.eos_token_ids == [0, 2]
    assert facts.max_token_id == 49151  # the vocabulary's ids outrun the (odd) config
