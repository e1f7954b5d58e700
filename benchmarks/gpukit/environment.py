"""The device's side of the check, before the tests: GPU, driver, versions, that every package
sluice needs imports, which attention backend `auto` picks, and whether each FlashInfer
module the engine loads is one of the carried, prebuilt ones (else FlashInfer compiles it
there, on the check's clock). Exit status 1 when any of that is not as planned; the later
steps run anyway, so their logs say what it cost.

    python -m benchmarks.gpukit.environment
"""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sys

# Module names of what sluice imports from the carried wheels and from the device's own.
IMPORTS = ("msgspec", "zmq", "starlette", "uvicorn", "httptools", "uvloop", "llguidance",
           "gguf", "tvm_ffi",
           "flashinfer", "flashinfer_jit_cache", "transformers", "tokenizers", "safetensors",
           "httpx", "prometheus_client", "pytest", "pytest_timeout")


def main() -> int:
    failed = []
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True)
        print("gpu:", smi.stdout.strip() or smi.stderr.strip())
    print("nvcc:", shutil.which("nvcc") or "none", "| python", platform.python_version())
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            print(f"import {name}: {getattr(module, '__version__', 'ok')}")
        except Exception as exc:  # any import failure is the finding
            print(f"import {name}: FAILED {type(exc).__name__}: {exc}")
            failed.append(name)
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
          torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    from engine.attention.selector import select_attention_backend

    choice = select_attention_backend("auto", torch.device("cuda"), torch.bfloat16)
    print("attention backend (auto, bfloat16):", choice.name, "-", choice.reason)
    if choice.name != "flashinfer":
        failed.append("flashinfer backend")
    if "flashinfer" not in failed:
        from benchmarks.gpukit.kernels import specs

        for spec in specs():
            print(f"kernel {spec.name}: {'prebuilt' if spec.is_aot else 'NOT PREBUILT'}")
            if not spec.is_aot:
                failed.append(spec.name)
    if failed:
        print("not as planned:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
