"""A gpt-oss model gets the Harmony parsers without flags; named flags win; other models and
folders without a readable config get none."""

from __future__ import annotations

import json

import pytest

from frontend.input.model_parsers import model_type, with_model_parsers
from shared.config import FrontendConfig


def config_for(folder, **flags) -> FrontendConfig:
    return FrontendConfig(model=str(folder), served_model_name="m",
                          engine_address="tcp://x:1", **flags)


@pytest.mark.parametrize("kind, flags, want", [
    ("gpt_oss", {}, ("openai_gptoss", "openai")),
    ("gpt_oss", {"reasoning_parser": "qwen3"}, ("qwen3", "openai")),
    ("gpt_oss", {"tool_call_parser": "hermes"}, ("openai_gptoss", "hermes")),
    ("llama", {}, (None, None)),
])
def test_parsers_by_model_type(tmp_path, kind, flags, want):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind}))
    config = with_model_parsers(config_for(tmp_path, **flags))
    assert (config.reasoning_parser, config.tool_call_parser) == want


@pytest.mark.parametrize("text", [None, "{not json", "[1]", '{"model_type": 3}'])
def test_no_readable_model_type_changes_nothing(tmp_path, text):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    assert model_type(str(tmp_path)) is None
    config = with_model_parsers(config_for(tmp_path))
    assert (config.reasoning_parser, config.tool_call_parser) == (None, None)
