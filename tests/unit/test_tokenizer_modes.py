"""--tokenizer-mode (vLLM's): auto's probe, each mode's loader and refusals, the wrong-Hub-
class bypass, and the config read once and handed to the tokenizer. The Mistral side end to
end (against mistral-common itself) is tests/integration/test_mistral_tokenizer.py."""

import json
import os

import pytest

from shared import tokenizer_modes
from shared.tokenizer import load_tokenizer
from shared.tokenizer_modes import (
    TokenizerModeError,
    register_tokenizer,
    resolve_tokenizer_mode,
)
from tests.tiny_mistral import write_tekken
from tests.tiny_tokenizer import tiny_tokenizer


def _hf_folder(path, model_type="llama", tokenizer_class=None) -> str:
    tiny_tokenizer().save_pretrained(str(path))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": model_type, "vocab_size": 13}, f)
    if tokenizer_class is not None:
        file = os.path.join(path, "tokenizer_config.json")
        with open(file) as f:
            config = json.load(f)
        config["tokenizer_class"] = tokenizer_class
        with open(file, "w") as f:
            json.dump(config, f)
    return str(path)


def test_auto_probes_mistral_files_and_falls_back_to_hf(tmp_path, monkeypatch):
    hf = _hf_folder(tmp_path / "hf")
    assert resolve_tokenizer_mode(hf, "auto") == "hf"
    both = _hf_folder(tmp_path / "both")
    write_tekken(both)
    assert resolve_tokenizer_mode(both, "auto") == "mistral"
    assert resolve_tokenizer_mode(both, "hf") == "hf"  # asked for: the HF files
    sentencepiece = _hf_folder(tmp_path / "sp")
    open(os.path.join(sentencepiece, "tokenizer.model.v3"), "w").close()
    assert resolve_tokenizer_mode(sentencepiece, "auto") == "mistral"
    monkeypatch.setattr(tokenizer_modes, "mistral_common_available", lambda: False)
    assert resolve_tokenizer_mode(both, "auto") == "hf"  # without the package: hf
    with pytest.raises(TokenizerModeError, match="needs the mistral-common package"):
        resolve_tokenizer_mode(both, "mistral")


def test_mode_refusals_are_one_line(tmp_path):
    hf = _hf_folder(tmp_path)
    for mode, words in [("mistral", "no tekken.json"), ("fast", "must be one of")]:
        with pytest.raises(TokenizerModeError, match=words) as err:
            resolve_tokenizer_mode(hf, mode)
        assert "\n" not in str(err.value)
    with pytest.raises(TokenizerModeError, match="no tokenizer is registered as 'nope'"):
        load_tokenizer("nope", "custom", model=hf)
    with pytest.raises(TokenizerModeError, match="needs --model"):
        load_tokenizer("nope", "custom")
    with pytest.raises(TokenizerModeError, match="a .gguf file"):
        load_tokenizer("default", "mistral")


def test_hf_mode_keeps_the_hf_files_beside_tekken(tmp_path):
    folder = _hf_folder(tmp_path)
    write_tekken(folder)
    hf = load_tokenizer(folder, "hf")
    assert hf.is_fast and not hasattr(hf, "mistral") and len(hf) == 13
    assert hasattr(load_tokenizer(folder, "auto"), "mistral")
    assert len(load_tokenizer(folder, "slow")) == 13  # transformers 5: the fast one


def test_custom_mode_loads_a_registered_class(tmp_path):
    folder = _hf_folder(tmp_path)
    register_tokenizer("tiny-words", "transformers", "PreTrainedTokenizerFast")
    tok = load_tokenizer("tiny-words", "custom", model=folder)
    assert tok.is_fast and tok("hello")["input_ids"] == [0, 9]
    register_tokenizer("broken", "transformers", "NoSuchTokenizer")
    with pytest.raises(TokenizerModeError, match="cannot be loaded"):
        load_tokenizer("broken", "custom", model=folder)


