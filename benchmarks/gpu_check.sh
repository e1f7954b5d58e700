#!/usr/bin/env bash
# The CUDA path's check on a lent GPU machine, as ONE command (docs/gpu.md says how to call
# the device tool): from this checkout plus the carried folder .gpukit/, with no network.
#
#   benchmarks/gpu_check.sh --prepare   here (network, nvcc): build .gpukit/ (wheels,
#                                       FlashInfer kernels for sm_90a, tokenizer)
#   benchmarks/gpu_check.sh --dry-run   here or in CI: the plan's timeouts, the carried size,
#                                       the wheels, the kernels, the model build
#   timeout 540 benchmarks/gpu_check.sh on the device: results as files under $OUT
#
# The steps, their timeouts and their result files are benchmarks/gpukit/plan.py's.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpukit "$@"
