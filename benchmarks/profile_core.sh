#!/usr/bin/env bash
# Where the engine core's loop spends its time under W4: `nanovllm serve` on a free local port,
# the streaming load at 64 clients, and py-spy sampling the core process meanwhile (`pip install
# py-spy`; on Linux it may need CAP_SYS_PTRACE or root). Without a constraint, then with every
# request under benchmarks/structured_schema.json; prints each load's summary and the share of
# the loop thread's samples by function (benchmarks/profile_agg.py), and leaves the raw samples
# in PROFILE_OUT (default: a new temporary directory).
#   benchmarks/profile_core.sh [MODEL] [extra serve options...]   (no MODEL: the embedded default)
# PROFILE_REQUESTS (1536), PROFILE_SECONDS (10), PROFILE_RATE (400 samples a second) change it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=${1:-}
shift || true
out=${PROFILE_OUT:-$(mktemp -d)}
mkdir -p "$out"
. "$here/serve_lib.sh"
port=$(free_port)
log="$out/serve.log"
python3 -m nanovllm serve ${model:+"$model"} --host 127.0.0.1 --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
wait_healthy "http://127.0.0.1:$port" 600 $server "$log"
core=$(pgrep -P "$server" -f multiprocessing.spawn | head -1)
bench() {  # requests, prompt seed, extra serve_bench options
  python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$port" --num-clients 64 --num-requests "$1" \
    --input-len 128 --output-len 128 --prompt-seed "$2" --json "${@:3}"
}
bench 64 1 >/dev/null  # warm-up, unconstrained and constrained (the tokenizer's grammar tables)
bench 64 2 --json-schema "$here/structured_schema.json" >/dev/null
seed=10
for kind in plain schema; do
  extra=()
  [ "$kind" = schema ] && extra=(--json-schema "$here/structured_schema.json")
  seed=$((seed + 1))
  bench "${PROFILE_REQUESTS:-1536}" "$seed" "${extra[@]}" >"$out/load_$kind.json" &
  load=$!
  sleep 4  # past the ramp-up
  py-spy record --pid "$core" --rate "${PROFILE_RATE:-400}" --duration "${PROFILE_SECONDS:-10}" --nonblocking \
    --format raw --output "$out/samples_$kind.txt" >/dev/null 2>&1
  wait $load
  echo "== $kind: $(cat "$out/load_$kind.json")"
  python3 "$here/profile_agg.py" "$out/samples_$kind.txt"
done
echo "raw samples in $out"
