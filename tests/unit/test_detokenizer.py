"""IncrementalDetokenizer (req O-2): streamed deltas never split a UTF-8 character, and they
add up to tokenizer.decode(output_ids) exactly."""

import json
import random
import time

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from postproc.detokenizer import IncrementalDetokenizer, detokenize
from shared.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "\nstarts with a newline\n\nand has\r\nothers\n",
    "Café naïve façade Ærø — déjà vu; Straße, Łódź, Ελληνικά, русский",
    "中文：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀🎉 skin tone 👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 rainbow 🏳️‍🌈",
    "mixed: a😀b你c\u00e9d\u0301 combining, zero\u200bwidth, tab\tend",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|im_start|>user\nok<|im_end|>",
    "special mid-word: abc<|im_end|>def<|endoftext|>😀<|im_end|>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² ∑ ∫ and a lone \ufffd replacement char",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def chunked(ids, sizes):
    """Splits ids into consecutive chunks, cycling through sizes."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def stream(tokenizer, prompt_ids, chunks, skip):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.push(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def check_stream(tokenizer, prompt_ids, output_ids, chunks, skip):
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
    deltas = stream(tokenizer, prompt_ids, chunks, skip)
    assert "".join(deltas) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas), deltas
    # What a client has seen at any moment is a prefix of the final text.
    seen = ""
    for d in deltas:
        seen += d
        assert expected.startswith(seen)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_stream(tokenizer, [], ids, [[i] for i in ids], skip)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("sizes", [[2], [3, 1, 5], [7, 2], [1000]])
@pytest.mark.parametrize("text", TEXTS)
def test_uneven_chunks(tokenizer, text, sizes, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_stream(tokenizer, [], ids, chunked(ids, sizes), skip)


def test_multibyte_characters_are_held_back(tokenizer):
    # The family emoji is 25 bytes; SmolLM2 spells it with byte-level pieces that end
    # mid-character, so some pushes must return nothing rather than half a character.
    ids = tokenizer.encode("👨‍👩‍👧‍👦", add_special_tokens=False)
    deltas = stream(tokenizer, [], [[i] for i in ids], skip=True)
    assert "" in deltas[:-1]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "👨‍👩‍👧‍👦"


@pytest.mark.parametrize("skip", [True, False])
def test_chat_prompt_context(tokenizer, skip):
    messages = [{"role": "user", "content": "Say hi in French"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(" Bonjour à tous ! 👋<|im_end|>", add_special_tokens=False)
    check_stream(tokenizer, prompt_ids, output_ids, [[i] for i in output_ids], skip)
    check_stream(tokenizer, prompt_ids, output_ids, chunked(output_ids, [3, 2]), skip)


def test_prompt_ending_mid_character(tokenizer):
    # A prompt given as token ids can stop inside a character; the output then starts with
    # the character's tail bytes, which decode(output_ids) shows as U+FFFD.
    ids = tokenizer.encode("你好世界", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    prompt_ids, output_ids = ids[:cut], ids[cut:]
    expected = tokenizer.decode(output_ids)
    assert expected.startswith("\ufffd")
    check_stream(tokenizer, prompt_ids, output_ids, [[i] for i in output_ids], True)


@pytest.mark.parametrize("seed", range(20))
def test_random_ids(tokenizer, seed):
    # Arbitrary ids include byte pieces that never complete a character; the stream must
    # still add up to decode() and only carry U+FFFD where decode() has it.
    rng = random.Random(seed)
    pool = list(range(0, 400)) + [rng.randrange(len(tokenizer)) for _ in range(200)]
    ids = [rng.choice(pool) for _ in range(rng.randrange(1, 60))]
    prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
    for skip in (True, False):
        chunks = chunked(ids, [rng.randrange(1, 4) for _ in range(5)])
        deltas = stream(tokenizer, prompt, chunks, skip)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        # Only the final flush may end inside a character.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_flush_emits_unfinished_bytes(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # drop the emoji's last piece
    detok = IncrementalDetokenizer(tokenizer, [])
    pushed = "".join(detok.push([i]) for i in ids)
    assert "\ufffd" not in pushed
    tail = detok.flush()
    assert pushed + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")
    assert detok.flush() == ""


def test_only_special_tokens(tokenizer):
    ids = [2, 0, 1, 2]
    assert stream(tokenizer, [], [[i] for i in ids], skip=True) == ["", "", "", "", ""]
    assert "".join(stream(tokenizer, [], [[i] for i in ids], skip=False)) == (
        "<|im_end|><|endoftext|><|im_start|><|im_end|>"
    )


def test_detokenize_matches_stream(tokenizer):
    ids = tokenizer.encode(TEXTS[5] + TEXTS[8], add_special_tokens=False)
    for skip in (True, False):
        assert detokenize(tokenizer, [1, 2], ids, skip) == tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_window_stays_small(tokenizer):
    # O(1) work per token: each decode covers only the last chunk plus pending tokens.
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ids[:50])
    start = time.perf_counter()
    for i in ids:
        detok.push([i])
        assert len(detok._window) <= 16
    elapsed = time.perf_counter() - start
    assert detok.text + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert elapsed / len(ids) < 200e-6  # typically ~4 us per token


# ---------------------------------------------------------------------------------------------
# A Llama-2-style SentencePiece tokenizer: "▁" for spaces, <0xNN> byte-fallback pieces, and a
# decoder that strips the text's first space.


@pytest.fixture(scope="module")
def sp_tokenizer():
    corpus = ["The capital of France is Paris.", "Hello world, hello there.", "naïve café"] * 5
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    )
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = trained.normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS + ["Hello 你好 world</s> is Paris"])
def test_sentencepiece_byte_fallback(sp_tokenizer, text, skip):
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    check_stream(sp_tokenizer, [], ids, [[i] for i in ids], skip)
    check_stream(sp_tokenizer, [], ids, chunked(ids, [2, 3]), skip)


def test_sentencepiece_continuation_keeps_space(sp_tokenizer):
    # decode(output_ids) alone would drop the space before "Paris"; a continuation keeps it.
    prompt_ids = sp_tokenizer.encode("The capital of France is", add_special_tokens=False)
    output_ids = sp_tokenizer.encode("Paris.", add_special_tokens=False)
    assert sp_tokenizer.decode(output_ids) == "Paris."
    joined = "".join(stream(sp_tokenizer, prompt_ids, [[i] for i in output_ids], skip=True))
    assert joined == " Paris."
    assert detokenize(sp_tokenizer, prompt_ids, output_ids) == " Paris."
    # After a bare BOS there is nothing to continue, so the space goes as in decode().
    assert detokenize(sp_tokenizer, [sp_tokenizer.bos_token_id], output_ids) == "Paris."
