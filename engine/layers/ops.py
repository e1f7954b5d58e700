"""The model's elementwise building blocks, behind one small interface (`TorchOps`,
`torch_ops.py`): `make_ops` picks the implementation that goes with the attention backend
and the device: FlashInfer's kernels (`flashinfer_ops.py`), the engine's compiled CPU
kernels (`cpu_ops.py`) or plain torch."""

from __future__ import annotations

import torch

from engine.layers.cpu_ops import CpuKernelOps
from engine.layers.flashinfer_ops import FlashInferOps
from engine.layers.torch_ops import TorchOps


def make_ops(name: str, device: torch.device, batch_invariant: bool = False) -> TorchOps:
    """The ops that go with an attention backend: flashinfer's with flashinfer, the compiled
    CPU kernels on a CPU where they build, plain torch otherwise. batch_invariant: see
    CpuKernelOps and FlashInferOps; on a CPU it needs the compiled kernels (ValueError)."""
    if name == "flashinfer":
        return FlashInferOps(batch_invariant)
    if device.type == "cpu":
        from engine.kernels.cpu_kernels import enabled, kernels

        compiled = kernels()
        if compiled is not None:
            return CpuKernelOps(compiled, batch_invariant)
        if batch_invariant and not enabled():
            raise ValueError("--batch-invariant needs the engine's CPU kernels, which "
                             "SLUICE_CPU_KERNELS switches off; unset it")
        if batch_invariant:
            raise ValueError("--batch-invariant needs the engine's CPU kernels, which are not "
                             "available here (see the log; `python -m engine.kernels.cpu_kernels` "
                             "builds them)")
    elif batch_invariant:
        raise ValueError(f"--batch-invariant runs on a CPU or with flashinfer, not {device}")
    return TorchOps()
