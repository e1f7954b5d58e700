"""--tokenizer-mode mistral: mistral-common's tokenizer for a Mistral-format folder.

Two views of one vocabulary. mistral-common's `MistralTokenizer` renders chat requests
straight to tokens (`encode_chat_completion`), as Mistral's models were trained; the rest of
sluice (facts, detokenizer, grammars, completions) drives a fast `tokenizers` tokenizer,
which transformers builds from the same tekken.json. That one is set up to tokenize as
mistral-common does: BOS first when special tokens are asked for, and control-token text in
a prompt (a literal "[INST]") stays text, never a control token.
"""

from __future__ import annotations

import copy
import os

from transformers import TokenizersBackend

from shared.tokenizer_modes import TokenizerModeError, mistral_vocab_file


class MistralFastTokenizer(TokenizersBackend):
    """The fast view. Its copies (one per worker thread) keep encoding control-token text
    as text: `tokenizers` does not carry that setting through a copy."""

    def __deepcopy__(self, memo):
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone.backend_tokenizer.encode_special_tokens = True
        return clone


class MistralChat:
    """mistral-common's tokenizer, attached to the fast one as `.mistral`. Tokenizer copies
    (one per worker thread) share it: its tiktoken core is thread-safe and immutable."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # mistral_common...MistralTokenizer

    def __deepcopy__(self, memo):
        return self

    def encode_chat(self, messages: list[dict], tools: list[dict] | None,
                    continue_final_message: bool) -> tuple[list[int], str]:
        """The prompt's tokens and their text (control tokens spelled out)."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        request = ChatCompletionRequest.from_openai(
            messages, tools=tools or None, continue_final_message=continue_final_message)
        out = self.tokenizer.encode_chat_completion(request)
        return list(out.tokens), out.text or ""


def load_mistral_tokenizer(folder: str):
    """The fast tokenizer with `.mistral` (a MistralChat) attached."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    vocab = mistral_vocab_file(folder)
    mistral = MistralTokenizer.from_file(vocab)
    fast = _fast_view(folder, vocab)
    _tokenize_as_mistral(fast, mistral.instruct_tokenizer.tokenizer.bos_id)
    fast.mistral = MistralChat(mistral)
    return fast


def _fast_view(folder: str, vocab: str):
    if os.path.basename(vocab) == "tekken.json":
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        fast = convert_tekken_tokenizer(vocab)
        fast.__class__ = MistralFastTokenizer  # a subclass adding only __deepcopy__
        return fast
    # A SentencePiece tokenizer.model.v*: Mistral's HF repositories ship tokenizer.json too.
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise TokenizerModeError(f"--tokenizer-mode mistral: {vocab} is a SentencePiece "
                                 "vocabulary and the folder has no tokenizer.json beside it")
    return MistralFastTokenizer.from_pretrained(folder)


def _tokenize_as_mistral(fast, bos_id: int) -> None:
    from tokenizers import processors

    backend = fast.backend_tokenizer
    backend.encode_special_tokens = True  # a prompt's "[INST]" is text (mistral-common's)
    fast.split_special_tokens = True  # the same through transformers' own encode
    bos = backend.id_to_token(bos_id)
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                             special_tokens=[(bos, bos_id)])
    current = backend.post_processor
    backend.post_processor = (template if current is None
                              else processors.Sequence([current, template]))
