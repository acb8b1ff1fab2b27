"""CUDA graphs for decode steps.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph
turns them into one launch. We capture the model forward (not the sampler) for a ladder of
batch sizes, over static input buffers; a step of n decodes is padded to the next captured
size: padded rows have slot -1 (nothing stored) and length 0 (nothing attended), and their
outputs are dropped. The attention backend reads lengths from device tensors only, so one
capture serves every context length up to max_model_len.

A lone sequence takes the persistent decode kernel once the runner has one
(runner/persistent_decode.py, compiled in the background after start-up): `capture_single`
adds a graph of size 1 that captures that kernel instead of the per-op forward, faster at every
context measured (H200, Qwen3-0.6B, per token: 0.70 vs 1.19 ms at 640 tokens, 1.84 vs 2.89 ms at
16,384; benchmarks/persistent_decode.py). Otherwise the smallest graph has 8 rows: cuBLAS picks
a slow kernel for some projections below 8 rows (Qwen3-0.6B's o_proj took 12.6 us at 1 row and
5.9 us at 8 on the H200, `benchmarks/small_gemm.py`), and the other kernels cost the same for 1
or 8 rows, so a lone sequence runs faster padded to 8.
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


def capture_sizes(max_batch: int) -> list[int]:
    """Graph batch sizes: 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [MIN_GRAPH_BATCH] + list(range(16, max_batch + 1, 16))
    if sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(
        self, model: nn.Module, device: torch.device, max_batch: int, max_blocks_per_seq: int, max_model_len: int,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_batch)  # the per-op graphs
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
        self.pool = None  # the graphs' shared memory pool
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

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = self._meta(bs)
            self._forward(bs, meta)  # warm-up (autotune, lazy init)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.outputs[bs] = self._forward(bs, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch 1..%d) in %.1fs", len(self.sizes), self.max_batch, self.capture_seconds)

    @torch.inference_mode()
    def capture_single(self, single: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]) -> None:
        """Capture `single` (one decoding sequence's forward, compiled already) as the graph of
        size 1, into the pool of the others. Runs between steps, on the thread that runs them:
        the warm-up launch reads the static buffers, so row 0 is first made to store nothing
        (slot -1) and attend to nothing cached (length 1: its own token only)."""
        t0 = time.perf_counter()
        self.slot_mapping[:1] = -1
        self.seq_lens[:1] = 1
        meta = self._meta(1)
        single(self.input_ids[:1], self.positions[:1], meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call during this capture (a server thread copying
        # results) must not invalidate it.
        with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
            self.outputs[1] = single(self.input_ids[:1], self.positions[:1], meta)
        torch.cuda.synchronize()
        self.graphs[1] = graph
        logger.info("captured the persistent decode kernel's graph in %.2fs", time.perf_counter() - t0)

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

    def graph_size(self, num_seqs: int) -> int:
        """The captured batch size a step of num_seqs decodes replays."""
        if num_seqs == 1 and 1 in self.graphs:
            return 1
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = self.graph_size(n)
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
