#!/usr/bin/env bash
# W4: start `nanovllm serve` on a free local port, run the streaming load generator for
# N = 1, 16, 64, 256 concurrent clients, check the KV pool is free afterwards, stop the server.
#   benchmarks/serve_w4.sh [MODEL] [extra serve options...]   (no MODEL: the embedded default)
# W4_CLIENTS, W4_INPUT_LEN, W4_OUTPUT_LEN change the load; W4_SERVER_PYTHONPATH runs the server
# from another source tree (the load generator stays this one's), to compare two trees.
set -euo pipefail
model=${1:-}
shift || true
. "$(dirname "$0")/serve_lib.sh"
port=$(free_port)
log=$(mktemp)
# (run from that tree: `python -m` puts the working directory first on sys.path)
tree=${W4_SERVER_PYTHONPATH:-}
(cd "${tree:-.}" && PYTHONPATH=${tree:-${PYTHONPATH:-}} exec python3 -m nanovllm serve ${model:+"$model"} --host 127.0.0.1 \
   --port "$port" "$@") >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
wait_healthy "http://127.0.0.1:$port" 600 $server "$log"
# Each run sends prompts of its own (a seed per run): with one seed, a run's prompts would begin
# with the previous run's, which the prefix cache still holds.
seed=0
for n in ${W4_CLIENTS:-1 16 64 256}; do
  seed=$((seed + 1))
  python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$port" --num-clients "$n" --prompt-seed "$seed" \
    --num-requests "$(( n < 16 ? 8 : 2 * n ))" --input-len "${W4_INPUT_LEN:-128}" --output-len "${W4_OUTPUT_LEN:-128}" --json
done
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^(nanovllm_kv_cache|vllm:request_success|vllm:num_requests)' || true
