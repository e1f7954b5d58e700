"""The GPU check's model: a random-weight Llama of the default model's shape, built on the
device in seconds, so no weights travel (the bundled GGUF alone is 94 MiB).

Shape: SmolLM2-135M-Instruct's (30 layers, hidden 576, 9 query / 3 KV heads of 64, tied
embeddings; tests/unit/test_gpu_kit.py checks it against the bundled GGUF), with SmolLM2's
own tokenizer and chat template, extracted here from the GGUF (`extract_tokenizer`, a few
MiB in the carried folder). An HF folder: both the engine and transformers load it, so the
GPU tests compare the two on the same weights.

    python -m benchmarks.gpukit.model DEST --tokenizer DIR [--layers N]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

# transformers' LlamaConfig names, as SmolLM2-135M-Instruct's config.json has them.
SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
SEED = 0


def extract_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer (tokenizer.json, its config with the chat template), from the
    bundled GGUF, as an HF tokenizer folder."""
    from shared.model_source import default_model_path
    from shared.tokenizer import load_tokenizer

    shutil.rmtree(dest, ignore_errors=True)
    load_tokenizer(default_model_path()).save_pretrained(str(dest))


def build(dest: Path, tokenizer: Path, layers: int | None = None) -> Path:
    """Write the model folder: config.json, model.safetensors (bfloat16, transformers'
    initialization from SEED) and the tokenizer's files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPE | ({"num_hidden_layers": layers} if layers else {})
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest))
    for item in tokenizer.iterdir():
        shutil.copy2(item, dest / item.name)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True, help="extract_tokenizer's folder")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"fewer layers than {SHAPE['num_hidden_layers']}, where time demands")
    args = parser.parse_args()
    start = time.monotonic()
    build(args.dest, args.tokenizer, args.layers)
    size = sum(f.stat().st_size for f in args.dest.iterdir()) / 2**20
    print(f"model in {args.dest}: {size:.0f} MiB, {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