def test_wrong_hub_tokenizer_class_is_bypassed(tmp_path, monkeypatch):
    """The model types whose Hub tokenizer_class is wrong (vLLM's list: internlm2, step3_vl,
    unlimited_ocr) never reach AutoTokenizer: the generic fast tokenizer loads
    tokenizer.json as it is."""
    import transformers

    bypassed = _hf_folder(tmp_path / "internlm2", model_type="internlm2",
                          tokenizer_class="InternLM2Tokenizer")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: pytest.fail("AutoTokenizer picked the Hub's class"))
    assert load_tokenizer(bypassed, "hf")("hello world")["input_ids"] == [0, 9, 10]
    with pytest.raises(pytest.fail.Exception):  # any other type goes through AutoTokenizer
        load_tokenizer(_hf_folder(tmp_path / "llama"), "hf")


def test_config_is_read_once_and_handed_over(tmp_path, monkeypatch):
    """The config read (or passed in) is the one AutoTokenizer gets: it never reads
    config.json itself."""
    import transformers

    folder = _hf_folder(tmp_path)
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        seen.append(kwargs.get("config"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail("config.json read a second time"))
    load_tokenizer(folder, "hf")
    assert seen[-1] is not None and seen[-1].model_type == "llama"
    given = transformers.LlamaConfig(vocab_size=13)
    load_tokenizer(folder, "hf", config=given)
    assert seen[-1] is given


def test_start_up_refuses_in_one_line(tmp_path):
    import argparse

    from shared.startup_checks import StartupError, check_model

    hf = _hf_folder(tmp_path)
    base = dict(model=hf, tokenizer=None, revision=None, download_dir=None)
    for extra, words in [({"tokenizer_mode": "mistral"}, "no tekken.json"),
                         ({"tokenizer_mode": "custom"}, "needs --tokenizer NAME"),
                         ({"tokenizer_mode": "custom", "tokenizer": "nope"}, "'nope'")]:
        with pytest.raises(StartupError, match=words) as err:
            check_model(argparse.Namespace(**{**base, **extra}))
        assert str(err.value).startswith("sluice: --tokenizer-mode") and "\n" not in str(err.value)
    register_tokenizer("tiny-ok", "transformers", "PreTrainedTokenizerFast")
    check_model(argparse.Namespace(**{**base, "tokenizer_mode": "custom", "tokenizer": "tiny-ok"}))


def test_fingerprint_tracks_what_decides_ids(tmp_path):
    import copy

    from frontend.engine_client.consistency import ServedIdentity, mismatch
    from shared.protocol import EngineStats
    from shared.tokenizer import tokenizer_fingerprint

    tok = tiny_tokenizer()
    same = tokenizer_fingerprint(tok)
    copied = copy.deepcopy(tok)
    copied("hello", "world", truncation=True, max_length=3)  # sets the copy's truncation
    assert tokenizer_fingerprint(copied) == same and len(same) == 16
    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert tokenizer_fingerprint(other) != same
    stats = dict(engine_id="e", max_model_len=8, num_total_pages=1, num_free_pages=1,
                 num_running=0, num_waiting=0, num_steps=0, max_seqs_in_step=0,
                 num_finished=0, num_aborted=0, sent_at=0.0)
    me = ServedIdentity("m", same)
    assert mismatch(me, EngineStats(model_name="m", tokenizer_fingerprint=same, **stats)) is None
    assert mismatch(me, EngineStats(model_name="m", **stats)) is None  # not reported: trusted
    assert "another tokenizer" in mismatch(
        me, EngineStats(model_name="m", tokenizer_fingerprint="x" * 16, **stats))
    assert "serves the model 'n'" in mismatch(
        me, EngineStats(model_name="n", tokenizer_fingerprint=same, **stats))
    assert mismatch(None, EngineStats(model_name="n", **stats)) is None
