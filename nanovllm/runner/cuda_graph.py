"""CUDA graphs for decode steps.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph
turns them into one launch. We capture the model forward (not the sampler) for a ladder of
batch sizes, over static input buffers; a step of n decodes is padded to the next captured
size: padded rows have slot -1 (nothing stored) and length 0 (nothing attended), and their
outputs are dropped. The attention backend reads lengths from device tensors only, so one
capture serves every context length up to max_model_len.

A lone sequence takes the persistent decode kernel where the runner built one
(`single`, runner/persistent_decode.py): its graph (size 1) captures that kernel instead of the
per-op forward, up to a context of SINGLE_MAX_CONTEXT tokens. Past it the per-op graph is
faster (its attention pipelines long contexts better: H200, Qwen3-0.6B, per token 1.30 vs 1.32
ms at 2,048 tokens, 1.72 vs 1.55 ms at 4,000; benchmarks/persistent_decode.py). Otherwise the smallest graph has 8 rows: cuBLAS picks a slow kernel for some projections below 8 rows
(Qwen3-0.6B's o_proj took 12.6 us at 1 row and 5.9 us at 8 on the H200,
`benchmarks/small_gemm.py`), and the other kernels cost the same for 1 or 8 rows, so a lone
sequence runs faster padded to 8.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.backend import AttentionMetadata

logger = logging.getLogger("nanovllm")


MIN_GRAPH_BATCH = 8
SINGLE_MAX_CONTEXT = 2048


def capture_sizes(max_batch: int) -> list[int]:
    """Graph batch sizes: 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [MIN_GRAPH_BATCH] + list(range(16, max_batch + 1, 16))
    if sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(
        self, model: nn.Module, device: torch.device, max_batch: int, max_blocks_per_seq: int, max_model_len: int,
        single: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.single = single
        self.single_max_context = SINGLE_MAX_CONTEXT
        self.sizes = ([1] if single is not None else []) + capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
        )

    @torch.inference_mode()
    def forward_all_sizes(self) -> None:
        """One eager forward per graph size. Start-up runs it as a dry pass that compiles every
        kernel variant the capture will launch (nanovllm/precompile.py)."""
        for bs in self.sizes:
            self._forward(bs, self._meta(bs))

    @torch.inference_mode()
    def forward_single(self) -> None:
        """One eager forward of the persistent decode kernel (a dry pass at start-up)."""
        if self.single is not None:
            self._forward(1, self._meta(1))

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        forward = self.single if bs == 1 and self.single is not None else self.model
        return forward(self.input_ids[:bs], self.positions[:bs], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(bs)
            self._forward(bs, meta)  # warm-up (autotune, lazy init)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = self._forward(bs, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch 1..%d) in %.1fs", len(self.sizes), self.max_batch, self.capture_seconds)

    def release(self) -> None:
        """Free the captured graphs. A graph that captured NCCL collectives holds a reference on
        the communicator, and destroying the process group waits for it forever (PyTorch issue
        115388), so tensor parallelism releases the graphs before it destroys the group."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and 0 < num_seqs <= self.max_batch

    def graph_size(self, num_seqs: int, max_context: int) -> int:
        """The captured batch size a step of num_seqs decodes replays."""
        if num_seqs == 1 and self.single is not None and max_context <= self.single_max_context:
            return 1
        per_op = self.sizes[1:] if self.single is not None else self.sizes
        return per_op[bisect.bisect_left(per_op, num_seqs)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = self.graph_size(n, meta.max_seq_len)
        width = meta.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:bs] = 0
        self.block_tables[:n, :width] = meta.block_tables
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
