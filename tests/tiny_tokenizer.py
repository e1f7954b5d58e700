"""A word-level tokenizer that adds BOS, as Llama-style tokenizers do (SmolLM2's adds none)."""

from __future__ import annotations

WORDS = ["<s>", "</s>", "<pad>", "<unk>", "[", "]", "system", "user", "assistant", "hello",
         "world", "hi", "there"]
BOS_ID = 0
MAX_CHARS_PER_TOKEN = max(len(w) for w in WORDS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[ {{ m.role }} ] {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}[ assistant ] {% endif %}"
)


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_ID)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.chat_template = chat_template
    return tok
