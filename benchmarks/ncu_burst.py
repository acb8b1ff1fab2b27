"""Eager launches of the persistent kernel's decode burst at context 384, small enough for Nsight
Compute to replay (a KV pool of 64 blocks, not the whole GPU's): docs/benchmarks.md, W5
session 21.

    ncu --kernel-name regex:_decode_kernel --launch-skip 3 --launch-count 1 \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum" \\
        python benchmarks/ncu_burst.py --model /tmp/q06
    ncu ... --section SourceCounters --section WarpStateStats -o /tmp/burst python benchmarks/ncu_burst.py ...
    ncu --import /tmp/burst.ncu-rep --page source --csv --print-source sass > /tmp/burst.csv

(ncu locks the clocks at base by default: times under it are not the kernel's.)
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--launches", type=int, default=6)
    args = ap.parse_args()
    from nanovllm import LLM

    llm = LLM(args.model, max_model_len=4096, num_kvcache_blocks=64, decode_burst=args.steps)
    runner = llm.engine.executor.runner
    runner.finish_background_compile()
    decoder = runner.persistent_decoder
    if decoder is None or not decoder.multi_step:
        raise SystemExit("this device runs no decode burst in one launch of the persistent kernel")
    s = runner.graph_runner.bursts[0]
    table = list(range(-(-(args.context + args.steps) // runner.block_size)))
    host = np.zeros(s.nbytes, dtype=np.uint8)
    s.fill_host(host, token=1234, position=args.context - 1, block_table=table, block_size=runner.block_size,
                steps=args.steps)
    s.buffer.copy_(torch.from_numpy(host))
    meta = s.meta(0)
    for _ in range(args.launches):
        decoder(s.tokens[0], s.positions[0], meta, s.tokens[0], s.temperatures[0], s.seeds[0], steps=args.steps,
                record_bytes=s.RECORD)
    torch.cuda.synchronize()
    print("tokens (records 1..K-1, then 0):", s.records[: args.steps, 0].tolist())


if __name__ == "__main__":
    main()
