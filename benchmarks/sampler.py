"""The fused temperature sampler (layers/fused_sampler.py) alone: GPU time per call by batch.

    python benchmarks/sampler.py [--rows 32 64 128 256] [--vocab 151936] [--baseline-file OLD.py]

bf16 logits [rows, vocab] as the LM head leaves them, temperature 0.6 (W1's), GPU time of
the two kernels (the scan and the per-row pick of the best chunk) per call, from --iters
replays of a CUDA graph of one call.
--baseline-file: another version of fused_sampler.py (say, the last commit's, from `git show
HEAD:nanovllm/layers/fused_sampler.py > /tmp/old.py`), timed in the same process at each batch size,
and checked, like this one, to sample the greedy rows' argmax.
"""
from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from common import graph_time_us
from nanovllm.layers import fused_sampler


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_fused_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--baseline-file")
    args = ap.parse_args()
    modules = {"this": fused_sampler}
    if args.baseline_file:
        modules["baseline"] = load_module(args.baseline_file)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device="cuda", generator=gen).to(torch.bfloat16)
        temperature = torch.full((rows,), 0.6, device="cuda")
        greedy = torch.zeros(rows, device="cuda")
        seed = torch.tensor([1234], device="cuda")
        result = {"rows": rows, "vocab": args.vocab}
        for name, module in modules.items():
            assert torch.equal(module.gumbel_argmax(logits, greedy, seed), logits.float().argmax(-1))
        for name, module in modules.items():
            result[f"{name}_us"] = round(graph_time_us(lambda _: module.gumbel_argmax(logits, temperature, seed), replays=args.iters), 1)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
