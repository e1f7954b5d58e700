"""Device and dtype choice for the engine."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16). Without either,
    oneDNN emulates bf16 and float32 is faster. SLUICE_CPU_ISA=avx2 answers as such a CPU
    would (engine/kernels/cpu_kernels.py), so any machine can run what an AVX2-only one runs."""
    from engine.kernels.cpu_kernels import target_isa

    if target_isa() == "avx2":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16 matmul, otherwise float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16()):
        return torch.bfloat16
    return torch.float32
