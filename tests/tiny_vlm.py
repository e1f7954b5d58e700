"""A tiny random Idefics3 (SmolVLM's architecture) as an HF folder, built offline from a
config: a 2-layer Llama text model, a 2-layer vision encoder on 32x32 patches of 8x8 pixels
(4 image tokens per patch), a word-level tokenizer with the Idefics3 special tokens, a
chat template that loops over content parts, and the image processor's config (images up
to 64 px, split into 32 px tiles plus the global view: 5 patches, 20 image tokens).

Weights are redrawn at unit scale (transformers' 0.02 init makes near-uniform logits, where
float noise could swap greedy picks), with a fixed seed, so every build is the same model.
"""

from __future__ import annotations

import os

SPECIAL = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
WORDS = ["<s>", "</s>", "<pad>", "<unk>", "[", "]", "system", "user", "assistant",
         "describe", "the", "image", "a", "red", "blue", "square", "cat", "dog", "hello",
         "world", "what", "is", "this", "picture", "of", "and", "green", "sky", "tree",
         "one", "two", "three", "big", "small", "yes", "no"]
IMAGE_SIZE, PATCH = 32, 8
CHAT_TEMPLATE = (
    "{% for m in messages %}[ {{ m.role }} ] "
    "{% if m.content is string %}{{ m.content }} {% else %}"
    "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }} "
    "{% elif p.type == 'image' %}<image> {% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[ assistant ] {% endif %}"
)


def tiny_vlm_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level words ("Ġthe" after a space), as GPT-2 style vocabularies: llguidance
    # (structured output, built at start-up) needs a decoder it knows.
    words = WORDS + ["\u0120" + w for w in WORDS if not w.startswith("<")] + ["\u0120"]
    vocab = {w: i for i, w in enumerate(words + SPECIAL)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Added tokens are cut out of the text before the word split, as in SmolVLM's tokenizer.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _redraw(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                scale = 1.0 if "embed_tokens" in name else p[0].numel() ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # norms: around 1, not exactly, so a missed one shows
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def build_tiny_vlm(folder: str, seed: int = 0) -> str:
    """Writes the model folder (config, safetensors, tokenizer, processor) and returns it."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = tiny_vlm_tokenizer()
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config)
    _redraw(model, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    Idefics3ImageProcessorPil(size={"longest_edge": 2 * IMAGE_SIZE},
                              max_image_size={"longest_edge": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def png_bytes(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """A deterministic RGB PNG of 4x4 random color blocks: tiles differ (a wrong crop
    shows), and seeds differ in what the model sees (pixel noise averages out)."""
    import io

    import numpy as np
    from PIL import Image

    blocks = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize((width, height), Image.NEAREST)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()
