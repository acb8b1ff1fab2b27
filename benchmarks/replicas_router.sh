#!/usr/bin/env bash
# W4 load through vllm-router in front of N `nanovllm serve` replicas on this machine.
#   benchmarks/replicas_router.sh N [MODEL] [extra serve options...]   (no MODEL: the embedded default)
# REPLICA_CPUS="0 1" (or "0-3 4-7") pins replica i to the i-th CPU list (taskset), with as many
# torch threads as the list has CPUs;
# W4_CLIENTS (default 16), W4_REQUESTS (default 2 x clients), W4_INPUT_LEN / W4_OUTPUT_LEN (128).
set -euo pipefail
n=$1; shift
model=${1:-}
shift || true
. "$(dirname "$0")/serve_lib.sh"
read -r -a cpus <<< "${REPLICA_CPUS:-}"
pids=(); urls=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null || true' EXIT
for i in $(seq 0 $((n - 1))); do
  port=$(free_port)
  pin=()
  if [ ${#cpus[@]} -gt 0 ]; then
    pin=(taskset -c "${cpus[$i]}")
    OMP_NUM_THREADS=$(taskset -c "${cpus[$i]}" nproc); export OMP_NUM_THREADS
  fi
  "${pin[@]}" python3 -m nanovllm serve ${model:+"$model"} --host 127.0.0.1 --port "$port" --served-model-name m "$@" \
    >"/tmp/replica$i.log" 2>&1 &
  pids+=($!); urls+=("http://127.0.0.1:$port")
done
for i in "${!urls[@]}"; do
  wait_healthy "${urls[$i]}" 600 "${pids[$i]}" "/tmp/replica$i.log"
done
rport=$(free_port)
vllm-router --host 127.0.0.1 --port "$rport" --prometheus-port "$(free_port)" --worker-urls "${urls[@]}" --policy round_robin >/tmp/router.log 2>&1 &
pids+=($!)
wait_healthy "http://127.0.0.1:$rport" 120 $! /tmp/router.log
clients=${W4_CLIENTS:-16}
# Warm-up: one short request per client first (the first steps build the CPU kernels for their shapes),
# with other prompts than the run's, which would otherwise find theirs in the prefix cache.
python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$rport" --served-model m --num-clients "${W4_CLIENTS:-16}" \
  --num-requests "${W4_CLIENTS:-16}" --input-len "${W4_INPUT_LEN:-128}" --output-len 8 --prompt-seed 1 --json >/dev/null
python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$rport" --served-model m --num-clients "$clients" \
  --num-requests "${W4_REQUESTS:-$((2 * clients))}" --input-len "${W4_INPUT_LEN:-128}" --output-len "${W4_OUTPUT_LEN:-128}" --json
