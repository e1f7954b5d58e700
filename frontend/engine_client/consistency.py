"""Tiers agree on the model and the tokenizer: a frontend renders and tokenizes prompts
itself and the engine only sees ids, so an engine that serves another model, or loaded
another tokenizer, would answer every request with the wrong tokens, silently. Its
heartbeat says what it serves (EngineStats.model_name, .tokenizer_fingerprint); a frontend
that renders for something else refuses it: no requests go there, one log line says why,
and /health is a 503 carrying the same reason."""

from __future__ import annotations

import msgspec

from shared.protocol import EngineStats


class ServedIdentity(msgspec.Struct, frozen=True):
    """What this frontend renders for."""

    model_name: str  # --served-model-name's first name, as engines report theirs
    tokenizer_fingerprint: str  # shared.tokenizer.tokenizer_fingerprint of its tokenizer


def mismatch(identity: ServedIdentity | None, stats: EngineStats) -> str | None:
    """Why this frontend cannot use the engine that sent `stats`; None: it can."""
    if identity is None:
        return None
    if stats.model_name != identity.model_name:
        return (f"engine {stats.engine_id} serves the model {stats.model_name!r}, but this "
                f"frontend renders for {identity.model_name!r}; start both with the same "
                "--model and --served-model-name")
    theirs = stats.tokenizer_fingerprint
    if theirs and theirs != identity.tokenizer_fingerprint:
        return (f"engine {stats.engine_id} loaded another tokenizer (fingerprint {theirs}, "
                f"this frontend's is {identity.tokenizer_fingerprint}): its token ids would "
                "mean other tokens; start both with the same --tokenizer and --tokenizer-mode")
    return None
