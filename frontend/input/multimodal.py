"""Images in chat prompts (req T-13): the parts, the model's processor, and the placeholders.

In the order a request meets them: `image_parts` finds and counts a request's image parts
at parse time (before anything is loaded); `VisionProcessor.prepare` loads one image
(`frontend.input.media`) and runs the model's own image processor on it, which gives its pixel
tensors and the exact placeholder text the model's processor would write for it;
`expand_placeholders` swaps each rendered placeholder for that text; after tokenizing,
`image_inputs` finds each image's tokens and refuses a prompt whose truncation cut through
one (a 400, never a split image).

Only Idefics3 / SmolVLM is wired (docs/multimodal.md says why); its processor classes come
from transformers, loaded from the model folder, the PIL backend (no torchvision).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os

import msgspec
import numpy as np

from frontend.base.api_models import ChatMessage
from frontend.input.budgets import PromptTokens
from frontend.input.media import MediaError, MediaSettings, load_image
from shared.protocol import ImageInput, pack_tensor

IMAGE_PART_TYPES = ("image_url", "input_image")
# Parts we know but cannot take: a clear 400 each, not "unknown part".
_UNSUPPORTED_PARTS = {
    "input_audio": "audio input is not supported",
    "audio_url": "audio input is not supported",
    "video_url": "video input is not supported",
    "file": "file parts are not supported",
    "image_embeds": "precomputed image embeddings (image_embeds) are not supported here",
}
_DETAILS = ("auto", "low", "high")


class ImagePart(msgspec.Struct, frozen=True):
    url: str
    param: str  # the part's place in the request, for errors: messages[1].content[0]


class PreparedImage(msgspec.Struct, frozen=True):
    pixel_values: np.ndarray  # float32 [patches, 3, S, S]
    pixel_attention_mask: np.ndarray  # bool [patches, S, S]
    prompt: str  # the placeholder expansion: the text this image's tokens come from
    num_image_tokens: int  # image-token positions in it (patches * tokens per patch)


class MultimodalError(ValueError):
    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------- parts (parse time)


def _part_url(part, param: str) -> str:
    """The URL of an image_url ({url, detail}) or input_image (a URL string) part."""
    value = part.image_url
    if isinstance(value, dict):
        detail = value.get("detail", "auto")
        if detail not in _DETAILS:
            raise MultimodalError(f"image_url.detail must be one of {_DETAILS}",
                                  param + ".image_url.detail")
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MultimodalError("an image part needs image_url with a url", param + ".image_url")
    return value


def image_parts(messages: list[ChatMessage]) -> list[ImagePart]:
    """Every image part in message order, checked and counted before anything loads; other
    non-text parts are a 400 naming them. image_embeds beside images is a 400 of its own:
    the two are mutually exclusive (vLLM's rule), whatever we support."""
    found: list[ImagePart] = []
    embeds: str | None = None
    for i, message in enumerate(messages):
        if message.content is None or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if part.type in IMAGE_PART_TYPES:
                found.append(ImagePart(_part_url(part, param), param))
            elif part.type == "image_embeds":
                embeds = embeds or param
            elif part.type in _UNSUPPORTED_PARTS and part.type != "image_embeds":
                raise MultimodalError(_UNSUPPORTED_PARTS[part.type], param)
    if embeds is not None:
        if found:
            raise MultimodalError("image_embeds and images cannot be sent in one request: "
                                  "send either precomputed embeddings or images", embeds)
        raise MultimodalError(_UNSUPPORTED_PARTS["image_embeds"], embeds)
    return found


# ---------------------------------------------------------------- the model's processor


class VisionProcessor:
    """The model's image processor and placeholder layout, loaded once at start-up."""

    def __init__(self, model_folder: str, tokenizer, settings: MediaSettings) -> None:
        from transformers.models.idefics3 import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        with open(os.path.join(model_folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        vision = config.get("vision_config", {})
        self.settings = settings
        self.image_size = int(vision.get("image_size", 224))
        patch, scale = int(vision.get("patch_size", 32)), int(config.get("scale_factor", 2))
        # Tokens per patch, as Idefics3Model computes it: what the encoder gives each patch.
        self.tokens_per_patch = int(((self.image_size // patch) ** 2) / (scale ** 2))
        self.images = Idefics3ImageProcessorPil.from_pretrained(model_folder)
        # The processor adds its special tokens to the tokenizer it is given: a copy, so
        # ours stays as loaded (req T-9). It is used only for its placeholder layout.
        self._layout = Idefics3Processor(self.images, copy.deepcopy(tokenizer),
                                         image_seq_len=self.tokens_per_patch)
        self.placeholder = self._layout.image_token  # what templates write for an image
        self.image_token_id = int(config["image_token_id"])

    def process(self, image, param: str) -> PreparedImage:
        """Pixel tensors and placeholder text of one decoded image; synchronous."""
        try:
            out = self.images(images=[[image]], return_row_col_info=True, return_tensors="np")
            pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
            mask = np.asarray(out["pixel_attention_mask"][0]).astype(bool)
            pixels, mask = self._pad(pixels, mask)
        except Exception as exc:  # the processor's own refusal of an image it cannot take
            raise MediaError(f"the image processor rejected the image: {exc}", param) from None
        prompt = self._layout.replace_image_token(
            {"rows": out["rows"], "cols": out["cols"]}, 0)
        return PreparedImage(pixels, mask, prompt, len(pixels) * self.tokens_per_patch)

    def _pad(self, pixels: np.ndarray, mask: np.ndarray):
        """Patches padded to the encoder's square (a small unsplit image comes smaller): the
        engine takes one shape, and the mask keeps the padding out of attention."""
        size = self.image_size
        n, c, h, w = pixels.shape
        if (h, w) == (size, size):
            return pixels, mask
        if h > size or w > size:
            raise ValueError(f"the image processor made {h}x{w} patches, over {size}")
        padded = np.zeros((n, c, size, size), np.float32)
        padded[:, :, :h, :w] = pixels
        full = np.zeros((n, size, size), bool)
        full[:, :h, :w] = mask
        return padded, full

    async def prepare(self, part: ImagePart) -> PreparedImage:
        image = await load_image(part.url, part.param, self.settings)
        return await asyncio.to_thread(self.process, image, part.param)


def load_vision_processor(model_path: str, tokenizer, settings: MediaSettings
                          ) -> VisionProcessor | None:
    """The processor of a vision-language model folder; None for a text-only model."""
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return None  # a GGUF file: text only
    with open(config_file, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type != "idefics3":
        return None
    return VisionProcessor(model_path, tokenizer, settings)


# ---------------------------------------------------------------- placeholders


def expand_placeholders(text: str, placeholder: str, images: list[PreparedImage]
                        ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text with the i-th placeholder replaced by image i's expansion, and each
    expansion's character span. The template must have written exactly one placeholder per
    image, or the tokens and images would not line up."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise MultimodalError(
            f"the rendered prompt holds {len(pieces) - 1} image placeholders "
            f"({placeholder!r}) for {len(images)} images: the chat template must write one "
            "per image part, and message text must not contain the placeholder itself")
    out, spans, at = [pieces[0]], [], len(pieces[0])
    for image, after in zip(images, pieces[1:], strict=True):
        spans.append((at, at + len(image.prompt)))
        out += [image.prompt, after]
        at += len(image.prompt) + len(after)
    return "".join(out), spans


def image_inputs(tokens: PromptTokens, spans: list[tuple[int, int]],
                 images: list[PreparedImage], image_token_id: int) -> list[ImageInput]:
    """Each kept image's tokens as the engine takes them. An image is kept whole or (cut off
    entirely by truncation) not at all; a cut through its tokens is a 400 (req T-13)."""
    offsets = tokens.offsets or []
    out: list[ImageInput] = []
    for i, ((start, end), image) in enumerate(zip(spans, images, strict=True)):
        inside = [t for t, (a, b) in enumerate(offsets) if a >= start and b <= end and b > a]
        if not inside:
            continue  # truncation removed the whole image: nothing of it remains
        first, last = inside[0], inside[-1]
        count = sum(1 for t in inside if tokens.ids[t] == image_token_id)
        whole = (offsets[first][0] == start and offsets[last][1] == end
                 and count == image.num_image_tokens and last - first + 1 == len(inside))
        if not whole:
            raise MultimodalError(
                f"truncating the prompt would cut through image {i + 1}'s tokens (an image "
                "is kept whole or not at all): raise truncate_prompt_tokens, truncate from "
                "the other side, or send fewer images or less text")
        out.append(ImageInput(pack_tensor(image.pixel_values),
                              pack_tensor(image.pixel_attention_mask),
                              offset=first, length=last - first + 1))
    return out
