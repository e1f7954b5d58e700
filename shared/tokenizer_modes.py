"""--tokenizer-mode (vLLM's): which implementation loads a model's tokenizer.

- `auto`: probe the files; a Mistral-format folder (`tekken.json`, `tokenizer.model.v*`) is
  `mistral` when mistral-common is installed, anything else `hf`.
- `hf`: transformers' AutoTokenizer, told not to switch to Mistral's backend on its own
  (so hf always means the Hugging Face files); model types whose Hub `tokenizer_class` names
  the wrong class load the generic fast tokenizer instead.
- `slow`: transformers 5 only has fast tokenizers (it ignores use_fast=False), so this loads
  what `hf` loads, with a warning.
- `mistral`: mistral-common's tokenizer, whose chat rendering gives the prompt's tokens.
- `custom`: `--tokenizer` names a class registered with `register_tokenizer` or through the
  `sluice.tokenizers` entry-point group (vLLM's TokenizerRegistry).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
from importlib.metadata import entry_points

TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")

# Hub metadata names the wrong tokenizer class for these (vLLM's list): AutoTokenizer would
# pick it, so they load the generic fast tokenizer from tokenizer.json.
MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS = frozenset(
    {"internlm2", "step3_vl", "unlimited_ocr", "unlimited-ocr"})

ENTRY_POINT_GROUP = "sluice.tokenizers"
_REGISTRY: dict[str, tuple[str, str]] = {}


class TokenizerModeError(ValueError):
    """A --tokenizer-mode that cannot load this model; one line for the operator."""


def register_tokenizer(name: str, module: str, class_name: str) -> None:
    """Makes `--tokenizer-mode custom --tokenizer NAME` load module.class_name."""
    _REGISTRY[name] = (module, class_name)


def mistral_vocab_file(folder: str) -> str | None:
    """The Mistral-format vocabulary in `folder` (tekken.json first), or None."""
    if not os.path.isdir(folder):
        return None
    tekken = os.path.join(folder, "tekken.json")
    if os.path.isfile(tekken):
        return tekken
    versioned = sorted(glob.glob(os.path.join(folder, "tokenizer.model.v*")))
    return versioned[-1] if versioned else None


def mistral_common_available() -> bool:
    return importlib.util.find_spec("mistral_common") is not None


def resolve_tokenizer_mode(folder: str, mode: str) -> str:
    """`auto` probed into a concrete mode; the others checked."""
    if mode not in TOKENIZER_MODES:
        raise TokenizerModeError(f"--tokenizer-mode must be one of {list(TOKENIZER_MODES)}, "
                                 f"not {mode!r}")
    if mode == "auto":
        found = mistral_vocab_file(folder)
        return "mistral" if found is not None and mistral_common_available() else "hf"
    if mode == "mistral":
        if mistral_vocab_file(folder) is None:
            raise TokenizerModeError(f"--tokenizer-mode mistral: {folder} has no tekken.json "
                                     "or tokenizer.model.v* (a Mistral-format tokenizer)")
        if not mistral_common_available():
            raise TokenizerModeError("--tokenizer-mode mistral needs the mistral-common "
                                     "package (pip install mistral-common)")
    return mode


def custom_tokenizer_class(name: str):
    """The class registered as `name` (in-process first, then entry points)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name == name:
                module, _, attr = point.value.partition(":")
                spec = (module, attr)
                break
    if spec is None:
        known = sorted(set(_REGISTRY) | {p.name for p in entry_points(group=ENTRY_POINT_GROUP)})
        raise TokenizerModeError(
            f"--tokenizer-mode custom: no tokenizer is registered as {name!r} (registered: "
            f"{known or 'none'}); register one in the {ENTRY_POINT_GROUP!r} entry-point group")
    module, class_name = spec
    try:
        return getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError) as exc:
        raise TokenizerModeError(f"--tokenizer-mode custom: {name!r} is registered as "
                                 f"{module}.{class_name}, which cannot be loaded: {exc}") from exc
