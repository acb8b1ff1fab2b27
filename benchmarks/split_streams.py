"""Trial: a decode step's batch as k sub-batches on k CUDA streams, captured in one graph.

    python benchmarks/split_streams.py --model /tmp/q06

At W1's batch sizes a step is attention (bound by KV bandwidth) plus projections that cost
their launch and ramp more than their bytes (docs/benchmarks.md). The idea (as in NanoFlow):
split the batch, so that one half's projections run beside the other half's attention. Each
sub-batch replays the same per-op forward on its own stream; the branches have no dependency
between them, so the GPU may overlap them. Rows go to sub-batches round-robin from a list sorted
longest first, so the halves carry equal work. Prints the replay time of the engine's one-stream
graph and of each split graph, at W1-shaped contexts, and how far the split's hidden states are
from the one-stream graph's (bf16: the projections run at another M).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from common import replay_us
from nanovllm import LLM
from nanovllm.attention.backend import AttentionMetadata

# decode batch -> context range, W1's shape at that batch (docs/benchmarks.md, decode order)
CONTEXTS = {256: (100, 1100), 192: (300, 1400), 128: (600, 1700), 64: (1100, 1900), 32: (1400, 2000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=4096, persistent_decode=False)
    runner = llm.engine.executor.runner
    g, model = runner.graph_runner, runner.model
    rng = np.random.default_rng(0)
    streams = [torch.cuda.Stream() for _ in range(4)]

    def meta(lo: int, hi: int) -> AttentionMetadata:
        n = hi - lo
        return AttentionMetadata(
            slot_mapping=g.slot_mapping[lo:hi], query_start_loc=g.query_start_loc[: n + 1], seq_lens=g.seq_lens[lo:hi],
            block_tables=g.block_tables[lo:hi], num_decodes=n, max_query_len=1, max_seq_len=g.max_model_len,
            query_lens_cpu=[1] * n, seq_lens_cpu=[g.max_model_len] * n)

    def fill(ctx: np.ndarray, ids: np.ndarray, tables: np.ndarray) -> None:
        n = len(ctx)
        g.block_tables[:n] = torch.from_numpy(tables).cuda()
        g.seq_lens[:n] = torch.from_numpy(ctx.astype(np.int32)).cuda()
        g.positions[:n] = torch.from_numpy(ctx.astype(np.int64) - 1).cuda()
        g.slot_mapping[:n] = -1  # store nothing
        g.input_ids[:n] = torch.from_numpy(ids).cuda()

    @torch.inference_mode()
    def capture_split(bounds: list[int]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
        def forward() -> list[torch.Tensor]:
            main_stream = torch.cuda.current_stream()
            outs = []
            for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                stream = main_stream if j == 0 else streams[j]
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    outs.append(model(g.input_ids[lo:hi], g.positions[lo:hi], meta(lo, hi)))
            for j in range(1, len(bounds) - 1):
                main_stream.wait_stream(streams[j])
            return outs

        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = forward()
        return graph, outs

    for bs, (lo_ctx, hi_ctx) in CONTEXTS.items():
        ctx = np.sort(rng.integers(lo_ctx, hi_ctx, bs))[::-1]
        ids = rng.integers(0, 10000, bs)
        perm = rng.permutation(runner.num_kvcache_blocks)
        tables = np.zeros((bs, g.block_tables.shape[1]), dtype=np.int32)
        used = 0
        for i, c in enumerate(ctx):
            nb = -(-int(c) // runner.block_size)
            tables[i, :nb] = perm[used: used + nb]
            used += nb
        fill(ctx, ids, tables)
        one = replay_us(g.graphs[bs], 40, warmup=5)
        ref = g.outputs[bs].float().clone()
        line = f"batch {bs:3d}, contexts {lo_ctx}-{hi_ctx}: one stream {one:7.1f} us"
        for k in (2, 3, 4):
            if bs % k or bs // k < 16:
                continue
            order = np.concatenate([np.arange(j, bs, k) for j in range(k)])
            fill(ctx[order], ids[order], tables[order])
            graph, outs = capture_split([j * (bs // k) for j in range(k + 1)])
            split = replay_us(graph, 40, warmup=5)
            got = torch.cat(outs).float()[torch.from_numpy(np.argsort(order)).cuda()]
            diff = ((got - ref).abs().max() / ref.abs().max()).item()
            line += f" | {k} streams {split:7.1f} us ({one / split:.2f}x, max diff {diff:.1e} of max |h|)"
            del graph, outs
            fill(ctx, ids, tables)
        print(line, flush=True)
    g.seq_lens.zero_()


if __name__ == "__main__":
    main()
