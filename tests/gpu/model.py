"""The model the GPU tests run: $SLUICE_GPU_MODEL (a .gguf file or an HF folder) where set,
as the GPU check sets it to its random-weight model of the default shape
(benchmarks/gpukit/model.py); else the bundled default model."""

from __future__ import annotations

import os

from shared.model_source import default_model_path


def gpu_model_path() -> str:
    return os.environ.get("SLUICE_GPU_MODEL") or default_model_path()


def load_hf_model(path: str, dtype):
    """transformers' model of the same weights, from either kind of path."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
