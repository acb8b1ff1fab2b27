#!/usr/bin/env bash
# Structured output under W4: `nanovllm serve` on a free local port, then for each client count
# the streaming load without a constraint and with every request constrained to one JSON schema
# (response_format json_schema, benchmarks/structured_schema.json: 20 fields), alternated
# W4_ROUNDS times; prints each run's JSON summary and the constrained / unconstrained ratio of
# output tok/s per round. First, the schema's compile time over the model's tokenizer.
#   benchmarks/structured_w4.sh [MODEL] [extra serve options...]   (no MODEL: the embedded default)
# W4_CLIENTS (64), W4_ROUNDS (2), W4_REQUESTS (8 per client), W4_INPUT_LEN (128), W4_OUTPUT_LEN (128),
# W4_SCHEMA change it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=${1:-}
shift || true
schema=${W4_SCHEMA:-$here/structured_schema.json}
python3 "$here/structured_compile.py" ${model:+"$model"} --schema "$schema"
. "$here/serve_lib.sh"
port=$(free_port)
log=$(mktemp)
python3 -m nanovllm serve ${model:+"$model"} --host 127.0.0.1 --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
wait_healthy "http://127.0.0.1:$port" 600 $server "$log"
bench() {  # clients, then extra serve_bench options; prints output tok/s, the summary on stderr
  # (a run with failed requests still counts: the summary gives their number and the first error)
  { python3 -m nanovllm.entrypoints.serve_bench --url "http://127.0.0.1:$port" --num-clients "$1" \
    --num-requests "${W4_REQUESTS:-$(( $1 < 16 ? 8 : 8 * $1 ))}" --input-len "${W4_INPUT_LEN:-128}" \
    --output-len "${W4_OUTPUT_LEN:-128}" --json "${@:2}" || true; } | python3 -c \
    'import json, sys; line = sys.stdin.read(); sys.stderr.write(line); s = json.loads(line)
if s["requests_failed"]: sys.stderr.write("%d requests failed, the first: %s\n" % (s["requests_failed"], s["first_error"]))
print(s["output_tok_per_s"])'
}
# Every run sends prompts of its own (--prompt-seed): a run that repeated another's would find
# them in the prefix cache and skip their prefill.
W4_REQUESTS=8 bench 4 --prompt-seed 1 >/dev/null  # warm-up: the first constrained request builds the tokenizer's tables
W4_REQUESTS=8 bench 4 --prompt-seed 2 --json-schema "$schema" >/dev/null
for n in ${W4_CLIENTS:-64}; do
  for round in $(seq "${W4_ROUNDS:-2}"); do
    plain=$(bench "$n" --prompt-seed "$((1000 * n + 10 * round))")
    constrained=$(bench "$n" --prompt-seed "$((1000 * n + 10 * round + 1))" --json-schema "$schema")
    python3 -c "print(f'clients $n round $round: unconstrained $plain tok/s, json schema $constrained tok/s, ratio {$constrained / $plain:.3f}')"
  done
done
