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
- `--hf-overrides` (vLLM's flag; only the keys that make a decoder a yes/no reranker, as
  Qwen3-Reranker is served): the checkpoint's `*ForCausalLM` is read as a
  `*ForSequenceClassification` whose one label's logit is logit("yes") - logit("no") at the
  last token, so its score, the sigmoid of that, is the softmax of P("yes") over the two.
"""

from __future__ import annotations

import json
import os

import msgspec

from shared.json_flags import json_object

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
    # A decoder reranker (--hf-overrides): the tokens [false, true] whose LM-head rows make
    # its one-label head; [] for every other model.
    score_tokens: list[str] = []


class HfOverrides(msgspec.Struct, frozen=True):
    """The --hf-overrides keys sluice takes: those of vLLM's Qwen3-Reranker recipe."""

    architectures: list[str]
    classifier_from_token: list[str]
    is_original_qwen3_reranker: bool


_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


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


def parse_hf_overrides(text: str) -> HfOverrides:
    """--hf-overrides' JSON; ValueError saying what is wrong. Only vLLM's yes/no reranker
    recipe is taken: {"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}."""
    raw = json_object(text, "--hf-overrides")
    unknown = sorted(set(raw) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"--hf-overrides keys {unknown} are not supported; sluice takes only "
                         f"{list(_OVERRIDE_KEYS)} (a decoder served as a yes/no reranker)")
    missing = [k for k in _OVERRIDE_KEYS if k not in raw]
    if missing:
        raise ValueError(f"--hf-overrides needs {missing} too (all of {list(_OVERRIDE_KEYS)})")
    archs = raw["architectures"]
    if (not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str)
            or not archs[0].endswith("ForSequenceClassification")):
        raise ValueError("--hf-overrides architectures must be one *ForSequenceClassification "
                         'name, e.g. ["Qwen3ForSequenceClassification"]')
    tokens = raw["classifier_from_token"]
    if (not isinstance(tokens, list) or len(tokens) != 2
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ValueError('--hf-overrides classifier_from_token must be two tokens, false one '
                         'first: ["no", "yes"]')
    if raw["is_original_qwen3_reranker"] is not True:
        raise ValueError("--hf-overrides is_original_qwen3_reranker must be true (the two "
                         "tokens' logits make the score)")
    return HfOverrides(archs, tokens, True)


def resolve_runner(model_path: str, runner: str = "auto", hf_overrides: str | None = None
                   ) -> str:
    """"generate" or "pooling" for this checkpoint and flags."""
    if runner != "auto":
        return runner
    if hf_overrides is not None:  # it names a *ForSequenceClassification
        return "pooling"
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
    raw = json_object(text, "--pooler-config")
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


def pooling_facts(model_path: str, pooler_config: str | None = None,
                  hf_overrides: str | None = None) -> PoolingFacts:
    if hf_overrides is not None:  # a decoder reranker: its last token, one label
        tokens = parse_hf_overrides(hf_overrides).classifier_from_token
        return PoolingFacts(PoolerConfig("LAST", False), ("classify", "score"), ["LABEL_0"],
                            score_tokens=tokens)
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


def encoder_lower_case(model_path: str) -> bool:
    """sentence-transformers' `do_lower_case` (sentence_bert_config.json): the encoder was
    trained on lowercased text, whatever its tokenizer does (vLLM's encoder_config)."""
    config = _read_json(os.path.join(model_path, "sentence_bert_config.json"))
    return isinstance(config, dict) and config.get("do_lower_case") is True
