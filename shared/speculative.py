"""`--speculative-config`: vLLM's JSON for speculative decoding, checked at startup.

Only the model-free `ngram` method (prompt lookup) exists here: drafts come from the
sequence's own prompt and output (`engine.step.spec_decode`). The keys and their defaults are
vLLM's: without prompt_lookup_min/max both are 5, with one the other takes its value.
`disable_by_batch_size` is vLLM's key too: with more sequences than this in the engine, no
step drafts (a compute-bound batch gains nothing from them). Left out, it defaults to a
value measured on the CPU engine (docs/benchmarks.md) instead of vLLM's "never".
"""

from __future__ import annotations

import msgspec

FLAG = "--speculative-config"
METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verifying chunk is 1 + k tokens of one step's budget
MAX_LOOKUP = 32  # the longest n-gram matched against the context
DEFAULT_LOOKUP = 5  # vLLM's, when neither bound is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    # vLLM's draft-model key: accepted only to refuse a draft model by name.
    model: str | None = None


class SpeculativeConfigError(ValueError):
    pass


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's JSON, validated, with the defaults filled in; SpeculativeConfigError
    (its message names the flag) when it cannot run."""
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
    except msgspec.DecodeError as exc:
        raise SpeculativeConfigError(f"{FLAG}: not a valid config ({exc})") from None
    return _checked(_with_defaults(config))


def _with_defaults(config: SpeculativeConfig) -> SpeculativeConfig:
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        # Checked as given: a default copied from a bad bound would name the wrong key.
        if value is not None and not 1 <= value <= MAX_LOOKUP:
            raise SpeculativeConfigError(f"{FLAG}: {key} must lie in [1, {MAX_LOOKUP}], "
                                         f"not {value}")
    if low is None and high is None:
        low = high = DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    batch = config.disable_by_batch_size
    return msgspec.structs.replace(
        config, prompt_lookup_min=low, prompt_lookup_max=high,
        disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE if batch is None else batch)


def _checked(config: SpeculativeConfig) -> SpeculativeConfig:
    def fail(why: str):
        raise SpeculativeConfigError(f"{FLAG}: {why}")

    if config.model is not None and config.model not in ("ngram", "[ngram]"):
        fail(f"draft models ({config.model!r}) are not supported; only method 'ngram'")
    if config.method not in METHODS:
        fail(f"unknown method {config.method!r}; sluice has {', '.join(METHODS)}")
    if not 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        fail(f"num_speculative_tokens must lie in [1, {MAX_SPECULATIVE_TOKENS}], "
             f"not {config.num_speculative_tokens}")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        fail(f"prompt_lookup_min ({config.prompt_lookup_min}) is above prompt_lookup_max "
             f"({config.prompt_lookup_max})")
    if config.disable_by_batch_size < 1:
        fail(f"disable_by_batch_size must be at least 1, not {config.disable_by_batch_size}")
    return config
