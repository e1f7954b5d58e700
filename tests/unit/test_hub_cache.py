"""Hub ids resolve from the local Hugging Face cache only (issue 19 item 2). The cache is
built here in the hub's layout: models--org--name/{refs/main, snapshots/<rev>/...}."""

from __future__ import annotations

import json
import os

import pytest

from shared.model_source import hub_cache_dir, is_hub_id, resolve_model_path
from sluice import cli


def make_cached_model(cache, repo_id="tiny-org/tiny-llama", revision="a" * 40,
                      branch="main", files=None):
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name, text in (files or {"config.json": json.dumps({"model_type": "llama"})}).items():
        (snapshot / name).write_text(text)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / branch).write_text(revision)
    return snapshot


@pytest.fixture
def no_hf_env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_hub_ids_and_paths():
    assert is_hub_id("org/name") and is_hub_id("Qwen/Qwen3-0.6B")
    for not_an_id in ("name", "/abs/path", "./a/b", "~/a", "a/b/c", "a/", "a b/c"):
        assert not is_hub_id(not_an_id), not_an_id


def test_cache_dir_precedence(no_hf_env, monkeypatch, tmp_path):
    assert hub_cache_dir() == str(tmp_path / "home" / ".cache" / "huggingface" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == str(tmp_path / "c")
    assert hub_cache_dir(str(tmp_path / "d")) == str(tmp_path / "d")


def test_resolves_through_hf_hub_cache_and_hf_home(no_hf_env, monkeypatch, tmp_path):
    snapshot = make_cached_model(tmp_path / "c")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)
    monkeypatch.delenv("HF_HUB_CACHE")
    snapshot = make_cached_model(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)


def test_revision_and_download_dir(no_hf_env, tmp_path):
    cache = tmp_path / "dl"
    main = make_cached_model(cache)
    other = make_cached_model(cache, revision="b" * 40, branch="v2")
    assert resolve_model_path("tiny-org/tiny-llama", None, str(cache)) == str(main)
    assert resolve_model_path("tiny-org/tiny-llama", "v2", str(cache)) == str(other)
    assert resolve_model_path("tiny-org/tiny-llama", "b" * 40, str(cache)) == str(other)


def test_a_gguf_snapshot_resolves_to_its_file(no_hf_env, tmp_path):
    snapshot = make_cached_model(tmp_path, files={"m.Q4.gguf": ""})
    assert resolve_model_path("tiny-org/tiny-llama", None, str(tmp_path)) == str(
        snapshot / "m.Q4.gguf")


def test_not_cached_says_where_it_looked(no_hf_env, tmp_path):
    with pytest.raises(ValueError) as e:
        resolve_model_path("tiny-org/absent", None, str(tmp_path))
    assert str(tmp_path / "models--tiny-org--absent") in str(e.value)
    assert "nothing is downloaded" in str(e.value)
    make_cached_model(tmp_path)
    with pytest.raises(ValueError, match="revision nope"):
        resolve_model_path("tiny-org/tiny-llama", "nope", str(tmp_path))


def test_a_local_folder_wins_over_the_hub(no_hf_env, monkeypatch, tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "org" / "name" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == str(tmp_path / "org" / "name")


def test_cli_served_name_is_the_hub_id_and_serve_forwards_the_flags(no_hf_env, tmp_path,
                                                                    monkeypatch):
    snapshot = make_cached_model(tmp_path)
    args = cli.parse_args(["engine", "tiny-org/tiny-llama", "--download-dir", str(tmp_path)])
    assert cli.model_names(args) == (str(snapshot), ["tiny-org/tiny-llama"])
    args = cli.parse_args(["serve", "tiny-org/tiny-llama", "--download_dir", str(tmp_path),
                           "--revision", "main"])
    assert os.fspath(tmp_path) == args.download_dir and args.revision == "main"
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(cli, "_supervise", lambda *a, **k: 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(args)
    for argv in started:  # engine and frontend both resolve the model
        assert argv[argv.index("--download-dir") + 1] == str(tmp_path)
        assert argv[argv.index("--revision") + 1] == "main"
        assert argv[argv.index("--model") + 1] == "tiny-org/tiny-llama"
