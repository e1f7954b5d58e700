"""What a checkpoint says about pooling, read the same way by the engine and the frontend.

- The runner (vLLM's --runner): "generate" or "pooling". `auto` picks pooling for a
  checkpoint whose config.json architecture is a bare encoder/decoder (`*Model`,
  `*EmbeddingModel`) or a classifier (`*ForSequenceClassification`), as vLLM's suffix rule
  does; a `*ForCausalLM` embedding model (Qwen3-Embedding) needs `--runner pooling`.
- The pooler: how hidden states become one vector. From `--pooler-config` (JSON, vLLM's
  keys), else the checkpoint's sentence-transformers files (`modules.json` naming a Pooling
  module's folder with its `config.json`, and a Normalize module), else the default: the last
  token, normalized (vLLM's default for decoder embedding models).
- Matryoshka: config.json's `matryoshka_dimensions` (the sizes it was trained for) or
  `is_matryoshka`; only such a model takes a request's `dimensions`.
"""

from __future__ import annotations

import json
import os

import msgspec

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's --task values that mean a pooling runner (the rest mean generation).
POOLING_TASKS = ("embed", "embedding", "pooling")
GENERATE_TASKS = ("auto", "generate")
_POOLING_SUFFIXES = ("Model", "EmbeddingModel", "ForSequenceClassification")


class PoolerConfig(msgspec.Struct, frozen=True):
    pooling_type: str = "LAST"  # a POOLING_TYPES value
    normalize: bool = True


class PoolingFacts(msgspec.Struct, frozen=True):
    """Everything a server needs to know about a pooling checkpoint."""

    pooler: PoolerConfig
    tasks: tuple[str, ...] = ("embed",)  # ("classify", "score") for a cross-encoder
    labels: list[str] = []  # a cross-encoder's class names, by index
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None  # None: any size up to the hidden size


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _architectures(model_path: str) -> list[str]:
    config = _read_json(os.path.join(model_path, "config.json"))
    if not isinstance(config, dict):
        return []
    archs = config.get("architectures") or []
    return [a for a in archs if isinstance(a, str)]


def resolve_runner(model_path: str, runner: str = "auto") -> str:
    """"generate" or "pooling" for this checkpoint and flag."""
    if runner != "auto":
        return runner
    if model_path.endswith(".gguf") or not os.path.isdir(model_path):
        return "generate"
    archs = _architectures(model_path)
    if archs and all(a.endswith(_POOLING_SUFFIXES) and not a.endswith("ForCausalLM")
                     for a in archs):
        return "pooling"
    return "generate"


def parse_pooler_config(text: str) -> PoolerConfig:
    """--pooler-config's JSON ({"pooling_type": "MEAN", "normalize": false}); ValueError with
    what is wrong."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--pooler-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--pooler-config must be a JSON object")
    kind = raw.get("pooling_type", raw.get("seq_pooling_type", "LAST"))
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise ValueError(f"--pooler-config pooling_type must be one of {list(POOLING_TYPES)}")
    normalize = raw.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError("--pooler-config normalize must be true or false")
    unknown = set(raw) - {"pooling_type", "seq_pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"--pooler-config has unknown keys {sorted(unknown)}")
    return PoolerConfig(kind.upper(), normalize)


def _sentence_transformers_pooler(model_path: str) -> PoolerConfig | None:
    modules = _read_json(os.path.join(model_path, "modules.json"))
    if not isinstance(modules, list):
        return None
    kind, normalize = None, False
    for module in modules:
        if not isinstance(module, dict):
            continue
        mtype = str(module.get("type", ""))
        if mtype.endswith("Pooling"):
            pooling = _read_json(os.path.join(model_path, str(module.get("path", "")),
                                              "config.json"))
            if isinstance(pooling, dict):
                kind = _st_pooling_type(pooling)
        elif mtype.endswith("Normalize"):
            normalize = True
    if kind is None:
        return None
    return PoolerConfig(kind, normalize)


def _st_pooling_type(pooling: dict) -> str | None:
    if pooling.get("pooling_mode_cls_token"):
        return "CLS"
    if pooling.get("pooling_mode_lasttoken"):
        return "LAST"
    if pooling.get("pooling_mode_mean_tokens"):
        return "MEAN"
    return None  # max / weighted mean: not served


def default_pooler(model_path: str) -> PoolerConfig:
    """Encoders (BERT and kin) pool their CLS token; decoders their last one (vLLM)."""
    archs = _architectures(model_path)
    if any(a.startswith(("Bert", "Roberta", "XLMRoberta")) for a in archs):
        return PoolerConfig("CLS", True)
    return PoolerConfig("LAST", True)


def pooling_facts(model_path: str, pooler_config: str | None = None) -> PoolingFacts:
    if pooler_config is not None:
        pooler = parse_pooler_config(pooler_config)
    else:
        pooler = _sentence_transformers_pooler(model_path) or default_pooler(model_path)
    config = _read_json(os.path.join(model_path, "config.json"))
    config = config if isinstance(config, dict) else {}
    dims = config.get("matryoshka_dimensions")
    if not (isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims)):
        dims = None
    matryoshka = dims is not None or config.get("is_matryoshka") is True
    archs = _architectures(model_path)
    if any(a.endswith("ForSequenceClassification") for a in archs):
        # The head reads the CLS row (its pooler), whatever the embedding pooler says.
        id2label = config.get("id2label") or {}
        labels = [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(len(id2label))]
        return PoolingFacts(PoolerConfig("CLS", False), ("classify", "score"), labels)
    return PoolingFacts(pooler, ("embed",), [], matryoshka, dims)
