"""What one grammar-constrained request costs the batch it runs in (issue 6).

The engine is built in-process on the default model. A batch of B requests decodes for a
fixed number of steps, alternately with all B unconstrained ("plain") and with one of them
constrained by a JSON schema ("mixed"), several rounds in the same run, so drift and the
neighbours' noise hit both sides alike. Reported: decode tokens per second of each (median
over rounds), and the per-step cost of the constrained row's mask: filling its bitmask
(llguidance) and applying it to the logits, timed around GrammarBackend's own methods.

    .venv/bin/python benchmarks/grammar_overhead.py [--batch 8] [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llguidance import LLMatcher

from engine.process.build import build_engine
from engine.request.grammar import GrammarBackend
from shared.config import EngineConfig
from shared.model_source import default_model_path, served_model_name
from shared.protocol import Constraint, EngineRequest, SamplingParams, pack_ids
from shared.tokenizer import load_tokenizer, tokenizer_facts

PROMPT = list(range(1000, 1032))  # 32 arbitrary tokens; decode speed does not care
# Long and never complete within the steps: the constrained row decodes for the whole run.
SCHEMA = {"type": "array", "minItems": 200, "maxItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 16}},
    "required": ["id", "name"]}}


class Clock:
    def __init__(self) -> None:
        self.fill: list[float] = []
        self.apply: list[float] = []

    def wrap(self, backend: GrammarBackend) -> None:
        fill, apply = backend.fill_masks, backend.apply_masks

        def timed_fill(grammars):
            t = time.perf_counter()
            out = fill(grammars)
            self.fill.append(time.perf_counter() - t)
            return out

        def timed_apply(logits, masks):
            t = time.perf_counter()
            apply(logits, masks)
            self.apply.append(time.perf_counter() - t)

        backend.fill_masks, backend.apply_masks = timed_fill, timed_apply


def one_round(core, batch: int, steps: int, constrained: bool, tag: str) -> float:
    """Decode tokens per second of `batch` requests over `steps` steps after prefill."""
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA) if constrained else None
    for i in range(batch):
        constraint = Constraint("json_schema", grammar) if constrained and i == 0 else None
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=1.0, seed=i,
                                constraint=constraint)
        core.add(EngineRequest(f"{tag}-{i}", pack_ids(PROMPT), params, "bench", time.time()))
    while any(s.num_output_tokens == 0 for s in core.sequences.values()):
        core.step()  # prefill (and the grammar compile) is not what we measure
    start, produced = time.perf_counter(), 0
    for _ in range(steps):
        produced += sum(1 for _, out in core.step() if out.new_token_ids)
    elapsed = time.perf_counter() - start
    core.abort(list(core.sequences))
    core.step()
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = default_model_path()
    config = EngineConfig(model=model, served_model_name=served_model_name(model),
                          request_address="inproc://unused", threads=args.threads,
                          max_num_seqs=args.batch, max_model_len=len(PROMPT) + args.steps + 64)
    core = build_engine(config)
    if core.grammar is None:  # build_engine may not wire it yet
        tokenizer = load_tokenizer(model)
        facts = tokenizer_facts(tokenizer, model)
        core.grammar = GrammarBackend(tokenizer, core.vocab_size, facts.eos_token_ids)
    clock = Clock()
    clock.wrap(core.grammar)
    one_round(core, args.batch, 4, True, "warm")  # first-use costs out of the way
    clock.fill.clear(), clock.apply.clear()
    plain, mixed = [], []
    for r in range(args.rounds):
        plain.append(one_round(core, args.batch, args.steps, False, f"p{r}"))
        mixed.append(one_round(core, args.batch, args.steps, True, f"m{r}"))
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(json.dumps({
        "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
        "plain_tok_s": round(statistics.median(plain), 1),
        "mixed_tok_s": round(statistics.median(mixed), 1),
        "plain_rounds": [round(x, 1) for x in plain],
        "mixed_rounds": [round(x, 1) for x in mixed],
        "mask_fill_ms_median": round(ms(clock.fill), 3),
        "mask_apply_ms_median": round(ms(clock.apply), 3),
        "mask_fill_ms_p90": round(1000 * sorted(clock.fill)[int(0.9 * len(clock.fill))], 3),
        "mask_steps": len(clock.fill),
    }, indent=1))


if __name__ == "__main__":
    main()
