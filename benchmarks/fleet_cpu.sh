#!/usr/bin/env bash
# Frontend CPU time per streamed token with and without postproc workers: the same load
# (sluice bench, 128-token streamed chat answers) against `sluice serve` twice, measuring the
# frontend process with --cpu-pid. Usage: benchmarks/fleet_cpu.sh [concurrency] [workers]
set -euo pipefail
concurrency=${1:-32}
workers=${2:-2}
port=8124
bin=$(dirname "$0")/../.venv/bin

run() {  # run <label> <extra serve flags...>
  local label=$1; shift
  "$bin/sluice" serve --port "$port" --log-level warning "$@" &
  local server=$!
  trap "kill $server 2>/dev/null; wait $server 2>/dev/null" EXIT
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  local frontend
  frontend=$(pgrep -P "$server" -f "sluice frontend")
  echo "== $label (frontend pid $frontend)"
  "$bin/sluice" bench --base-url "http://127.0.0.1:$port/v1" --concurrency "$concurrency" \
    --num-requests $((2 * concurrency)) --max-tokens 128 --ignore-eos --cpu-pid "$frontend"
  kill "$server"; wait "$server" 2>/dev/null || true
  trap - EXIT
}

run "no fleet: the frontend post-processes"
run "$workers postproc workers" --postproc-workers "$workers"
