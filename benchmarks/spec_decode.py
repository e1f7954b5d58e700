"""Speculative decoding (n-gram prompt lookup) side by side with plain decoding (issue 21).

The engine is built in-process on the default model, once; the drafter is switched on and
off between runs of the same requests, so both sides share weights, KV cache and prefix
cache, and the order alternates round by round so drift and the neighbours' noise hit both
alike. A run adds `concurrency` greedy chat requests at once and steps until all finish;
reported: output tokens per second of each side (median over rounds) of wall time and of
this process's CPU time (which a shared machine's neighbours disturb less; run with
--threads 1 for it to mean one core), their ratios, the ratio of the best rounds (bursts on a
shared machine only ever slow a round down), the share of draft tokens accepted, and whether
both sides gave the same tokens.

Workloads: "copy" (answers that copy from the prompt: repeat a paragraph with one word
changed, rename a variable in code, summarise with quotes, fix a typo) and "chat" (the
mixed prompts of `sluice bench`).

    .venv/bin/python benchmarks/spec_decode.py [--concurrency 1 4 16] [--rounds 3]
        [--max-tokens 192] [--spec '{"method": "ngram", ...}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.process.build import build_engine
from shared import histograms as h
from shared.config import EngineConfig
from shared.model_source import default_model_path, served_model_name
from shared.protocol import EngineRequest, SamplingParams, pack_ids, unpack_ids
from shared.speculative import parse_speculative_config
from shared.tokenizer import load_tokenizer
from sluice.bench.chat import _PASSAGE, BUILTIN_PROMPTS

DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                '"prompt_lookup_min": 2}')
_CODE = '''def running_mean(values):
    total = 0.0
    means = []
    for i, value in enumerate(values):
        total += value
        means.append(total / (i + 1))
    return means


def normalise(values):
    total = sum(values)
    if total == 0:
        return [0.0 for _ in values]
    return [value / total for value in values]
'''
COPY_PROMPTS = (
    "Repeat the following paragraph word for word, but replace the word 'mill' with "
    f"'factory':\n\n{_PASSAGE}",
    "Rename the variable `total` to `acc` in this Python code and print the whole code "
    f"again:\n\n```python\n{_CODE}```",
    "Summarise this passage in a few sentences, quoting its exact words as much as you "
    f"can:\n\n{_PASSAGE}",
    "Correct the spelling mistake ('gaet' should be 'gate') and output the full text "
    "unchanged otherwise:\n\n" + _PASSAGE.replace("upper gate", "upper gaet"),
)
WORKLOADS = {"copy": COPY_PROMPTS, "chat": BUILTIN_PROMPTS["mixed"]}


def one_run(core, prompts: list[list[int]], max_tokens: int, tag: str):
    """(output tokens per second of wall time, per second of this process's CPU time,
    {request: tokens}) of these requests run together."""
    start, cpu = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        core.add(EngineRequest(f"{tag}-{i}", pack_ids(ids), params, "inproc://bench",
                               time.time()))
    tokens: dict[str, list[int]] = {}
    while core.has_work:
        for _, out in core.step():
            tokens.setdefault(out.request_id.split("-", 1)[1], []).extend(
                unpack_ids(out.new_token_ids).tolist())
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(map(len, tokens.values()))
    return produced / elapsed, produced / cpu, tokens


def _accepted(drafter) -> tuple[float, float]:
    hists = drafter.histograms
    return hists[h.SPEC_DRAFT_TOKENS].total, hists[h.SPEC_ACCEPTED_TOKENS].total


def bench(core, drafter, prompts, concurrency: int, rounds: int, max_tokens: int) -> dict:
    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
    rates = {"plain": ([], []), "spec": ([], [])}  # side -> (wall rates, CPU rates)
    same = True
    core.scheduler.drafter = None
    one_run(core, batch, 1, "prefill")  # both sides then find the prompts in the prefix cache
    drafted0, accepted0 = _accepted(drafter)
    for r in range(rounds):
        order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
        outputs = {}
        for side in order:
            core.scheduler.drafter = drafter if side == "spec" else None
            wall, cpu, outputs[side] = one_run(core, batch, max_tokens, f"{side}{r}")
            rates[side][0].append(wall)
            rates[side][1].append(cpu)
        same &= outputs["plain"] == outputs["spec"]
    core.scheduler.drafter = None
    drafted, accepted = (b - a for a, b in zip((drafted0, accepted0), _accepted(drafter),
                                               strict=True))
    med = {side: [statistics.median(xs) for xs in pair] for side, pair in rates.items()}
    return {"concurrency": concurrency,
            "plain_tok_s": round(med["plain"][0], 1), "spec_tok_s": round(med["spec"][0], 1),
            "ratio": round(med["spec"][0] / med["plain"][0], 3),
            # Tokens per CPU second: what a shared machine's neighbours disturb least.
            "plain_tok_cpu_s": round(med["plain"][1], 1),
            "spec_tok_cpu_s": round(med["spec"][1], 1),
            "cpu_ratio": round(med["spec"][1] / med["plain"][1], 3),
            # Best round against best round: a neighbour's burst only ever slows a round.
            "best_ratio": round(max(rates["spec"][0]) / max(rates["plain"][0]), 3),
            "accepted_share": round(accepted / max(drafted, 1), 3),
            "draft_tokens": int(drafted), "same_tokens": same,
            "plain_rounds": [round(x, 1) for x in rates["plain"][0]],
            "spec_rounds": [round(x, 1) for x in rates["spec"][0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config JSON")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = default_model_path()
    config = EngineConfig(model=model, served_model_name=served_model_name(model),
                          request_address="inproc://unused", threads=args.threads,
                          kv_cache_memory_gb=0.5, max_model_len=2048,
                          speculative=parse_speculative_config(args.spec))
    core = build_engine(config)
    drafter = core.scheduler.drafter
    tokenizer = load_tokenizer(model)

    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)

    one_run(core, [chat("Say hello.")], 8, "warm")  # first-use costs out of the way
    results = {"spec": args.spec, "max_tokens": args.max_tokens, "rounds": args.rounds}
    for name in args.workloads:
        prompts = [chat(p) for p in WORKLOADS[name]]
        results[name] = [bench(core, drafter, prompts, c, args.rounds, args.max_tokens)
                         for c in args.concurrency]
        print(json.dumps({name: results[name]}), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
