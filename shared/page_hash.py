"""The prefix cache's page hashes, which the engine keys its cache by and a frontend under
`--routing kv` recomputes for a prompt, so both must come from this one place.

Every full page's hash is chained over all tokens before it and rooted at the request's
cache_salt and LoRA adapter (`engine.step.kv_cache` says why). `external_hash` is the int a
KV event carries for a page, vLLM's form: the digest's last 8 bytes, big-endian, unsigned.
"""

from __future__ import annotations

import hashlib

import numpy as np

PageHash = bytes


def root_hash(cache_salt: str | None, lora_id: int = 0) -> PageHash:
    """The root of a sequence's chain: its salt and, under a LoRA adapter, the adapter's
    engine-unique id (two adapters compute different K/V for the same tokens)."""
    salt = (cache_salt or "").encode()
    if lora_id:
        salt += b"\0lora:%d" % lora_id
    return hashlib.blake2b(salt, digest_size=16, person=b"sluice-root").digest()


def chain_hash(parent: PageHash, tokens) -> PageHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


def external_hash(page_hash: PageHash) -> int:
    return int.from_bytes(page_hash[-8:], "big")


def prompt_page_hashes(token_ids, page_size: int, cache_salt: str | None):
    """The external hashes of a base-model, text-only prompt's full pages, lazily, in order
    (a caller looking for the longest cached run stops at the first miss)."""
    parent = root_hash(cache_salt)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = chain_hash(parent, token_ids[start:start + page_size])
        yield external_hash(parent)
