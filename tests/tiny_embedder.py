"""A tiny random-weight Qwen3-shaped embedding checkpoint, built offline, and its reference.

Saved as Qwen3-Embedding is: the bare `Qwen3Model` (no LM head, tensor names without the
`model.` prefix), sentence-transformers files asking for last-token pooling and
normalization, and Matryoshka sizes in config.json. The reference is transformers' own
forward in float32 (`last_hidden_state`), pooled the way sentence-transformers does.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

from tests.tiny_tokenizer import tiny_tokenizer

HIDDEN = 64
MATRYOSHKA = [16, 32, 64]
MAX_POSITIONS = 128


def build_embedder(path: str, seed: int = 3) -> transformers.Qwen3Model:
    """Writes the checkpoint folder at `path`; returns the float32 transformers model."""
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, rope_theta=1000.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = transformers.Qwen3Model._from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    randomize_decoder(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["matryoshka_dimensions"] = MATRYOSHKA
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    tiny_tokenizer().save_pretrained(path)
    write_sentence_transformers_files(path, HIDDEN, "pooling_mode_lasttoken")
    return model


def randomize_decoder(model, seed: int) -> None:
    """Random weights a decoder's float32 outputs stay well-scaled with: norms near 1,
    matrices scaled by their fan-in."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif param.dim() == 2 and "embed" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen))


def write_sentence_transformers_files(path: str, hidden: int, mode: str) -> None:
    """modules.json (Transformer, Pooling, Normalize) and the Pooling folder's config, with
    `mode` (e.g. pooling_mode_mean_tokens) the one pooling on."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False}
    pooling[mode] = True
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)


def reference_vector(model, ids: list[int], dimensions: int | None = None,
                     pooling: str = "LAST", normalize: bool = True) -> torch.Tensor:
    """transformers' float32 hidden states of one prompt, pooled, cut, normalized."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def cosine(a, b) -> float:
    a, b = (torch.tensor(np.asarray(x, dtype=np.float64)) for x in (a, b))
    return float(torch.dot(a, b) / (a.norm() * b.norm()))
