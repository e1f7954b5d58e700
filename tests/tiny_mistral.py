"""A tiny Mistral-format checkpoint built offline: a `tekken.json` vocabulary (all 256 bytes
plus a few merges, mistral-common's default special tokens) and a random-weight
MistralForCausalLM beside it, with no HF tokenizer files, as Mistral's own repositories ship."""

from __future__ import annotations

import base64
import json
import os

import torch
import transformers

# Pieces merged on top of the 256 bytes; each is two earlier tokens joined (BPE needs a path).
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"in",
          b"ing", b" h", b" hi", b"hi", b"th", b"the", b" the", b"er", b"re"]
NUM_SPECIAL = 32  # mistral-common's 20 named ones, then <SPECIAL_20>... fillers
PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
           r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def write_tekken(folder: str, version: str = "v7") -> str:
    """tekken.json at `folder`; returns its path."""
    pieces = [bytes([b]) for b in range(256)] + MERGES
    vocab = [{"rank": i, "token_bytes": base64.b64encode(p).decode(),
              "token_str": p.decode("utf-8", "replace")} for i, p in enumerate(pieces)]
    data = {"config": {"pattern": PATTERN, "num_vocab_tokens": len(pieces),
                       "default_vocab_size": len(pieces) + NUM_SPECIAL,
                       "default_num_special_tokens": NUM_SPECIAL, "version": version},
            "vocab": vocab}
    path = os.path.join(folder, "tekken.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def vocab_size() -> int:
    return 256 + len(MERGES) + NUM_SPECIAL


def build_tiny_mistral(folder: str, seed: int = 0) -> str:
    """tekken.json and a random MistralForCausalLM (float32) in `folder`; returns it."""
    config = transformers.MistralConfig(
        vocab_size=vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        sliding_window=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    write_tekken(folder)
    return folder
