"""Parsers chosen by the model when the command line names none: a gpt-oss checkpoint
(config.json `model_type` "gpt_oss") writes the Harmony format, so it gets the
`openai_gptoss` reasoning parser and the `openai` tool-call parser, as vLLM picks for it.
An explicit --reasoning-parser / --tool-call-parser always wins."""

from __future__ import annotations

import json
import os

import msgspec

from shared.config import FrontendConfig

# model_type -> (reasoning parser, tool-call parser)
MODEL_PARSERS = {"gpt_oss": ("openai_gptoss", "openai")}


def model_type(model_path: str) -> str | None:
    """config.json's model_type of a model folder; None for a GGUF file or no config."""
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            value = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # the engine reports an unreadable config itself
    return value if isinstance(value, str) else None


def with_model_parsers(config: FrontendConfig) -> FrontendConfig:
    defaults = MODEL_PARSERS.get(model_type(config.model) or "")
    if defaults is None:
        return config
    reasoning, tools = defaults
    return msgspec.structs.replace(
        config,
        reasoning_parser=config.reasoning_parser or reasoning,
        tool_call_parser=config.tool_call_parser or tools,
    )
