"""Images in (req T-13), piece by piece: media sources and decoding, parse-time part checks,
placeholder expansion, the never-split rule, the engine's checks of what it is sent, and the
prefix cache's image keys. The whole path runs in tests/integration/test_multimodal.py."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import numpy as np
import pytest

from engine.models.idefics3 import ImageSpec
from engine.request.sequence import Sequence
from engine.step.multimodal import ImageProblem, cache_key, parse_images
from engine.step.scheduler import Scheduler
from frontend.base.api_models import ChatCompletionRequest, ChatMessage, ContentPart
from frontend.base.errors import APIError
from frontend.input.budgets import PromptTokens
from frontend.input.media import MediaError, MediaSettings, decode_image, image_bytes
from frontend.input.multimodal import (
    MultimodalError,
    PreparedImage,
    expand_placeholders,
    image_inputs,
    image_parts,
)
from frontend.input.rendering import template_messages
from frontend.pipeline.input_stage import chat_input
from shared.protocol import ImageInput, RawTensor, SamplingParams, pack_tensor
from tests.tiny_vlm import data_url, png_bytes
from tests.unit.frontend_builders import serving_context

SETTINGS = MediaSettings()


def _bytes(url: str, settings: MediaSettings = SETTINGS) -> bytes:
    return asyncio.run(image_bytes(url, "p", settings))


# ---------------------------------------------------------------- sources


@pytest.mark.parametrize(("url", "reason"), [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/svg+xml;base64,AAAA", "unsupported image type"),
    ("data:;base64,AAAA", "unsupported image type"),
    ("data:image/png,AAAA", "must be base64"),
    ("data:image/png;base64", "comma"),
    ("gopher://x/cat.png", "must be data:"),
    ("", "needs a URL"),
])
def test_bad_data_urls(url, reason):
    with pytest.raises(MediaError, match=reason):
        _bytes(url)


def test_data_url_size_is_capped_before_decoding():
    small = MediaSettings(max_image_bytes=100)
    assert _bytes(data_url(b"x" * 100), small) == b"x" * 100
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        _bytes(data_url(b"x" * 200), small)


def test_local_files_only_inside_the_allowed_folder(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(b"png")
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", allowed / "link.png")
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        _bytes(f"file://{allowed}/a.png")  # off by default
    settings = MediaSettings(allowed_local_media_path=str(allowed))
    assert _bytes(f"file://{allowed}/a.png", settings) == b"png"
    for outside in (f"file://{tmp_path}/secret", f"file://{allowed}/../secret",
                    f"file://{allowed}/link.png"):
        with pytest.raises(MediaError, match="outside the folder"):
            _bytes(outside, settings)
    with pytest.raises(MediaError, match="local path"):
        _bytes(f"file://example.com{allowed}/a.png", settings)
    with pytest.raises(MediaError, match="larger than"):
        _bytes(f"file://{allowed}/a.png",
               MediaSettings(allowed_local_media_path=str(allowed), max_image_bytes=2))


def test_unreachable_url_is_a_media_error():
    from shared.transport import free_tcp_port

    with pytest.raises(MediaError, match="could not fetch"):
        _bytes(f"http://127.0.0.1:{free_tcp_port()}/x.png",
               MediaSettings(fetch_timeout_s=2))


# ---------------------------------------------------------------- decoding


def _encoded(image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def test_decoding_checks_format_size_and_damage():
    from PIL import Image

    assert decode_image(png_bytes(8, 8), "p", SETTINGS).size == (8, 8)
    rgba = _encoded(Image.new("RGBA", (4, 4)), "PNG")
    assert decode_image(rgba, "p", SETTINGS).mode == "RGB"
    for data, reason in [(b"not an image", "cannot be decoded"),
                         (png_bytes()[:80], "cannot be decoded"),
                         (_encoded(Image.new("RGB", (4, 4)), "TIFF"), "cannot be decoded|format"),
                         (_encoded(Image.new("1", (3000, 2000)), "PNG"), "more than")]:
        with pytest.raises(MediaError, match=reason):
            decode_image(data, "p", MediaSettings(max_image_pixels=5_000_000))


# ---------------------------------------------------------------- parts at parse time


def _message(*parts: ContentPart) -> ChatMessage:
    return ChatMessage(role="user", content=list(parts))


def _image(url: str = "data:x", **extra) -> ContentPart:
    return ContentPart(type="image_url", image_url={"url": url, **extra})


def test_image_parts_are_found_and_named_in_order():
    parts = image_parts([ChatMessage(role="system", content="hi"),
                         _message(ContentPart(type="text", text="a"), _image("u1")),
                         _message(_image("u2", detail="high"))])
    assert [(p.url, p.param) for p in parts] == [("u1", "messages[1].content[1]"),
                                                 ("u2", "messages[2].content[0]")]


@pytest.mark.parametrize(("parts", "reason", "param"), [
    ([_image(), ContentPart(type="image_embeds", image_embeds="AAAA")], "mutually exclusive|"
     "cannot be sent in one request", "messages[0].content[1]"),
    ([ContentPart(type="image_embeds", image_embeds="AAAA")], "not supported",
     "messages[0].content[0]"),
    ([_image(detail="ultra")], "detail", "messages[0].content[0].image_url.detail"),
    ([ContentPart(type="image_url", image_url={"detail": "low"})], "url",
     "messages[0].content[0].image_url"),
    ([ContentPart(type="image_url", image_url=7)], "url", "messages[0].content[0].image_url"),
    ([ContentPart(type="input_audio", input_audio={})], "audio", "messages[0].content[0]"),
])
def test_bad_parts_are_refused_before_loading(parts, reason, param):
    with pytest.raises(MultimodalError, match=reason) as err:
        image_parts([_message(*parts)])
    assert err.value.param == param


def test_string_templates_get_the_placeholder_in_the_text():
    messages = [_message(ContentPart(type="text", text="look"), _image())]
    assert template_messages(messages, False, "<image>")[0]["content"] == "look\n<image>"
    assert template_messages(messages, True, "<image>")[0]["content"] == [
        {"type": "text", "text": "look"}, {"type": "image"}]


def test_a_text_model_refuses_images_with_a_400():
    from tests.tiny_tokenizer import MAX_CHARS_PER_TOKEN, tiny_tokenizer

    request = ChatCompletionRequest(messages=[_message(ContentPart(type="text", text="hi"),
                                                       _image(data_url(png_bytes())))])
    with serving_context(tiny_tokenizer(), max_model_len=64,
                         max_chars_per_token=MAX_CHARS_PER_TOKEN) as ctx:
        with pytest.raises(APIError, match="takes no images") as err:
            asyncio.run(chat_input(ctx, request))
    assert err.value.status == 400


# ---------------------------------------------------------------- placeholders and truncation


def _prepared(prompt: str, image_tokens: int) -> PreparedImage:
    return PreparedImage(np.zeros((1, 3, 2, 2), np.float32), np.ones((1, 2, 2), bool), prompt,
                         image_tokens)


def test_expansion_needs_one_placeholder_per_image():
    images = [_prepared("[A I I A]", 2), _prepared("[B I B]", 1)]
    text, spans = expand_placeholders("x <image> y <image> z", "<image>", images)
    assert text == "x [A I I A] y [B I B] z"
    assert [text[a:b] for a, b in spans] == ["[A I I A]", "[B I B]"]
    for rendered in ("x <image> y", "<image><image><image>"):
        with pytest.raises(MultimodalError, match="placeholders"):
            expand_placeholders(rendered, "<image>", images)


def _tokens(text: str, ids_of: dict[str, int], keep: slice = slice(None)) -> PromptTokens:
    """Whitespace tokens of `text` with their offsets, then cut as truncation would."""
    ids, offsets, at = [], [], 0
    for word in text.split(" "):
        ids.append(ids_of.get(word, 0))
        offsets.append((at, at + len(word)))
        at += len(word) + 1
    return PromptTokens(ids=ids[keep], offsets=offsets[keep])


def test_truncation_keeps_an_image_whole_or_refuses():
    image = _prepared("<a> I I <a>", 2)
    text, spans = expand_placeholders("t t <image> u", "<image>", [image])
    ids = {"I": 9}
    [kept] = image_inputs(_tokens(text, ids), spans, [image], 9)
    assert (kept.offset, kept.length) == (2, 4)
    [kept] = image_inputs(_tokens(text, ids, slice(1, None)), spans, [image], 9)
    assert (kept.offset, kept.length) == (1, 4)  # a left cut of text shifts it
    assert image_inputs(_tokens(text, ids, slice(0, 2)), spans, [image], 9) == []  # all gone
    for cut in (slice(3, None), slice(5, None), slice(0, 4)):
        with pytest.raises(MultimodalError, match="cut through image 1"):
            image_inputs(_tokens(text, ids, cut), spans, [image], 9)


# ---------------------------------------------------------------- the engine's checks

SPEC = ImageSpec(image_size=2, channels=3, tokens_per_patch=2, image_token_id=9)


def _input(offset=1, length=4, patches=1, pixels=None, mask=None) -> ImageInput:
    pixels = np.zeros((patches, 3, 2, 2), np.float32) if pixels is None else pixels
    mask = np.ones((patches, 2, 2), bool) if mask is None else mask
    return ImageInput(pack_tensor(pixels), pack_tensor(mask), offset, length)


PROMPT = [5, 7, 9, 9, 7, 5]  # the image's span: positions 1..4, image tokens at 2 and 3


def test_engine_takes_a_well_formed_image():
    [image] = parse_images([_input()], PROMPT, SPEC)
    assert image.positions.tolist() == [2, 3]
    assert parse_images([], [5, 6], SPEC) == []


@pytest.mark.parametrize(("images", "prompt", "reason"), [
    ([_input(offset=4, length=4)], PROMPT, "not inside the prompt"),
    ([_input(offset=-1)], PROMPT, "not inside the prompt"),
    ([_input(length=0)], PROMPT, "not inside the prompt"),
    ([_input(), _input(offset=3, length=2)], PROMPT + [9, 9], "not inside the prompt"),
    ([_input(patches=2, pixels=np.zeros((2, 3, 2, 2), np.float32))], PROMPT, "make 4"),
    ([_input(pixels=np.zeros((1, 3, 4, 4), np.float32))], PROMPT, "pixel_values must be"),
    ([_input(pixels=np.zeros((1, 3, 2, 2), np.float16))], PROMPT, None),  # float16 is fine
    ([_input(pixels=np.zeros((1, 2, 2), bool))], PROMPT, "pixel_values must be"),
    ([_input(pixels=np.full((1, 3, 2, 2), np.nan, np.float32))], PROMPT, "finite"),
    ([_input(mask=np.ones((2, 2, 2), bool))], PROMPT, "pixel_attention_mask"),
    ([_input(mask=np.ones((1, 2, 2), np.float32))], PROMPT, "pixel_attention_mask"),
    ([ImageInput(RawTensor(b"\0" * 3, [1, 3, 2, 2], "float32"),
                 pack_tensor(np.ones((1, 2, 2), bool)), 1, 4)], PROMPT, "bytes"),
    ([_input()], PROMPT + [9], "outside every image"),
    ([], [5, 9], "outside every image"),
])
def test_engine_refuses_what_does_not_fit(images, prompt, reason):
    if reason is None:
        assert parse_images(images, prompt, SPEC)
        return
    with pytest.raises(ImageProblem, match=reason):
        parse_images(images, prompt, SPEC)


def test_a_text_engine_refuses_images():
    with pytest.raises(ImageProblem, match="takes no images"):
        parse_images([_input()], PROMPT, None)
    assert parse_images([], [9, 9], None) == []  # a text model has no image token


def _page_hashes(pixels: np.ndarray, page_size: int = 2) -> list[bytes]:
    from engine.step.kv_cache import PageAllocator

    images = parse_images([_input(pixels=pixels)], PROMPT, SPEC)
    seq = Sequence(request_id="r", token_ids=list(PROMPT), num_prompt_tokens=len(PROMPT),
                   params=SamplingParams(max_tokens=1), reply_to="x", arrival_time=0.0,
                   max_output_tokens=1, images=images)
    Scheduler(PageAllocator(8, page_size), 64, 4)._extend_hashes(seq, 3)
    return seq.page_hashes


def test_page_hashes_depend_on_the_image_they_show():
    red, blue = np.zeros((1, 3, 2, 2), np.float32), np.ones((1, 3, 2, 2), np.float32)
    assert _page_hashes(red) == _page_hashes(red.copy())
    a, b = _page_hashes(red), _page_hashes(blue)
    # Page 0 (tokens 0-1) holds the image's first span token: it and all after it differ.
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    images = parse_images([_input()], PROMPT, SPEC)
    assert cache_key(images, 0, 1) == b"" and cache_key(images, 4, 6) != b""


def test_image_bytes_base64_round_trip():
    assert _bytes("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"


def test_images_load_while_the_template_renders():
    """Each side waits for the other to have started: run one after the other, they would
    deadlock (and time out) instead of finishing."""
    from frontend.input.multimodal import ImagePart
    from tests.tiny_tokenizer import MAX_CHARS_PER_TOKEN, tiny_tokenizer

    loading, rendering = asyncio.Event(), asyncio.Event()

    class Vision:
        placeholder, image_token_id = "<image>", 9  # "hello" in the tiny vocabulary

        async def prepare(self, part: ImagePart) -> PreparedImage:
            loading.set()
            await asyncio.wait_for(rendering.wait(), 5)
            return _prepared("hello", 1)

    request = ChatCompletionRequest(messages=[_message(ContentPart(type="text", text="hi"),
                                                       _image())])
    with serving_context(tiny_tokenizer(), max_model_len=64,
                         max_chars_per_token=MAX_CHARS_PER_TOKEN) as ctx:
        ctx.vision = Vision()
        render = ctx.tokenization.render_chat

        async def render_chat(messages, params):
            rendering.set()
            await asyncio.wait_for(loading.wait(), 5)
            return await render(messages, params)

        ctx.tokenization.render_chat = render_chat
        prompt = asyncio.run(chat_input(ctx, request))
    [image] = prompt.images
    assert prompt.tokens.ids[image.offset] == 9 and image.length == 1


def test_other_apis_translate_image_parts():
    from frontend.anthropic import api as anthropic_api
    from frontend.anthropic.models import ContentBlock
    from frontend.responses import chat_request as responses_api
    from frontend.responses.models import InputItem, InputPart

    [message] = responses_api.input_messages([InputItem(role="user", content=[
        InputPart(type="input_text", text="look"),
        InputPart(type="input_image", image_url="data:x", detail="low")])])
    assert [p.type for p in message.content] == ["text", "image_url"]
    assert message.content[1].image_url == {"url": "data:x", "detail": "low"}
    with pytest.raises(APIError, match="file_id"):
        responses_api.input_messages([InputItem(role="user", content=[
            InputPart(type="input_image", file_id="f")])])
    source = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    [message] = anthropic_api._user([ContentBlock(type="image", source=source),
                                     ContentBlock(type="text", text="what")], "messages[0]")
    assert message.content[0].image_url == {"url": "data:image/png;base64,AAAA"}
    [message] = anthropic_api._user([ContentBlock(type="text", text="a"),
                                     ContentBlock(type="text", text="b")], "messages[0]")
    assert message.content == "a\nb"  # text only: one string, as before images
    with pytest.raises(APIError, match="base64 image source"):
        anthropic_api._user([ContentBlock(type="image", source={"type": "base64"})], "m")


@pytest.mark.parametrize(("config", "reason"), [
    ({"model_type": "idefics3", "image_token_id": 3}, "text_config"),
    ({"model_type": "idefics3", "text_config": {"model_type": "llama"}}, "text_config"),
    ({"model_type": "idefics3", "image_token_id": 3,
      "text_config": {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
                      "intermediate_size": 8, "num_hidden_layers": 1,
                      "num_attention_heads": 1}}, "not supported"),
])
def test_vision_configs_the_engine_cannot_serve_are_refused(tmp_path, config, reason):
    import json

    from engine.models.registry import load_model_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=reason):
        load_model_config(str(tmp_path))
