"""Loads the model's tokenizer (fast, cached for GGUF) and the facts about it we compute once."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

import msgspec

from shared.model_source import is_gguf, read_gguf_scalars, resolve_model_path
from shared.tokenizer_modes import (
    MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS,
    TokenizerModeError,
    custom_tokenizer_class,
    resolve_tokenizer_mode,
)

log = logging.getLogger(__name__)

# Bump when the cached layout or conversion changes, so old caches are ignored.
_CACHE_FORMAT = "1"


def load_tokenizer(model_path: str, mode: str = "auto", config=None, model: str | None = None):
    """A transformers fast tokenizer for a .gguf file or an HF folder, loaded the way
    --tokenizer-mode says (shared.tokenizer_modes). `config`: the model's transformers config
    when the caller has read it already, handed to the tokenizer instead of a second read
    (which could also see a cache being rewritten in between). `model`: the model folder a
    `custom` tokenizer loads from (model_path is then the registered name)."""
    if mode == "custom":
        return _fast_only(_load_custom(model_path, model), model_path)
    path = resolve_model_path(model_path)
    if is_gguf(path):
        if mode not in ("auto", "hf", "slow"):
            raise TokenizerModeError(f"--tokenizer-mode {mode}: a .gguf file carries an HF "
                                     "tokenizer; use auto or hf")
        return _fast_only(_load_gguf_tokenizer(path), path)
    mode = resolve_tokenizer_mode(path, mode)
    if mode == "mistral":
        from shared.mistral_tokenizer import load_mistral_tokenizer

        return load_mistral_tokenizer(path)
    if mode == "slow":
        log.warning("--tokenizer-mode slow: transformers 5 only has fast tokenizers; loading "
                    "the fast one (as hf does)")
    return _fast_only(_load_folder_tokenizer(path, config), path)


def _fast_only(tokenizer, path: str):
    if not getattr(tokenizer, "is_fast", False):
        # The detokenizer and the facts drive the Rust backend directly.
        raise TypeError(f"{path}: no fast (tokenizers-backed) tokenizer is available")
    return tokenizer


def _read_config(path: str):
    """The model's config.json, read once: (a transformers config or None, its model_type).
    The same read gives both, and the config goes to AutoTokenizer, which would otherwise
    read the file again. A type transformers lacks (remote code: internlm2) keeps its name."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None, None
    with open(file, "rb") as f:
        raw = msgspec.json.decode(f.read())
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None, model_type
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw), model_type
    except (ValueError, TypeError, KeyError) as exc:
        log.debug("%s: config not readable by transformers (%s)", path, exc)
        return None, model_type


def _load_folder_tokenizer(path: str, config=None):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if config is None:
        config, model_type = _read_config(path)
    else:
        model_type = getattr(config, "model_type", None)
    if model_type in MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS:
        return PreTrainedTokenizerFast.from_pretrained(path)
    kwargs = {"config": config} if config is not None else {}
    # hf means the Hugging Face files: transformers 5 would otherwise switch a folder that
    # also holds tekken.json to mistral-common's (slow) backend by itself.
    return AutoTokenizer.from_pretrained(path, mistral_format=False, **kwargs)


def _load_custom(name: str, model: str | None):
    if model is None:
        raise TokenizerModeError("--tokenizer-mode custom needs --model (the files its "
                                 "registered tokenizer loads)")
    return custom_tokenizer_class(name).from_pretrained(resolve_model_path(model))


# ---------------------------------------------------------------------------------------------
# GGUF: transformers rebuilds the vocabulary from the GGUF header on every load (about 10 s),
# so we convert once and keep the result as an ordinary tokenizer folder.


