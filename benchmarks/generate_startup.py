"""The README's first command, timed from the command to the answer: first runs (an empty cache
of converted models) and second runs (warm caches), medians of each row of the start-up table.

    python benchmarks/generate_startup.py --runs 5          # the embedded model, CPU

Each run is `python -m nanovllm generate --chat PROMPT --verbose --quiet` in a fresh process;
wall is measured around the process, the rows come from its `--verbose` table. A first run gets
a new empty NANOVLLM_CACHE_DIR; second runs share one filled by a first run. Prints the answer
of every run (they must agree) and one JSON line per kind of run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"


def one_run(cache: str, extra: list[str]) -> tuple[str, dict[str, float]]:
    command = [sys.executable, "-m", "nanovllm", "generate", "--chat", PROMPT, "--verbose", "--quiet", *extra]
    env = {**os.environ, "NANOVLLM_CACHE_DIR": cache}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    rows = {"wall": time.perf_counter() - start}
    for line in done.stderr.splitlines():
        name, _, value = line.rpartition(" ")
        try:
            rows[name.strip()] = float(value)
        except ValueError:
            continue
    return done.stdout.strip(), rows


def summary(kind: str, runs: list[dict[str, float]]) -> dict:
    names = [n for n in runs[0] if all(n in r for r in runs)]
    return {"runs": kind, "n": len(runs), **{n: round(statistics.median(r[n] for r in runs), 2) for n in names}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5, help="runs of each kind")
    ap.add_argument("--first-runs", type=int, default=None, help="first runs (default: --runs)")
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="nanovllm-startup-") as root:
        first = []
        for i in range(args.first_runs if args.first_runs is not None else args.runs):
            answer, rows = one_run(os.path.join(root, f"cold{i}"), extra)
            print(f"first run {i}: {rows['wall']:.2f} s: {answer}", file=sys.stderr)
            first.append(rows)
        warm_cache = os.path.join(root, "warm")
        one_run(warm_cache, extra)  # fills it
        second = []
        for i in range(args.runs):
            answer, rows = one_run(warm_cache, extra)
            print(f"second run {i}: {rows['wall']:.2f} s: {answer}", file=sys.stderr)
            second.append(rows)
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if first:
        print(json.dumps(summary("first", first)))
    print(json.dumps(summary("second", second)))


if __name__ == "__main__":
    main()
