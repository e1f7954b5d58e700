"""A tiny random-weight BERT-family checkpoint with a WordPiece tokenizer (built with the
`tokenizers` library), saved as a sentence-transformers model: the encoder family's reference
is sentence-transformers' own `encode` in float32."""

from __future__ import annotations

import json
import os

import torch
import transformers

from tests.tiny_embedder import write_sentence_transformers_files

WORDS = ["hello", "world", "hi", "there", "the", "cat", "sat", "on", "mat", "##s", "##ing",
         "dog", "run", "a", "big", "small", ".", ","]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HIDDEN = 32
# build_bert's pooling -> the sentence-transformers Pooling config key that turns it on.
POOLING_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "lasttoken": "pooling_mode_lasttoken"}


def wordpiece_tokenizer(words: list[str] | None = None, lowercase: bool = True, **options):
    """BERT's WordPiece tokenizer over `words` (default: SPECIALS + WORDS, which must start
    with SPECIALS); `options` go to PreTrainedTokenizerFast (benchmarks/embeddings.py sets
    model_max_length)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(words or SPECIALS + WORDS)}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", **options)


def build_bert(path: str, kind: str = "bert", pooling: str = "mean", seed: int = 5,
               do_lower_case: bool = False):
    """kind: bert | xlm-roberta; pooling: mean | cls | lasttoken. Returns the tokenizer.
    do_lower_case: a cased tokenizer, and sentence-transformers' config asking for lowercase
    input (as uncased models saved that way are)."""
    tokenizer = wordpiece_tokenizer(lowercase=not do_lower_case)
    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, type_vocab_size=2)
    if kind == "bert":
        config = transformers.BertConfig(**common, pad_token_id=0)
        model = transformers.BertModel(config, add_pooling_layer=True)
    else:  # positions start after the padding index, as RoBERTa's do
        config = transformers.XLMRobertaConfig(**common, pad_token_id=1)
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=gen)
                        if param.dim() == 1 else
                        torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_sentence_transformers_files(path, HIDDEN, POOLING_MODES[pooling])
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 60, "do_lower_case": do_lower_case}, f)
    return tokenizer


def build_cross_encoder(path: str, kind: str = "bert", num_labels: int = 1, seed: int = 6):
    """A *ForSequenceClassification checkpoint; returns (tokenizer, the float32 model)."""
    tokenizer = wordpiece_tokenizer()
    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, num_labels=num_labels,
                  id2label={i: f"class_{i}" for i in range(num_labels)},
                  label2id={f"class_{i}": i for i in range(num_labels)})
    if kind == "bert":
        model = transformers.BertForSequenceClassification(
            transformers.BertConfig(**common, type_vocab_size=2, pad_token_id=0))
    else:
        model = transformers.XLMRobertaForSequenceClassification(
            transformers.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=gen)
                        if param.dim() == 1 else
                        torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model = model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return tokenizer, model


def reference_logits(tokenizer, model, a: str, b: str | None = None) -> torch.Tensor:
    enc = tokenizer(a, b, return_tensors="pt", return_token_type_ids=True)
    if model.config.type_vocab_size == 1:
        enc.pop("token_type_ids")
    with torch.no_grad():
        return model(**enc).logits[0]
