"""Media loading (req T-13): an image part's source -> its bytes -> a decoded RGB image.

Sources: `data:` URLs (base64), local files under --allowed-local-media-path (`file://` URLs,
off unless the flag is set, as in vLLM) and http(s) URLs, fetched with a byte cap and a
timeout. Every failure is a `MediaError`, a 400 naming the part: an image the client sent
that we cannot read is the client's to fix, never a 5xx. Decoding runs on a worker thread
(Pillow holds the GIL only in parts, and a large PNG takes tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.parse

import httpx
import msgspec

# Formats Pillow decodes that browsers and the OpenAI API accept; anything else is refused
# before decoding, so an exotic decoder never sees client bytes.
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif",
                 "WEBP": "image/webp", "BMP": "image/bmp"}
MIME_TYPES = frozenset(IMAGE_FORMATS.values()) | {"image/jpg"}


class MediaError(ValueError):
    """A part whose media cannot be used; a 400 carrying the reason, `param` the part."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class MediaSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Server-wide media limits, fixed at start-up (docs/multimodal.md lists them)."""

    allowed_local_media_path: str | None = None  # None: file:// sources are refused
    max_image_bytes: int = 20 * 2**20  # encoded size, whatever the source
    max_image_pixels: int = 40_000_000  # width * height, checked before decoding
    fetch_timeout_s: float = 10.0  # an http(s) fetch, connect to last byte
    max_images_per_prompt: int = 8  # --limit-mm-per-prompt '{"image": N}'


# ---------------------------------------------------------------- bytes from a source


def _data_url(url: str, param: str, limit: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("a data URL needs a comma before its data", param)
    meta = header[len("data:"):].split(";")
    mime = meta[0].strip().lower()
    if mime not in MIME_TYPES:
        raise MediaError(f"unsupported image type {mime or '(none)'!r} in the data URL; "
                         f"send one of {', '.join(sorted(MIME_TYPES))}", param)
    if "base64" not in meta[1:]:
        raise MediaError("image data URLs must be base64 (data:image/png;base64,...)", param)
    if len(payload) > limit * 4 // 3 + 4:  # before decoding: base64 is 4 chars per 3 bytes
        raise MediaError(f"the image is larger than {limit} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's image is not valid base64", param) from None


def _local_file(url: str, param: str, settings: MediaSettings) -> bytes:
    root = settings.allowed_local_media_path
    if root is None:
        raise MediaError("file:// images are off on this server (the operator can allow a "
                         "folder with --allowed-local-media-path)", param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError("a file:// URL must name a local path", param)
    # realpath first: a symlink or `..` must not lead out of the allowed folder.
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise MediaError("the file is outside the folder this server may read images from "
                         "(--allowed-local-media-path)", param)
    try:
        with open(path, "rb") as f:
            data = f.read(settings.max_image_bytes + 1)
    except OSError as exc:
        raise MediaError(f"cannot read the image file: {exc.strerror or exc}", param) from None
    if len(data) > settings.max_image_bytes:
        raise MediaError(f"the image is larger than {settings.max_image_bytes} bytes", param)
    return data


async def _fetch(url: str, param: str, settings: MediaSettings) -> bytes:
    limit = settings.max_image_bytes
    try:
        async with httpx.AsyncClient(timeout=settings.fetch_timeout_s, follow_redirects=True,
                                     max_redirects=3) as client:
            # One deadline for the whole fetch: httpx's timeout is per read, which a slow
            # server could stretch forever.
            async with asyncio.timeout(settings.fetch_timeout_s):
                return await _read_capped(client, url, param, limit)
    except MediaError:
        raise
    except TimeoutError:
        raise MediaError(f"fetching the image timed out after {settings.fetch_timeout_s:g} s",
                         param) from None
    except (httpx.HTTPError, OSError, ValueError) as exc:
        raise MediaError(f"could not fetch the image: {type(exc).__name__}: {exc}",
                         param) from None


async def _read_capped(client: httpx.AsyncClient, url: str, param: str, limit: int) -> bytes:
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            raise MediaError(f"fetching the image got HTTP {response.status_code}", param)
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise MediaError(f"the image is larger than {limit} bytes", param)
            chunks.append(chunk)
        return b"".join(chunks)


async def image_bytes(url: str, param: str, settings: MediaSettings) -> bytes:
    if not isinstance(url, str) or not url:
        raise MediaError("an image part needs a URL", param)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, param, settings.max_image_bytes)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, param, settings)
    if scheme in ("http", "https"):
        return await _fetch(url, param, settings)
    raise MediaError("image URLs must be data:, http(s): or file: URLs", param)


# ---------------------------------------------------------------- decoding


def decode_image(data: bytes, param: str, settings: MediaSettings):
    """The decoded image, RGB; synchronous (run it on a worker thread)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise MediaError("the image cannot be decoded (not a PNG, JPEG, GIF, WebP or BMP "
                         "file, or a damaged one)", param) from None
    if image.format not in IMAGE_FORMATS:
        raise MediaError(f"unsupported image format {image.format}", param)
    width, height = image.size
    if width * height > settings.max_image_pixels:  # before decoding: it is what costs
        raise MediaError(f"the image has {width}x{height} pixels, more than "
                         f"{settings.max_image_pixels} in all", param)
    try:
        image.load()
        return image.convert("RGB")
    except Exception:  # a truncated or corrupt stream fails in the decoder, in many ways
        raise MediaError("the image cannot be decoded (damaged or truncated data)",
                         param) from None


async def load_image(url: str, param: str, settings: MediaSettings):
    data = await image_bytes(url, param, settings)
    return await asyncio.to_thread(decode_image, data, param, settings)
