"""Images in, end to end (issue 22, req T-13), on one stack serving a tiny random Idefics3
(tests/tiny_vlm.py) in float32: greedy tokens equal transformers' `generate` for the same
image and text, alone and batched with other images and text-only prompts; the official
OpenAI and Anthropic clients send images; bad media, a truncation through an image and
sources outside what the server allows are 400s naming the part."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import threading

import anthropic
import httpx
import openai
import pytest

from shared.transport import free_tcp_port
from tests.servers import Stack
from tests.tiny_vlm import CHAT_TEMPLATE, build_tiny_vlm, data_url, png_bytes, tiny_vlm_tokenizer

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


class _Images(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path != "/cat.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm")
    folder = build_tiny_vlm(str(tmp / "model"))
    media = tmp / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png_bytes(seed=3))
    (tmp / "secret.png").write_bytes(png_bytes(seed=3))
    _Images.png = png_bytes(seed=4)
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    stack = Stack(str(tmp), "--model", folder, "--dtype", "float32", "--max-model-len", "512",
                  "--allowed-local-media-path", str(media),
                  "--limit-mm-per-prompt", '{"image": 2}')
    yield {"url": stack.base_url, "folder": folder, "tmp": tmp,
           "http": f"http://127.0.0.1:{images.server_address[1]}"}
    stack.stop()
    images.shutdown()


@pytest.fixture(scope="module")
def reference(vlm):
    """transformers' greedy continuation of (text, images) through its own processor."""
    import torch
    from PIL import Image
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = tiny_vlm_tokenizer()
    processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(vlm["folder"]),
                                  tok, image_seq_len=4, chat_template=CHAT_TEMPLATE)
    model = Idefics3ForConditionalGeneration.from_pretrained(vlm["folder"],
                                                             dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # sluice runs with ignore_eos

    def generate(text: str, pngs: list[bytes]) -> tuple[str, int]:
        content = [{"type": "image"} for _ in pngs] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)
        images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs] or None
        inputs = processor(text=prompt, images=images, return_tensors="pt",
                           add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        length = inputs["input_ids"].shape[1]
        return tok.decode(out[0, length:], skip_special_tokens=True), length

    return generate


def _chat(url: str, text: str, pngs: list[bytes], **extra) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def _answer(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_greedy_tokens_match_transformers(vlm, reference):
    png = png_bytes(seed=1)
    assert _answer(_chat(vlm["url"], "describe the image", [png])) == reference(
        "describe the image", [png])


def test_batched_with_other_images_and_text_only_prompts(vlm, reference):
    """One step holds two images behind the same text (were the image left out of the
    prefix-cache hash, the second would read the first's pages) and two text-only prompts;
    each answer is transformers' for it alone. Sending an image again hits the cache."""
    cases = [("what is this picture", [png_bytes(seed=5)]),
             ("what is this picture", [png_bytes(seed=6)]),
             ("hello world", []), ("what is the sky", [])]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: _answer(_chat(vlm["url"], *c)), cases))
    assert answers == [reference(*c) for c in cases]
    assert answers[0][0] != answers[1][0]  # the images matter to the answer
    hits = _metric(vlm["url"], "vllm:prefix_cache_hits_total")
    assert _answer(_chat(vlm["url"], *cases[1])) == answers[1]
    assert _metric(vlm["url"], "vllm:prefix_cache_hits_total") > hits


def test_two_images_in_one_prompt(vlm, reference):
    pngs = [png_bytes(seed=7), png_bytes(40, 24, seed=8)]  # the second one unsplit, padded
    assert _answer(_chat(vlm["url"], "two", pngs)) == reference("two", pngs)


def test_official_openai_client(vlm, reference):
    """Greedy, so the answer is transformers' own: a sampled answer from a random model may
    be only skipped special tokens (an empty content that proves nothing)."""
    client = openai.OpenAI(base_url=vlm["url"] + "/v1", api_key="x")
    png = png_bytes()
    answer = client.chat.completions.create(
        model="model", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png), "detail": "low"}},
            {"type": "text", "text": "what is this"},
        ]}])
    assert (answer.choices[0].message.content, answer.usage.prompt_tokens) == reference(
        "what is this", [png])
    assert answer.usage.prompt_tokens > 31  # the 31 tokens of a 64 px image's expansion


def test_official_anthropic_client(vlm):
    client = anthropic.Anthropic(base_url=vlm["url"], api_key="x")
    source = {"type": "base64", "media_type": "image/png",
              "data": base64.b64encode(png_bytes()).decode()}
    message = client.messages.create(model="model", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": source},
                                     {"type": "text", "text": "what is this"}]}])
    # A random model may end at once or say only skipped special tokens: then the message
    # has no text block. It answered, with tokens generated and the image counted.
    assert message.role == "assistant" and message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens >= 1
    assert all(block.type == "text" for block in message.content)
    assert message.usage.input_tokens > 31


