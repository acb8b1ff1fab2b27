#!/usr/bin/env bash
# W4 for two source trees of nano-vllm side by side: both servers up at once on one device
# (each with --gpu-memory-utilization 0.4 unless SERVE_ARGS says otherwise), warmed up, then
# rounds that alternate which tree runs first. Each run is the W4 load of structured_w4.sh
# (serve_bench: 64 clients, 512 requests, 128 in / 128 out, prompts of its own), unconstrained
# and with every request under benchmarks/structured_schema.json. On a machine whose speed
# drifts between runs, interleaved rounds compare two trees where runs an hour apart cannot.
#   benchmarks/serve_ab.sh TREE_A TREE_B [MODEL]   (a tree: a directory holding nanovllm/; no MODEL: the embedded default)
# AB_ROUNDS (6), AB_CLIENTS (64), AB_REQUESTS (512), AB_INPUT_LEN / AB_OUTPUT_LEN (128), SERVE_ARGS change it.
# Prints a line per run and tree, then per tree the medians and each run's ratio.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
trees=("$(cd "$1" && pwd)" "$(cd "$2" && pwd)")
model=${3:-}
. "$here/serve_lib.sh"
schema=$here/structured_schema.json
out=$(mktemp -d)
ports=() pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
for i in 0 1; do
  ports[$i]=$(free_port)
  (cd "${trees[$i]}" && PYTHONPATH="${trees[$i]}${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m nanovllm serve ${model:+"$model"} \
    --host 127.0.0.1 --port "${ports[$i]}" ${SERVE_ARGS:---gpu-memory-utilization 0.4} >"$out/serve_$i.log" 2>&1) &
  pids[$i]=$!
done
for i in 0 1; do wait_healthy "http://127.0.0.1:${ports[$i]}" 600 "${pids[$i]}" "$out/serve_$i.log"; done
bench() {  # tree index, requests, prompt seed, extra serve_bench options
  (cd "${trees[$1]}" && PYTHONPATH="${trees[$1]}${PYTHONPATH:+:$PYTHONPATH}" python3 -m nanovllm.entrypoints.serve_bench \
    --url "http://127.0.0.1:${ports[$1]}" --num-clients "${AB_CLIENTS:-64}" --num-requests "$2" \
    --input-len "${AB_INPUT_LEN:-128}" --output-len "${AB_OUTPUT_LEN:-128}" --prompt-seed "$3" --json "${@:4}")
}
for i in 0 1; do  # warm-up; the first constrained request builds the tokenizer's grammar tables
  bench $i 64 1 >/dev/null
  bench $i 64 2 --json-schema "$schema" >/dev/null
done
for round in $(seq "${AB_ROUNDS:-6}"); do
  order="0 1"
  [ $((round % 2)) -eq 0 ] && order="1 0"
  for i in $order; do
    for kind in plain schema; do
      extra=()
      [ $kind = schema ] && extra=(--json-schema "$schema")
      bench $i "${AB_REQUESTS:-512}" "$((1000 * round + ${#extra[@]}))" "${extra[@]}" | tee -a "$out/runs_$i.jsonl" |
        python3 -c "import json, sys; s = json.load(sys.stdin); print('round $round tree $i $kind', s['output_tok_per_s'], 'tok/s,', s['requests_failed'], 'failed')"
    done
  done
done
python3 - "$out" "${trees[@]}" <<'PY'
import json, statistics, sys
out, trees = sys.argv[1], sys.argv[2:]
for i, tree in enumerate(trees):
    runs = [json.loads(line) for line in open(f"{out}/runs_{i}.jsonl")]
    plain = [r["output_tok_per_s"] for r in runs if not r["json_schema"]]
    schema = [r["output_tok_per_s"] for r in runs if r["json_schema"]]
    ratios = [round(c / p, 3) for p, c in zip(plain, schema)]
    print(f"tree {i} ({tree}): unconstrained median {statistics.median(plain):.0f} tok/s, under the schema "
          f"{statistics.median(schema):.0f}, ratio median {statistics.median(ratios):.3f}, per round {ratios}")
PY
