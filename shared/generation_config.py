"""Sampling defaults from a model's generation_config.json, as vLLM's --generation-config.

`auto`: the model folder's generation_config.json supplies defaults for the fields a request
leaves out; `vllm`: none (the OpenAI defaults); a FOLDER: that folder's file. A GGUF model
has no generation_config.json, so under `auto` it gets none, unless a generation_config.json
sits beside the .gguf file. `--override-generation-config` JSON is laid over the result.
"""

from __future__ import annotations

import json
import os

import msgspec

from shared.json_flags import json_object

# generation_config.json field -> the request field it is the default for.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationDefaults(msgspec.Struct, kw_only=True, frozen=True):
    """Defaults for request fields left out; None: the OpenAI default."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def in_force(self) -> dict:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


def _check(values: dict, where: str) -> dict:
    out = {}
    for key, value in values.items():
        if key not in FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, not {value!r}")
        if key in ("top_k", "max_new_tokens"):
            if value != int(value):
                raise ValueError(f"{where}: {key} must be an integer, not {value!r}")
            value = int(value)
        ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
              "top_k": value == -1 or value >= 0, "repetition_penalty": value > 0,
              "max_new_tokens": value >= 1}[key]
        if not ok:
            raise ValueError(f"{where}: {key}={value!r} is out of range")
        out[FIELDS[key]] = value
    if out.get("top_k") in (0, -1):
        out.pop("top_k")  # HF's and vLLM's "no top-k"
    return out


def load_generation_defaults(model_path: str, source: str = "auto",
                             override: str | None = None) -> GenerationDefaults:
    """The defaults in force for `--generation-config source --override-generation-config
    override`; a bad source or value raises ValueError naming it."""
    values: dict = {}
    if source != "vllm":
        if source == "auto":
            folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
            where = "the model's generation_config.json"
        else:
            folder = os.path.abspath(os.path.expanduser(source))
            where = f"--generation-config {source}"
            if not os.path.isdir(folder):
                raise ValueError(f"{where}: not a folder (auto, vllm, or a folder holding "
                                 "generation_config.json)")
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: cannot be read as JSON: {e}") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}: must be a JSON object")
            values = _check(data, path)
        elif source != "auto":
            raise ValueError(f"{where}: {path} does not exist")
    if override:
        data = json_object(override, "--override-generation-config")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown fields {unknown}; "
                             f"known: {sorted(FIELDS)}")
        values.update(_check(data, "--override-generation-config"))
        if data.get("top_k") in (0, -1):
            values.pop("top_k", None)
    return GenerationDefaults(**values)
