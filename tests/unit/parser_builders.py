"""What the parser tests share: a text as a model streams it, one token's text at a time."""

from __future__ import annotations

from postproc.detokenizer import IncrementalDetokenizer


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as a model streams it: one token's text at a time (O-2-safe detokenizer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    return pieces
