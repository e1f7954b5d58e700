"""A tiny gpt-oss checkpoint for Harmony tests, built offline: SmolLM2's tokenizer with the
Harmony special tokens added (`<|start|>` ... `<|return|>`), random weights in gpt-oss's
shape, `<|return|>` and `<|call|>` as its EOS tokens, and no chat template (so our Harmony
renderer writes the prompts)."""

from __future__ import annotations

import json
import os

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]


def harmony_tokenizer():
    from shared.model_source import default_model_path
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = None
    return tok


def write_gpt_oss_checkpoint(folder: str) -> str:
    import torch
    import transformers

    tok = harmony_tokenizer()
    tok.save_pretrained(folder)
    eos = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
    config = transformers.GptOssConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 512, "truncate": False},
        eos_token_id=eos, pad_token_id=tok.pad_token_id or 0, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return folder
