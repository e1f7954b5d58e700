#!/usr/bin/env bash
# sluice bench at concurrency 1, 8 and 32 for one dtype, on the default model.
# Usage: benchmarks/spine.sh float32|bfloat16 [port]
set -euo pipefail
dtype=${1:-float32}
port=${2:-8123}
bin=$(dirname "$0")/../.venv/bin
"$bin/sluice" serve --port "$port" --dtype "$dtype" --log-level warning &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
for c in 1 8 32; do
  n=$(( c < 4 ? 8 : 2 * c ))
  echo "== dtype=$dtype concurrency=$c requests=$n"
  "$bin/sluice" bench --base-url "http://127.0.0.1:$port/v1" --concurrency "$c" \
    --num-requests "$n" --max-tokens 128 --ignore-eos
done
