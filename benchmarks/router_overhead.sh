#!/usr/bin/env bash
# What vllm-router costs in front of one replica: W4 at W4_CLIENTS (default 64) clients, straight
# to the replica and through the router, alternated ROUNDS times (default 3) against one server;
# W4_REQUESTS requests per run (default 8 per client).
#   benchmarks/router_overhead.sh [MODEL] [extra serve options...]   (no MODEL: the embedded default)
set -euo pipefail
model=${1:-}
shift || true
. "$(dirname "$0")/serve_lib.sh"
port=$(free_port); rport=$(free_port)
python3 -m nanovllm serve ${model:+"$model"} --host 127.0.0.1 --port "$port" --served-model-name m "$@" >/tmp/replica.log 2>&1 &
server=$!
trap 'kill $server ${router:-} 2>/dev/null; wait 2>/dev/null || true' EXIT
wait_healthy "http://127.0.0.1:$port" 600 $server /tmp/replica.log
vllm-router --host 127.0.0.1 --port "$rport" --prometheus-port "$(free_port)" --worker-urls "http://127.0.0.1:$port" --policy round_robin >/tmp/router.log 2>&1 &
router=$!
wait_healthy "http://127.0.0.1:$rport" 120 $router /tmp/router.log
clients=${W4_CLIENTS:-64}
load() {  # $1: label, $2: port, $3: prompt seed (each run its own: repeated prompts would hit the prefix cache)
  echo -n "$1 "
  python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$2" --served-model m --num-clients "$clients" \
    --prompt-seed "$3" \
    --num-requests "${W4_REQUESTS:-$((8 * clients))}" --input-len "${W4_INPUT_LEN:-128}" --output-len "${W4_OUTPUT_LEN:-128}" --json
}
load warmup "$port" 1 >/dev/null
for round in $(seq "${ROUNDS:-3}"); do load replica "$port" "$((10 * round))"; load router "$rport" "$((10 * round + 1))"; done
