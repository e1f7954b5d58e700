"""openai-harmony as a test reference, offline: its o200k vocabulary comes from the bpe-openai
wheel, unzipped into a folder that TIKTOKEN_ENCODINGS_BASE names (nothing is downloaded)."""

from __future__ import annotations

import gzip
import importlib.resources
import os
import shutil


def harmony_encoding(folder) -> tuple:
    """(the openai_harmony module, the gpt-oss encoding); sets TIKTOKEN_ENCODINGS_BASE."""
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, "o200k_base.tiktoken")
    if not os.path.exists(target):
        source = importlib.resources.files("bpe_openai") / "data" / "o200k_base.tiktoken.gz"
        part = f"{target}.{os.getpid()}.part"  # whole or not there, for a parallel run
        with source.open("rb") as raw, gzip.open(raw) as unzipped, open(part, "wb") as out:
            shutil.copyfileobj(unzipped, out)
        os.replace(part, target)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    import openai_harmony as oh

    return oh, oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
