"""CUDA graphs for decode steps.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph
turns them into one launch. We capture the model forward (not the sampler) for a ladder of
batch sizes, over static input buffers; a step of n decodes is padded to the next captured
size: padded rows have slot -1 (nothing stored) and length 0 (nothing attended), and their
outputs are dropped. The attention backend reads lengths from device tensors only, so one
capture serves every context length up to max_model_len.

The smallest graph has 8 rows: cuBLAS picks a slow kernel for some projections below 8 rows,
and the other kernels cost the same for 1 or 8 rows, so a lone sequence runs faster padded to
8. (A lone sequence takes the fast path's graphs instead where it has them: nanovllm/fastpath/,
captured in this runner's memory pool, `capture_in_pool`.)
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata

logger = logging.getLogger("nanovllm")


MIN_GRAPH_BATCH = 8


def capture_graph(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, fn: Callable[[], object]) -> object:
    """Capture `fn()` into `graph` (memory from `pool`, None for a new one) on `stream`; returns
    what fn returned.

    `torch.cuda.graph` empties the caching allocator and the pinned host-memory cache before
    every capture. A capture in the middle of serving (the lone-sequence graph, adopted when its
    background compile is done) then made the next steps cudaMalloc their activations and pin
    host memory again; this capture keeps both caches. thread_local: another thread's CUDA call
    must not invalidate the capture (under the default global mode, a Triton kernel that a
    background compile loaded meanwhile broke a start-up capture)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
        try:
            out = fn()
        except BaseException:
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture is invalid anyway; the first error is the one to see
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


def capture_sizes(max_batch: int) -> list[int]:
    """Graph batch sizes: 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [MIN_GRAPH_BATCH] + list(range(16, max_batch + 1, 16))
    if sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class CudaGraphRunner:
    def __init__(
        self, model: nn.Module, device: torch.device, max_batch: int, max_blocks_per_seq: int, max_model_len: int
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
        self.device = device
        self._capture_stream: torch.cuda.Stream | None = None  # made at the first capture
        self.capture_seconds = 0.0

    def capture_in_pool(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], object]) -> object:
        """Capture `fn()` into `graph` in the memory pool of this runner's graphs."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        return capture_graph(graph, self.pool, self._capture_stream, fn)

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
            self.outputs[bs] = self.capture_in_pool(graph, lambda: self._forward(bs, meta))
            if self.pool is None:
                self.pool = graph.pool()
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

    def graph_size(self, num_seqs: int) -> int:
        """The captured per-op batch size a step of num_seqs decodes replays in `run`."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the per-op graph that fits these decodes (copied into its static inputs)."""
        n = input_ids.shape[0]
        bs = self.graph_size(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.seq_lens[:n] = meta.seq_lens
        if n < bs:  # padded rows
            self.slot_mapping[n:bs] = -1
            self.seq_lens[n:bs] = 0
        self.block_tables[:n, :width] = meta.block_tables
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
