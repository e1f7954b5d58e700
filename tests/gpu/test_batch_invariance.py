"""--batch-invariant on the CUDA path (docs/gpu.md): the CPU test's scenario
(tests/invariance_scenario.py) with the flashinfer backend in bfloat16. Skipped where there
is no CUDA device or flashinfer is not installed. The model: tests/gpu/model.py."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)",
                allow_module_level=True)
pytest.importorskip("flashinfer", reason="flashinfer is not installed (the `cuda` extra)")

from tests.gpu.model import gpu_model_path  # noqa: E402
from tests.invariance_scenario import RecordingEngine, differing_logits, scenario  # noqa: E402


def test_flashinfer_logits_are_bit_identical_alone_batched_and_cached():
    phases = scenario(RecordingEngine(True, device="cuda", attention_backend="flashinfer",
                                      model=gpu_model_path()))
    alone = phases["alone"]
    for phase in ("batched", "cached"):
        for probe, (tokens, _) in phases[phase].items():
            assert tokens == alone[probe][0], f"{probe} {phase}"
    assert differing_logits(phases) == 0
