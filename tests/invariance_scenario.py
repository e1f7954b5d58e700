"""The batch-invariance scenario (issue 20), shared by the CPU test
(tests/integration/test_batch_invariance.py) and the GPU one (tests/gpu): the default model
in an in-process engine that records each sampled row's logits; probe prompts alone, then
inside a batch of 32 mixed requests, then alone again after their prefix is cached."""

from __future__ import annotations

from collections import defaultdict

import torch

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from tests.unit.engine_builders import request, run

BUDGET = 96  # tokens a step: the long probes are prefilled in several chunks
PASSAGE = (
    "The river town grew up around a wooden sluice that diverted water to three mills. "
    "Each spring the snowmelt raised the river, and the miller opened the gates a little "
    "wider; each autumn he closed them again so the mill ponds would not drain. When a "
    "flood tore the upper gate loose, the townspeople argued for a month over whether to "
    "rebuild it in stone or in oak. "
)
QUESTIONS = ["Who won the argument?", "What did the miller do each spring?",
             "Write a short poem about the mills.", "Summarise the story in one sentence."]
FILLER_LENGTHS = [5, 40, 130, 300, 17, 64, 250, 9, 90, 200, 33, 150, 400, 12, 70, 180, 26,
                  110, 350, 8, 45, 220, 60, 140, 15, 280, 75]  # 27 + 5 probes = 32


class RecordingEngine:
    """An engine core whose sampled rows' logits and scheduled chunks are kept per request."""

    def __init__(self, batch_invariant: bool, device: str = "cpu",
                 attention_backend: str = "torch", model: str | None = None,
                 dtype: str = "bfloat16") -> None:
        self.model = model or default_model_path()
        config = EngineConfig(
            model=self.model, served_model_name="m", request_address="inproc://x",
            dtype=dtype, device=device, attention_backend=attention_backend,
            max_num_batched_tokens=BUDGET, max_model_len=2048, kv_cache_memory_gb=0.25,
            num_pages=None if device == "cpu" else 512, batch_invariant=batch_invariant)
        self.core = build_engine(config)
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.first_start: dict[str, int] = {}  # a request's first chunk: > 0 after a cache hit
        self.beside_prefill: set[str] = set()  # sampled in a step with another's prefill
        runner, model = self.core.runner, self.core.runner.model
        sampling: list[str] = []
        model_logits, execute = model.logits, runner.execute

        def logits(hidden):
            out = model_logits(hidden)
            if out.shape[0] == len(sampling):  # the sampled rows, not prompt logprobs
                for request_id, row in zip(sampling, out, strict=True):
                    self.logits[request_id].append(row.clone())
            return out

        def recording_execute(chunks):
            sampling[:] = [c.seq.request_id for c in chunks if c.samples]
            for c in chunks:
                self.first_start.setdefault(c.seq.request_id, c.start)
                if any(o.num_tokens > 1 and o is not c for o in chunks) and c.samples:
                    self.beside_prefill.add(c.seq.request_id)
            return execute(chunks)

        model.logits = logits
        runner.execute = recording_execute


def probes(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(PASSAGE + q) for q in QUESTIONS]


def probe_requests(prompts, tag: str) -> list:
    """The greedy probes and a seeded one. Each has a cache salt of its own, shared only by
    its "cached" twin, which thus finds the "alone" run's pages and nothing else does."""
    salt = "alone" if tag == "cached" else tag
    # ignore_eos: every probe runs its 16 steps, so every step's logits are compared.
    greedy = [request(f"{tag}{i}", p, max_tokens=16, ignore_eos=True, cache_salt=f"{salt}{i}")
              for i, p in enumerate(prompts)]
    seeded = request(f"{tag}seeded", prompts[0], max_tokens=16, ignore_eos=True,
                     temperature=1.0, seed=11, cache_salt=f"{salt}seeded")
    return [*greedy, seeded]


def scenario(engine: RecordingEngine) -> dict[str, dict[str, list]]:
    """The probes' tokens and logits: alone, batched with 27 fillers, alone again (cached)."""
    prompts = probes(load_tokenizer(engine.model))
    gen = torch.Generator().manual_seed(3)
    fillers = [request(f"f{i}", torch.randint(100, 40000, (n,), generator=gen).tolist(),
                       max_tokens=8) for i, n in enumerate(FILLER_LENGTHS)]
    phases = {}
    for phase in ("alone", "batched", "cached"):
        probe = probe_requests(prompts, phase)
        if phase == "batched":
            # Fillers arrive over the probes' whole run, so the probes decode in steps that
            # carry other prompts' prefill chunks.
            results = run(engine.core, fillers + probe,
                          [3 * i for i in range(len(fillers))] + [1, 2, 2, 3, 1])
        else:
            results = {}
            for r in probe:  # one at a time: alone on an idle engine
                results.update(run(engine.core, [r]))
        phases[phase] = {r.request_id.removeprefix(phase): (
            results[r.request_id].tokens, engine.logits[r.request_id]) for r in probe}
    for r in probe_requests(prompts, "batched"):
        assert r.request_id in engine.beside_prefill, "a probe never ran beside a prefill"
    for r in probe_requests(prompts, "cached"):
        assert engine.first_start[r.request_id] > 0, "a probe missed the prefix cache"
    assert all(engine.first_start[r.request_id] == 0 for r in probe_requests(prompts, "alone"))
    return phases


def differing_logits(phases) -> int:
    """Sampled rows, batched or cached, whose logits are not the bits they had alone."""
    alone = phases["alone"]
    return sum(
        not torch.equal(got, want)
        for phase in ("batched", "cached")
        for probe, (_, logits) in phases[phase].items()
        for got, want in zip(logits, alone[probe][1], strict=False)
    )
