"""int8 KV scales computed at start where the checkpoint has none: one prefill of a fixed
text (prose, code and a chat turn) through the loaded model, each layer's largest |K| and
|V| as stored (after RoPE and any k-norm) times MARGIN, over 127.

int8's step is one fixed size a layer, so a scale fixed for every model either clips one
model's keys or rounds another's small values away (SmolLM2-135M: its first layer's values
are ~0.05, its keys reach ~21). The text is the same at every start, so the scales (and so
the numbers a request gets) do not depend on what was served first; a prompt whose keys or
values pass MARGIN times the text's is clipped there.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.request.batch import ScheduledChunk

MARGIN = 1.25
CALIBRATION_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Summarise the water cycle in two sentences, then write a Python function that "
    "returns the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n"
    "Water evaporates from oceans and lakes, condenses into clouds and falls back as rain "
    "or snow, which rivers carry to the sea again.\n\n```python\ndef fibonacci(n: int) -> "
    "int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "```\nThe year 1969: 3.14159, 42, #include <stdio.h>, {\"key\": [1, 2, 3]}."
)


class _Recorder(TorchAttentionBackend):
    """Attends as the float cache does, noting each layer's largest |K| and |V|."""

    def attend(self, layer, q, k, v, meta, sinks=None):
        self.k_max[layer] = max(self.k_max[layer], float(k.abs().max()))
        self.v_max[layer] = max(self.v_max[layer], float(v.abs().max()))
        return super().attend(layer, q, k, v, meta, sinks)


def int8_scales(model, model_config, token_ids: list[int], dtype: torch.dtype,
                device: torch.device, max_len: int) -> tuple[tuple, tuple]:
    """(k_scales, v_scales), one a layer, from one prefill of token_ids (cut to max_len)."""
    ids = token_ids[:max_len]
    page_size = 16
    pages = -(-len(ids) // page_size)
    recorder = _Recorder(model_config.num_layers, pages, page_size, model_config.num_kv_heads,
                         model_config.head_dim, dtype, device,
                         layers=model_config.layer_attention)
    recorder.k_max = [0.0] * model_config.num_layers
    recorder.v_max = [0.0] * model_config.num_layers
    seq = SimpleNamespace(pages=list(range(pages)))
    meta = recorder.prepare([ScheduledChunk(seq, start=0, num_tokens=len(ids))])
    with torch.inference_mode():
        model.forward(torch.tensor(ids, device=device),
                      torch.arange(len(ids), device=device), recorder, meta)

    def scale(largest: float) -> float:
        return largest * MARGIN / 127 if largest > 0 else 1.0

    return (tuple(scale(m) for m in recorder.k_max), tuple(scale(m) for m in recorder.v_max))
