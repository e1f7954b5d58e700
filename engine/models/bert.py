"""The encoder family: BERT, RoBERTa and XLM-RoBERTa (served by the pooling runner only).

Post-LayerNorm blocks with bidirectional attention: every token of a prompt attends to every
other token of the same prompt, so the whole prompt runs in one step (the scheduler never
splits a pooling request) and nothing goes through the paged KV cache. Inputs are the sum of
the word, absolute position and token-type embeddings; RoBERTa's positions start after its
padding index (`pad_token_id + 1`). Prompts are single segments (token type 0).

Checkpoints name tensors as BertModel does (`embeddings.*`, `encoder.layer.N.*`); a task
model's `bert.` / `roberta.` prefix is dropped and its head and pooler layer are not read.
"""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F

from engine.layers.config import ModelConfig, require

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class BertOptions(msgspec.Struct, frozen=True):
    type_vocab_size: int = 2
    position_offset: int = 0  # RoBERTa: pad_token_id + 1
    gelu_approximate: str = "none"  # torch's F.gelu `approximate`
    # A cross-encoder (*ForSequenceClassification): its labels; 0: a plain encoder.
    num_labels: int = 0


class _BertHF(msgspec.Struct):
    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    position_embedding_type: str = "absolute"
    architectures: list[str] = []
    id2label: dict[str, str] | None = None
    num_labels: int | None = None


def read_bert_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_BertHF)
    require(hf.hidden_act in _ACTIVATIONS, "hidden_act", f"{hf.hidden_act!r} is not implemented")
    require(hf.position_embedding_type == "absolute", "position_embedding_type",
            "only absolute positions are implemented")
    require(hf.hidden_size % hf.num_attention_heads == 0, "num_attention_heads",
            "must divide hidden_size")
    roberta = hf.model_type in ("roberta", "xlm-roberta")
    offset = (hf.pad_token_id or 0) + 1 if roberta else 0
    classifier = any(a.endswith("ForSequenceClassification") for a in hf.architectures)
    labels = (len(hf.id2label) if hf.id2label else hf.num_labels or 2) if classifier else 0
    return ModelConfig(
        architecture="roberta" if roberta else "bert",
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads, rms_norm_eps=hf.layer_norm_eps,
        rope_theta=0.0, max_position_embeddings=hf.max_position_embeddings - offset,
        tie_word_embeddings=False, attention_bias=True,
        family_options=BertOptions(hf.type_vocab_size, offset, _ACTIVATIONS[hf.hidden_act],
                                   labels),
    )


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.intermediate_size
    options = config.family_options
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (
            config.max_position_embeddings + options.position_offset, h),
        "embeddings.token_type_embeddings.weight": (options.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    layer = {
        "attention.self.query.weight": (h, h), "attention.self.query.bias": (h,),
        "attention.self.key.weight": (h, h), "attention.self.key.bias": (h,),
        "attention.self.value.weight": (h, h), "attention.self.value.bias": (h,),
        "attention.output.dense.weight": (h, h), "attention.output.dense.bias": (h,),
        "attention.output.LayerNorm.weight": (h,), "attention.output.LayerNorm.bias": (h,),
        "intermediate.dense.weight": (i, h), "intermediate.dense.bias": (i,),
        "output.dense.weight": (h, i), "output.dense.bias": (h,),
        "output.LayerNorm.weight": (h,), "output.LayerNorm.bias": (h,),
    }
    for n in range(config.num_layers):
        shapes.update({f"encoder.layer.{n}.{k}": v for k, v in layer.items()})
    labels = options.num_labels
    if labels and config.architecture == "bert":  # pooler (dense + tanh on CLS), classifier
        shapes.update({"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,),
                       "classifier.weight": (labels, h), "classifier.bias": (labels,)})
    elif labels:  # RoBERTa's head: dense + tanh, then out_proj
        shapes.update({"classifier.dense.weight": (h, h), "classifier.dense.bias": (h,),
                       "classifier.out_proj.weight": (labels, h),
                       "classifier.out_proj.bias": (labels,)})
    return shapes


def checkpoint_names(config: ModelConfig):
    """Stored tensor name -> its name here, or None for one the model does not use."""
    expected = tensor_shapes(config)

    def rename(name: str) -> str | None:
        for prefix in ("bert.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        return name if name in expected else None  # a pooler an embedder skips, buffers

    return rename


class BertModel:
    """Runs prompts whole: `encode` takes every prompt of the step, back to back."""

    bidirectional = True  # the runner calls `encode`, not the paged `forward`

    def __init__(self, config: ModelConfig, weights, max_positions, dtype, device, ops=None,
                 quantized=None) -> None:
        self.config = config
        self.options = config.family_options
        self.device = device
        self.dtype = dtype
        self.ops = ops
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                            self.config.rms_norm_eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int],
               token_types: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of prompts laid back to back (`lengths` each)."""
        c, w = self.config, self.w
        if token_types is None:
            token_types = torch.zeros_like(input_ids)
        h = (F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
             + F.embedding(positions + self.options.position_offset,
                           w["embeddings.position_embeddings.weight"])
             + F.embedding(token_types, w["embeddings.token_type_embeddings.weight"]))
        h = self._norm(h, "embeddings.LayerNorm")
        for n in range(c.num_layers):
            p = f"encoder.layer.{n}."
            q, k, v = (self._linear(h, p + f"attention.self.{x}")
                       .view(-1, c.num_heads, c.head_dim).transpose(0, 1)
                       for x in ("query", "key", "value"))
            o = _each_prompt_attends_itself(q, k, v, lengths)
            o = o.transpose(0, 1).reshape(-1, c.hidden_size)
            h = self._norm(h + self._linear(o, p + "attention.output.dense"),
                           p + "attention.output.LayerNorm")
            up = F.gelu(self._linear(h, p + "intermediate.dense"),
                        approximate=self.options.gelu_approximate)
            h = self._norm(h + self._linear(up, p + "output.dense"), p + "output.LayerNorm")
        return h

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's float32 logits [n, labels] from its prompts' CLS rows."""
        if self.config.architecture == "bert":
            pooled = torch.tanh(self._linear(cls_rows, "pooler.dense"))
            return self._linear(pooled, "classifier").float()
        pooled = torch.tanh(self._linear(cls_rows, "classifier.dense"))
        return self._linear(pooled, "classifier.out_proj").float()

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # every block ends in its LayerNorm already

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: it serves pooling only")


def _each_prompt_attends_itself(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each prompt of the step ([heads, T, head_dim] each):
    one product per prompt, so the cost is the sum of the prompts' squares, not the square of
    the step's tokens (a block-diagonal mask over the step: 64 prompts of 80 tokens cost 64
    times the work)."""
    if len(lengths) == 1:
        return F.scaled_dot_product_attention(q, k, v)
    return torch.cat([F.scaled_dot_product_attention(qi, ki, vi) for qi, ki, vi in
                      zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1),
                          strict=True)], dim=1)
