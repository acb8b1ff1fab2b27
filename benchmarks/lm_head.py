"""The lone-sequence graph's LM head and greedy argmax: cuBLAS + GreedyRow against GreedyHead.

Qwen3-0.6B's shape by default ([151,936 x 1,024] bf16, 311 MB: read from HBM every call, far
past the L2). Each case is captured in a CUDA graph and replayed back to back (common.py
graph_time_us); the floor is the weight's bytes at the GPU's HBM bandwidth.

    python benchmarks/lm_head.py
    python benchmarks/lm_head.py --variants 16,256,4 32,128,4   # GreedyHead block_v,block_k,warps
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import graph_time_us


def main() -> None:
    from nanovllm.layers.fused_sampler import GreedyRow
    from nanovllm.layers.greedy_head import GreedyHead

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--variants", nargs="*", default=["8,512,4", "16,256,4", "16,512,4", "32,128,4", "32,256,8", "64,128,8"])
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(args.vocab, args.hidden, dtype=torch.bfloat16, device="cuda") * 0.05
    h = torch.randn(1, args.hidden, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    mb = w.numel() * w.element_size() / 1e6
    ref_logits = F.linear(h, w)
    ref = ref_logits.argmax().item()
    greedy = GreedyRow(args.vocab, w.device)

    def cublas(_):
        greedy(F.linear(h, w), out)

    us = graph_time_us(cublas, replays=args.replays)
    print(f"cuBLAS + GreedyRow: {us:.1f} us ({mb / us:.2f} TB/s), token {out.item()} (argmax {ref})")
    print(f"  F.linear alone: {graph_time_us(lambda _: F.linear(h, w), replays=args.replays):.1f} us")
    for spec in args.variants:
        bv, bk, warps = (int(x) for x in spec.split(","))
        head = GreedyHead(w, block_v=bv, block_k=bk, num_warps=warps)
        us = graph_time_us(lambda _: head(h, out), replays=args.replays)
        logits = head(h, out)
        torch.cuda.synchronize()
        diff = (logits.float() - ref_logits.float()).abs().max().item()
        print(f"GreedyHead block_v={bv} block_k={bk} warps={warps}: {us:.1f} us ({mb / us:.2f} TB/s), "
              f"token {out.item()} (argmax of its logits {logits.argmax().item()}), max |logit - cuBLAS| {diff:.3g}")


if __name__ == "__main__":
    main()
