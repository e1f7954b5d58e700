"""Embeddings/s at batch 1, 16 and 64 (issue 35): sluice (`sluice serve MODEL --runner pooling`
measured with `sluice bench --embeddings --batch-size N`) next to sentence-transformers'
`encode` run in-process on the same model, in float32, as ratios from one run.

No real embedding checkpoint is at hand offline, so the model is built here: a random-weight
BERT-base (12 layers, hidden 768, 12 heads, vocab 30522, 512 positions) saved as a
sentence-transformers folder (mean pooling, then Normalize) with a WordPiece tokenizer made
with the `tokenizers` library. Speed does not depend on the weights' values. Inputs are
random sentences over the vocabulary's whole words, 32 to 128 tokens each (with [CLS] and
[SEP]), the same list for both sides.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/embeddings.py [--batch-sizes 1 16 64]
        [--embeddings 128] [--threads N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import torch
import transformers

from shared.transport import free_tcp_port
from tests.servers import Proc, wait_healthy
from tests.tiny_bert import wordpiece_tokenizer
from tests.tiny_embedder import write_sentence_transformers_files

VOCAB = 30522
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 20000  # whole words; the rest of the vocabulary is "##" pieces


def vocabulary() -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    rng = random.Random(0)
    words: set[str] = set()
    while len(words) < WORDS:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 9))))
    pieces: set[str] = set()
    while len(pieces) < VOCAB - WORDS - len(SPECIALS):
        pieces.add("##" + "".join(rng.choice(letters) for _ in range(rng.randint(1, 5))))
    return SPECIALS + sorted(words) + sorted(pieces)


def build_model(path: str) -> list[str]:
    """Writes the BERT-base sentence-transformers folder; returns its whole words."""
    vocab = vocabulary()
    tokenizer = wordpiece_tokenizer(vocab, model_max_length=512)
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB),
                                   add_pooling_layer=False)
    model.eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_sentence_transformers_files(path, 768, "pooling_mode_mean_tokens")
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f)
    return [w for w in vocab if w not in SPECIALS and not w.startswith("##")]


def sentences(words: list[str], count: int) -> list[str]:
    """`count` sentences of 30..126 whole words: 32..128 tokens with [CLS] and [SEP]."""
    rng = random.Random(1)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(30, 126)))
            for _ in range(count)]


def bench_sluice(base_url: str, prompt_file: str, batch: int, total: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--base-url", f"{base_url}/v1", "--embeddings",
         "--batch-size", str(batch), "--concurrency", "1", "--num-requests",
         str(max(1, total // batch)), "--warmup", "1", "--prompt-file", prompt_file, "--json"],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def bench_st(model, texts: list[str], batch: int, total: int) -> float:
    """sentence-transformers' embeddings/s: `total` inputs, `batch` per encode call (one
    warm-up call first), cycled from `texts` as `sluice bench` cycles them."""
    chunks = [[texts[(i * batch + j) % len(texts)] for j in range(batch)]
              for i in range(max(1, total // batch))]
    model.encode(chunks[0], batch_size=batch)
    start = time.perf_counter()
    for chunk in chunks:
        model.encode(chunk, batch_size=batch, convert_to_numpy=True)
    return sum(len(c) for c in chunks) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--embeddings", type=int, default=128,
                   help="timed embeddings per side and batch size (at least one batch)")
    p.add_argument("--threads", type=int, default=None, help="torch threads, both sides")
    p.add_argument("--keep", help="build the model in this folder and keep it")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = args.keep or os.path.join(tmp.name, "bert-base-random")
    os.makedirs(path, exist_ok=True)
    texts = sentences(build_model(path), 256)
    prompt_file = os.path.join(tmp.name, "prompts.txt")
    with open(prompt_file, "w") as f:
        f.write("\n".join(texts) + "\n")
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(path, device="cpu")
    tokens = [len(st_model.tokenizer(t)["input_ids"]) for t in texts]
    port = free_tcp_port()
    base_url = f"http://127.0.0.1:{port}"
    threads = ["--threads", str(args.threads)] if args.threads else []
    # A step holds a whole batch of 64 prompts of up to 128 tokens (pooling never chunks).
    server = Proc(["serve", path, "--port", str(port), "--runner", "pooling", "--device", "cpu",
                   "--dtype", "float32", "--max-model-len", "512",
                   "--max-num-batched-tokens", "8192", "--num-kv-pages", "64", *threads],
                  os.path.join(tmp.name, "serve.log"))
    rows = []
    try:
        wait_healthy(base_url, [server], timeout=600)
        # Both sides compute the same vectors (else the comparison means nothing).
        got = httpx.post(f"{base_url}/v1/embeddings", json={"input": texts[:4]},
                         timeout=600).json()["data"]
        want = st_model.encode(texts[:4], convert_to_numpy=True)
        cosine = min(float(np.dot(g["embedding"], w) / np.linalg.norm(w))
                     for g, w in zip(got, want, strict=True))
        # Each batch size: sluice, then sentence-transformers right after, so that both
        # sides of a ratio see about the same load from the machine's other work.
        for batch in args.batch_sizes:
            s = bench_sluice(base_url, prompt_file, batch, args.embeddings)
            assert s["errors"] == 0, s["error_samples"]
            rows.append((batch, s, bench_st(st_model, texts, batch, args.embeddings)))
    finally:
        server.stop()
    print(f"model: random BERT-base (110M) float32, mean pooling + normalize; inputs "
          f"{min(tokens)}..{max(tokens)} tokens (mean {sum(tokens) / len(tokens):.0f}); "
          f"torch threads {torch.get_num_threads()}; sluice vs ST cosine >= {cosine:.6f}")
    print("| batch | sluice emb/s | sentence-transformers emb/s | sluice / ST | "
          "sluice p50 latency |")
    print("|---:|---:|---:|---:|---:|")
    for batch, s, st in rows:
        print(f"| {batch} | {s['embeddings_per_s']:.1f} | {st:.1f} | "
              f"{s['embeddings_per_s'] / st:.2f}× | {s['latency_p50_ms']:.0f} ms |")
    tmp.cleanup()


if __name__ == "__main__":
    main()
