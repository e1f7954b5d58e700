"""Idefics3 / SmolVLM's vision side: the SigLIP-style encoder and the pixel-shuffle connector.

The text side is our LlamaModel; this half turns each image patch (a tile or the global
view, as the frontend's processor cut them) into `tokens_per_patch` embeddings in the text
model's space. It reuses transformers' own modules, loaded with the checkpoint's weights:
the encoder runs once per image (not per step, not per token), so a hand-written copy
would buy no speed, and transformers' modules are the numerical reference anyway.
"""

from __future__ import annotations

import msgspec
import torch
from safetensors import safe_open

from engine.layers.config import ModelConfig
from engine.layers.safetensors_weights import safetensors_shards
from engine.models.llama import read_llama_config

_PREFIXES = {"model.vision_model.": "vision", "model.connector.": "connector"}


class _Idefics3Config(msgspec.Struct):
    """A config.json's top: the text model it nests and the image token."""

    model_type: str = ""
    text_config: dict | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool | None = None


def read_idefics3_config(raw: bytes) -> ModelConfig:
    """Idefics3 / SmolVLM: a Llama text model (ours) behind a vision encoder (this module);
    the text side is read from text_config."""
    outer = msgspec.json.decode(raw, type=_Idefics3Config)
    if outer.text_config is None or outer.image_token_id is None:
        raise ValueError(f"{outer.model_type} config.json lacks text_config or image_token_id")
    text = dict(outer.text_config)
    text.setdefault("model_type", "llama")
    if text["model_type"] not in ("llama", "mistral"):
        raise ValueError(f"{outer.model_type} with a {text['model_type']} text model is not "
                         "supported")
    if outer.tie_word_embeddings is not None:  # the top-level flag is the one HF ties by
        text["tie_word_embeddings"] = outer.tie_word_embeddings
    config = read_llama_config(msgspec.json.encode(text))
    return msgspec.structs.replace(config, multimodal=outer.model_type,
                                   image_token_id=outer.image_token_id)


class ImageSpec(msgspec.Struct, frozen=True):
    """What the engine accepts as one image's pixels (checked per request)."""

    image_size: int  # patches are [channels, image_size, image_size]
    channels: int
    tokens_per_patch: int  # encoder outputs per patch: image-token positions it fills
    image_token_id: int


class Idefics3Vision:
    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import Idefics3Config
        from transformers.models.idefics3.modeling_idefics3 import (
            Idefics3Connector,
            Idefics3VisionTransformer,
        )

        config = Idefics3Config.from_pretrained(folder)
        vision = config.vision_config
        self.patch_size = vision.patch_size
        self.dtype, self.device = dtype, device
        self.encoder = Idefics3VisionTransformer._from_config(vision)
        self.connector = Idefics3Connector(config)
        self._load(folder)
        for module in (self.encoder, self.connector):
            module.to(dtype=dtype, device=device).eval()
        self.spec = ImageSpec(
            image_size=vision.image_size, channels=vision.num_channels,
            tokens_per_patch=int((vision.image_size // vision.patch_size) ** 2
                                 / config.scale_factor ** 2),
            image_token_id=config.image_token_id,
        )

    def _load(self, folder: str) -> None:
        """The checkpoint's encoder and connector tensors, every one of them (strict)."""
        found: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "connector": {}}
        for shard in safetensors_shards(folder):
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    for prefix, part in _PREFIXES.items():
                        if name.startswith(prefix):
                            found[part][name[len(prefix):]] = f.get_tensor(name)
        self.encoder.load_state_dict(found["vision"], strict=True)
        self.connector.load_state_dict(found["connector"], strict=True)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """Patches [N, C, S, S] (any number of images, several requests' at once) and their
        pixel masks [N, S, S] -> embeddings [N * tokens_per_patch, hidden], patch by patch,
        as Idefics3Model.get_image_features computes them."""
        pixel_values = pixel_values.to(dtype=self.dtype, device=self.device)
        pixel_mask = pixel_mask.to(device=self.device)
        p = self.patch_size
        subgrid = pixel_mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = (subgrid.sum(dim=(-1, -2)) > 0).bool()
        hidden = self.encoder(pixel_values=pixel_values, patch_attention_mask=patch_mask,
                              return_dict=True).last_hidden_state
        features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])
