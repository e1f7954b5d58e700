"""transformers' own float32 load of the default GGUF model, once per test session.

tests/unit/test_weights.py compares our weights with it and tests/integration/test_reference.py
compares our greedy tokens with its generate: transformers' GGUF dequantize and build took
~18 s on an AVX2-only machine (issue 29), so the session pays it once. Nothing writes to the
model (generate runs under inference_mode), so the second user sees what the first loaded.
"""

from __future__ import annotations

import threading

import torch

from shared.model_source import DEFAULT_MODEL_FILE, default_model_path

_lock = threading.Lock()  # test_reference loads it on a thread, beside an engine's start
_model = None


def hf_default_model():
    """The cached `AutoModelForCausalLM` of the default GGUF file, in float32."""
    global _model
    with _lock:
        if _model is None:
            from transformers import AutoModelForCausalLM

            _model = AutoModelForCausalLM.from_pretrained(
                default_model_path().rsplit("/", 1)[0], gguf_file=DEFAULT_MODEL_FILE,
                dtype=torch.float32)
        return _model
