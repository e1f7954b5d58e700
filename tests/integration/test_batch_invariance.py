"""--batch-invariant (issue 20): a request's tokens and logits do not depend on what shares
its steps. The real default model in bfloat16, in-process engines (the behaviour lives in the
engine's kernels and scheduler): each probe prompt alone, then inside a batch of 32 mixed
requests (different lengths, long ones mid-prefill beside the probes, so the probes are
chunked differently), then alone again after its prefix is cached. With the mode on the
sampled rows' logits are bit-identical every time, so greedy and seeded tokens are too;
with it off the same scenario changes the logits (it is allowed to change the tokens).

That control runs in a dtype whose default kernels depend on the batch on this CPU: bf16
where the CPU multiplies it natively; without native bf16 (AVX2 only, or SLUICE_CPU_ISA=avx2)
oneDNN's emulated bf16 gave every row the same numbers (issue 29), so there the control and
the mode both run in float32 too, and every CPU shows the mode changing something."""

from __future__ import annotations

import pytest
import torch

from engine.process.device import cpu_has_fast_bf16
from tests.invariance_scenario import RecordingEngine, differing_logits, scenario

pytestmark = pytest.mark.slow

CONTROL_DTYPE = "bfloat16" if cpu_has_fast_bf16() else "float32"


@pytest.fixture(scope="module", params=sorted({"bfloat16", CONTROL_DTYPE}))
def invariant_phases(request):
    return scenario(RecordingEngine(batch_invariant=True, dtype=request.param))


def test_tokens_are_identical_alone_batched_and_cached(invariant_phases):
    alone = invariant_phases["alone"]
    assert all(len(tokens) == 16 for tokens, _ in alone.values())
    for phase in ("batched", "cached"):
        for probe, (tokens, _) in invariant_phases[phase].items():
            assert tokens == alone[probe][0], f"{probe} {phase}"


def test_logits_are_bit_identical_in_every_phase(invariant_phases):
    alone = invariant_phases["alone"]
    for phase in ("batched", "cached"):
        for probe, (_, logits) in invariant_phases[phase].items():
            assert len(logits) == len(alone[probe][1]) == 16
            for step, (got, want) in enumerate(zip(logits, alone[probe][1], strict=True)):
                assert torch.equal(got, want), f"{probe} {phase} step {step}"


def test_without_the_mode_the_same_scenario_changes_the_logits():
    """The scenario is a real test of the mode: the default kernels (oneDNN, SDPA) give the
    same rows other numbers in it, in CONTROL_DTYPE, which the mode also runs in."""
    phases = scenario(RecordingEngine(batch_invariant=False, dtype=CONTROL_DTYPE))
    assert differing_logits(phases) > 0, CONTROL_DTYPE