def tokenizer_cache_root() -> str:
    root = os.environ.get("SLUICE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "sluice")
    return os.path.join(root, "tokenizers")


def gguf_cache_key(gguf_path: str) -> str:
    """Changes whenever the file or the converting libraries change."""
    import tokenizers
    import transformers

    st = os.stat(gguf_path)
    ident = "\0".join(
        [
            _CACHE_FORMAT,
            os.path.abspath(gguf_path),
            str(st.st_size),
            str(st.st_mtime_ns),
            transformers.__version__,
            tokenizers.__version__,
        ]
    )
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _load_gguf_tokenizer(gguf_path: str):
    cache_dir = os.path.join(tokenizer_cache_root(), gguf_cache_key(gguf_path))
    if os.path.isdir(cache_dir):
        try:
            return _load_cached(cache_dir)
        except Exception as exc:  # a damaged cache must not stop the server
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", cache_dir, exc)
            shutil.rmtree(cache_dir, ignore_errors=True)
    tokenizer = _convert_gguf(gguf_path)
    _store_cache(tokenizer, cache_dir)
    return tokenizer


def _load_cached(cache_dir: str):
    # PreTrainedTokenizerFast skips AutoTokenizer's class lookup, halving the load time.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(cache_dir)


def _convert_gguf(gguf_path: str):
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _store_cache(tokenizer, cache_dir: str) -> None:
    """Writes to a private temp folder then renames it into place, so a concurrent reader
    sees either nothing or a complete folder, and the loser of a race just drops its copy."""
    parent = os.path.dirname(cache_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError as exc:
        log.warning("cannot write tokenizer cache under %s: %s", parent, exc)
        return
    try:
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(tmp, cache_dir)
    except OSError as exc:
        if not os.path.isdir(cache_dir):
            log.warning("cannot write tokenizer cache %s: %s", cache_dir, exc)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Facts (req T-11/T-12)


class TokenizerFacts(msgspec.Struct, frozen=True):
    vocab_size: int  # len(tokenizer): base vocabulary plus added tokens
    max_token_id: int  # largest valid id, inclusive: the model may have more rows than tokens
    eos_token_ids: list[int]  # any of these ends generation
    bos_token_id: int | None
    max_chars_per_token: int  # longest single token once decoded, in characters
    special_token_ids: list[int]
    pad_token_id: int | None = None  # what prompt padding appends (req T-7)


class _GenerationConfig(msgspec.Struct):
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None


class _TextConfig(msgspec.Struct):
    vocab_size: int | None = None


class _ModelConfig(msgspec.Struct):
    vocab_size: int | None = None
    text_config: _TextConfig | None = None  # multimodal configs nest the language model's


class _ModelIds(msgspec.Struct, frozen=True):
    """What the model files (not the tokenizer) say about ids."""

    model_vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


def tokenizer_facts(tokenizer, model_path: str) -> TokenizerFacts:
    ids = _model_ids(model_path)
    largest_id = max(tokenizer.get_vocab().values())
    model_max = ids.model_vocab_size - 1 if ids.model_vocab_size else -1
    eos = set(ids.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else ids.bos_token_id
    return TokenizerFacts(
        vocab_size=len(tokenizer),
        max_token_id=max(model_max, largest_id),
        eos_token_ids=sorted(eos),
        bos_token_id=bos,
        max_chars_per_token=_max_chars_per_token(tokenizer, largest_id),
        special_token_ids=_special_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )


def _model_ids(model_path: str) -> _ModelIds:
    path = resolve_model_path(model_path)
    return _gguf_model_ids(path) if is_gguf(path) else _folder_model_ids(path)


def _gguf_model_ids(gguf_path: str) -> _ModelIds:
    scalars, arrays = read_gguf_scalars(gguf_path)
    arch = scalars.get("general.architecture")
    vocab = scalars.get(f"{arch}.vocab_size") or arrays.get("tokenizer.ggml.tokens")
    eos = scalars.get("tokenizer.ggml.eos_token_id")
    return _ModelIds(
        model_vocab_size=vocab,
        eos_token_ids=() if eos is None else (eos,),
        bos_token_id=scalars.get("tokenizer.ggml.bos_token_id"),
    )


def _folder_model_ids(folder: str) -> _ModelIds:
    gen = _read_json(os.path.join(folder, "generation_config.json"), _GenerationConfig)
    cfg = _read_json(os.path.join(folder, "config.json"), _ModelConfig)
    vocab = cfg.vocab_size or (cfg.text_config.vocab_size if cfg.text_config else None)
    eos = gen.eos_token_id
    return _ModelIds(
        model_vocab_size=vocab,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        bos_token_id=gen.bos_token_id,
    )


def _read_json(path: str, kind: type):
    if not os.path.isfile(path):
        return kind()
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=kind)


def _max_chars_per_token(tokenizer, largest_id: int) -> int:
    # Decode each token after an anchor token: alone, a SentencePiece-style decoder strips the
    # token's leading space, which it keeps mid-text, so alone would undercount.
    backend = tokenizer.backend_tokenizer
    anchor = backend.encode("a", add_special_tokens=False).ids[-1]
    base = len(backend.decode([anchor], skip_special_tokens=False))
    pairs = [[anchor, i] for i in range(largest_id + 1)]
    texts = backend.decode_batch(pairs, skip_special_tokens=False)
    return max(len(t) for t in texts) - base


def _special_token_ids(tokenizer) -> list[int]:
    # all_special_ids only covers the named roles (bos/eos/unk/pad...); the backend also
    # treats every added token marked special as special, e.g. SmolLM2's <file_sep>.
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# Fingerprint (tiers agree on the tokenizer)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what decides ids: the backend tokenizer's whole pipeline (normalizer,
    pre-tokenizer, vocabulary and merges, added and special tokens, post-processor), less
    the per-call truncation and padding a copy may have set. The engine reports it with its
    stats and each frontend computes it the same way (this function), so a frontend can
    refuse an engine whose ids mean other tokens."""
    import json

    raw = json.loads(tokenizer.backend_tokenizer.to_str())
    raw.pop("truncation", None)
    raw.pop("padding", None)
    payload = json.dumps(raw, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