def test_responses_input_image(vlm):
    response = httpx.post(f"{vlm['url']}/v1/responses", timeout=60, json={
        "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is this"},
            {"type": "input_image", "image_url": data_url(png_bytes())}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] > 31


def test_truncation_never_splits_an_image(vlm):
    """Text, then the image (31 tokens), then the assistant's opening: a left cut of the
    text keeps the image whole; a cut into the image is a 400 saying so."""
    parts = [{"type": "text", "text": "what is this picture of " * 4},
             _image(data_url(png_bytes()))]

    def send(**extra) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, **extra}
        return httpx.post(f"{vlm['url']}/v1/chat/completions", json=body, timeout=60)

    _, full = _answer(send())
    _, kept = _answer(send(truncate_prompt_tokens=full - 2))
    assert kept == full - 2
    r = send(truncate_prompt_tokens=20)  # fewer than the image and what follows it
    assert r.status_code == 400 and "cut through image 1" in r.json()["error"]["message"]
    # Without truncation an over-long prompt counts the expanded image tokens: 31 of them
    # plus 482 words is over the 512-token context, though the text alone is not.
    words = {"type": "text", "text": "what " * 482}
    assert _image_request(vlm, [words]).status_code == 200
    r = _image_request(vlm, [words, _image(data_url(png_bytes()))])
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_max_tokens_room_counts_the_image_tokens(vlm):
    """The room left for output is the context less the expanded prompt: a max_tokens the
    text alone (one placeholder token) would leave room for is a 400."""
    parts = [{"type": "text", "text": "hello"}, _image(data_url(png_bytes()))]
    _, prompt = _answer(_image_request(vlm, parts))
    assert prompt > 31
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 512 - prompt + 1}
    r = httpx.post(f"{vlm['url']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def _huge_png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (10_000, 5_000)).save(out, format="PNG")  # 50 Mpx, a few kB
    return out.getvalue()


BAD = [
    ("data:image/png;base64,!!!not base64!!!", "not valid base64"),
    ("data:image/tiff;base64,AAAA", "unsupported image type"),
    ("data:image/png,rawbytes", "must be base64"),
    (data_url(b"hello, not an image"), "cannot be decoded"),
    (data_url(png_bytes()[:60]), "cannot be decoded"),
    ("ftp://example.com/cat.png", "data:, http(s): or file:"),
]


@pytest.mark.parametrize(("url", "reason"), BAD)
def test_broken_images_are_400s_naming_the_part(vlm, url, reason):
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 2}
    r = httpx.post(f"{vlm['url']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert reason in error["message"]
    assert error["param"] == "messages[0].content[1]"


def _image_request(vlm, parts: list[dict]) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    return httpx.post(f"{vlm['url']}/v1/chat/completions", json=body, timeout=60)


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_limits_and_exclusive_inputs_are_400s(vlm):
    big = data_url(_huge_png())
    cases = [
        ([_image(big)], "more than"),
        ([_image(data_url(png_bytes()))] * 3, "at most 2 images"),
        ([_image(data_url(png_bytes())), {"type": "image_embeds", "image_embeds": "AAAA"}],
         "cannot be sent in one request"),
        ([{"type": "image_embeds", "image_embeds": "AAAA"}], "not supported"),
        ([{"type": "image_url", "image_url": {"url": data_url(png_bytes()), "detail": "max"}}],
         "detail"),
        ([{"type": "input_audio", "input_audio": {}}], "audio"),
    ]
    for parts, reason in cases:
        r = _image_request(vlm, parts)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], (reason, r.text)


def test_local_files_and_http_fetches(vlm):
    tmp = vlm["tmp"]
    assert _image_request(vlm, [_image(f"file://{tmp}/media/cat.png")]).status_code == 200
    assert _image_request(vlm, [_image(f"{vlm['http']}/cat.png")]).status_code == 200
    refused = [(f"file://{tmp}/secret.png", "outside the folder"),
               (f"file://{tmp}/media/../secret.png", "outside the folder"),
               (f"file://{tmp}/media/none.png", "cannot read"),
               (f"{vlm['http']}/missing.png", "HTTP 404"),
               (f"http://127.0.0.1:{free_tcp_port()}/cat.png", "could not fetch")]
    for url, reason in refused:
        r = _image_request(vlm, [_image(url)])
        assert r.status_code == 400 and reason in r.json()["error"]["message"], (url, r.text)


def test_image_tokens_typed_as_text_are_refused(vlm):
    """A placeholder in the text would leave the images and their tokens misaligned."""
    r = _image_request(vlm, [{"type": "text", "text": "<image>"}, _image(data_url(png_bytes()))])
    assert r.status_code == 400 and "placeholders" in r.json()["error"]["message"]
    # Without images, the engine finds image tokens outside any image and refuses them.
    r = _chat(vlm["url"], "<image>", [])
    assert r.status_code == 400 and "image tokens" in r.json()["error"]["message"]
