"""W4 (docs/benchmarks.md): N concurrent streaming clients against a running `nanovllm serve`.

A thin wrapper: the load generator lives in `nanovllm.entrypoints.serve_bench` so that
`nanovllm bench --serving` runs the same code. Example:

    nanovllm serve --port 8000 &
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --num-clients 16 --output-len 128
"""
import sys

from nanovllm.entrypoints.serve_bench import main

if __name__ == "__main__":
    sys.exit(main())
