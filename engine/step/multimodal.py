"""A request's images inside the engine (req T-13): checked on arrival, hashed into the prefix
cache, encoded once, and merged into the text model's input embeddings.

- `parse_images` trusts no peer: dtypes, shapes, byte counts and placeholder spans are checked
  against the prompt and the model before a tensor is built, and every image token of the
  prompt must belong to exactly one image's span.
- `cache_key` folds the hashes of the images a page's tokens overlap into that page's
  prefix-cache hash, so two prompts with the same tokens but different images never share
  pages, while the same image sent again does (the hash is of the pixels, computed here).
- `step_embeddings` runs the vision encoder for every image a step's chunks reach and that
  has no embeddings yet, all of them in one batch across requests, and returns the rows of
  the flattened step whose embeddings the images replace.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
import torch

from engine.models.idefics3 import ImageSpec
from shared.protocol import ImageInput, unpack_tensor


class ImageProblem(ValueError):
    """Why a request's images cannot be used: the request is refused with a 400."""


class SeqImage(msgspec.Struct):
    positions: np.ndarray  # int64: prompt positions of its image tokens, ascending
    offset: int  # its placeholder span in the prompt: [offset, offset + length)
    length: int
    key: bytes  # content hash (pixels, mask, shape)
    pixel_values: torch.Tensor | None  # [patches, C, S, S]; dropped once encoded
    pixel_mask: torch.Tensor | None  # [patches, S, S] bool
    features: torch.Tensor | None = None  # [len(positions), hidden] once encoded


# ---------------------------------------------------------------- arrival


def parse_images(images: list[ImageInput], prompt: list[int], spec: ImageSpec | None
                 ) -> list[SeqImage]:
    if spec is None:
        if images:
            raise ImageProblem("this model takes no images")
        return []
    ids = np.asarray(prompt)
    out: list[SeqImage] = []
    end = 0
    for i, image in enumerate(images):
        if image.offset < end or image.length < 1 or image.offset + image.length > len(ids):
            raise ImageProblem(f"image {i}'s placeholder span [{image.offset}, "
                               f"{image.offset + image.length}) is not inside the prompt "
                               "after the previous image's")
        end = image.offset + image.length
        out.append(_one_image(i, image, ids, spec))
    placed = sum(len(img.positions) for img in out)
    if placed != int((ids == spec.image_token_id).sum()):
        raise ImageProblem("the prompt holds image tokens outside every image's placeholder "
                           "span (or images without their tokens)")
    return out


def _one_image(i: int, image: ImageInput, ids: np.ndarray, spec: ImageSpec) -> SeqImage:
    try:
        pixels = unpack_tensor(image.pixel_values)
        mask = unpack_tensor(image.pixel_attention_mask)
    except ValueError as exc:
        raise ImageProblem(f"image {i}: {exc}") from None
    size, channels = spec.image_size, spec.channels
    if pixels.dtype.kind != "f" or pixels.ndim != 4 or pixels.shape[1:] != (channels, size,
                                                                             size):
        raise ImageProblem(f"image {i}: pixel_values must be float [patches, {channels}, "
                           f"{size}, {size}], not {pixels.dtype} {list(pixels.shape)}")
    if mask.dtype != np.bool_ or mask.shape != (pixels.shape[0], size, size):
        raise ImageProblem(f"image {i}: pixel_attention_mask must be bool [patches, {size}, "
                           f"{size}]")
    if not np.isfinite(pixels).all():
        raise ImageProblem(f"image {i}: pixel_values must be finite")
    span = ids[image.offset : image.offset + image.length]
    positions = image.offset + np.flatnonzero(span == spec.image_token_id)
    wanted = pixels.shape[0] * spec.tokens_per_patch
    if len(positions) != wanted:
        raise ImageProblem(f"image {i}: its span holds {len(positions)} image tokens, but its "
                           f"{pixels.shape[0]} patches make {wanted}")
    key = hashlib.blake2b(digest_size=16, person=b"sluice-image")
    for part in (image.pixel_values, image.pixel_attention_mask):
        key.update(np.asarray(part.shape, dtype="<i8").tobytes())
        key.update(part.dtype.encode())
        key.update(part.data)
    return SeqImage(positions.astype(np.int64), image.offset, image.length, key.digest(),
                    torch.from_numpy(pixels.copy()), torch.from_numpy(mask.copy()))


# ---------------------------------------------------------------- prefix cache


def cache_key(images: list[SeqImage], start: int, end: int) -> bytes:
    """The hashes of the images whose spans overlap tokens [start, end); b"" for none."""
    return b"".join(img.key for img in images
                    if img.offset < end and start < img.offset + img.length)


# ---------------------------------------------------------------- the step


def _reached(img: SeqImage, start: int, end: int) -> np.ndarray:
    """Indices into img.positions of the image tokens among [start, end)."""
    lo, hi = np.searchsorted(img.positions, [start, end])
    return np.arange(lo, hi)


def _encode_missing(chunks, vision) -> None:
    """One encoder batch for every image this step reaches that is not yet encoded."""
    todo = [img for c in chunks for img in c.seq.images
            if img.features is None and len(_reached(img, c.start, c.start + c.num_tokens))]
    if not todo:
        return
    features = vision.encode(torch.cat([img.pixel_values for img in todo]),
                             torch.cat([img.pixel_mask for img in todo]))
    for img, part in zip(todo, features.split([len(i.positions) for i in todo]), strict=True):
        img.features = part
        img.pixel_values = img.pixel_mask = None  # the embeddings outlive a preemption


def step_embeddings(chunks, vision) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows of the flattened step, their embeddings) for the image tokens the chunks feed,
    chunk after chunk as the runner lays them out; None when the step feeds none."""
    if vision is None or not any(c.seq.images for c in chunks):
        return None
    _encode_missing(chunks, vision)
    rows: list[np.ndarray] = []
    values: list[torch.Tensor] = []
    base = 0
    for chunk in chunks:
        for img in chunk.seq.images:
            reached = _reached(img, chunk.start, chunk.start + chunk.num_tokens)
            if len(reached):
                rows.append(base + img.positions[reached] - chunk.start)
                values.append(img.features[torch.from_numpy(reached)])
        base += chunk.num_tokens
    if not rows:
        return None
    device = values[0].device
    return torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(values)
