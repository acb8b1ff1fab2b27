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
16,384; benchmarks/persistent_decode.py). That graph also holds the LM head and the greedy
argmax (inside the kernel where it can, its fused_head; else cuBLAS and
fused_sampler.GreedyRow: one launch across the vocabulary, 3.6 us per token on the H200 against
torch.argmax's one-block 8.8 us), which it writes over its own input token, so that a
greedy stream's next step finds its input in place; its inputs are views of one byte buffer
(SingleDecodeInputs) that one host-to-device copy fills. Each launch left outside the graph
cost the host ~10-65 us per token (torch profiler, H200, W5). With the kernel's own LM head,
the graph samples a plain-temperature stream's token too (the temperature and a seed per step
are in the input record): the kernel adds fused_sampler's Gumbel noise to its logits. More
graphs hold decode bursts (engine/scheduler.py): K such steps in a row, each step's token the
next one's input, so that a greedy or plain-temperature stream pays the graph launch and the
copies once per K tokens (W5 on the H200: 1,799 -> 1,848 tok/s with K = 8, 1,851 with 16; a
stream at temperature 0.7, 1,579 -> 1,859). Two graphs per burst length take turns, so that a
burst's inputs are copied on a second stream while the one before runs, and with the kernel's
fused head the kernel writes the tokens into pinned host memory: no copy sits between two
bursts' kernels (replay_burst; W5 +7-11 tok/s, docs/benchmarks.md session 21). Otherwise the smallest graph has
8 rows: cuBLAS picks a slow kernel for some projections below 8 rows (Qwen3-0.6B's o_proj took
12.6 us at 1 row and 5.9 us at 8 on the H200, `benchmarks/small_gemm.py`), and the other kernels
cost the same for 1 or 8 rows, so a lone sequence runs faster padded to 8.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from nanovllm.attention.backend import AttentionMetadata
from nanovllm.engine.scheduler import burst_sizes

logger = logging.getLogger("nanovllm")


MIN_GRAPH_BATCH = 8


class SingleDecodeInputs:
    """The lone-sequence graphs' static inputs: typed views of one device byte buffer, so that a
    step's inputs arrive in one copy (`fill_host`, then copy the bytes from POSITION, or from 0
    when the host knows the input token). One 96-byte record (token, position, slot, context
    length, temperature, seed) per step of a decode burst (`steps` records; the graph of one
    step reads record 0), then the block table. A temperature above 0 makes the kernel's LM
    head sample the step's token under the record's seed (a plain-temperature stream; 0:
    greedy); EXACT_LOGITS (below 0) asks for every logit, which the sampler needs where the
    graph does not pick the token (a quantized head picks without storing them). Each view starts 16 bytes apart: Triton compiles a kernel variant per pointer
    alignment, and the compile (dry pass) and every capture use such views.

    A burst's step i reads record i and writes its token into record i + 1's token, the
    last step where the next burst finds its input (CudaGraphRunner.last_token: the other burst
    graph's record 0, or with a graph of n launches its own record 0, so that its tokens in order
    are those of records 1..K-1, then record 0's: BurstTokens.in_order)."""

    TOKEN, POSITION, SLOT, SEQ_LEN, TEMPERATURE, SEED = 0, 16, 32, 48, 64, 80  # byte offsets in a record
    RECORD = 96
    EXACT_LOGITS = -1.0  # a record's temperature: store every logit (and pick the argmax)

    def __init__(self, max_blocks: int, max_model_len: int, device: torch.device, steps: int = 1) -> None:
        self.steps = steps
        self.BLOCK_TABLE = self.RECORD * steps
        self.nbytes = self.BLOCK_TABLE + 4 * max_blocks
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        b = self.buffer
        r = [i * self.RECORD for i in range(steps)]
        self.tokens = [b[o + self.TOKEN : o + self.TOKEN + 8].view(torch.int64) for o in r]
        self.positions = [b[o + self.POSITION : o + self.POSITION + 8].view(torch.int64) for o in r]
        self.slots = [b[o + self.SLOT : o + self.SLOT + 8].view(torch.int64) for o in r]
        self.seq_lens = [b[o + self.SEQ_LEN : o + self.SEQ_LEN + 4].view(torch.int32) for o in r]
        self.temperatures = [b[o + self.TEMPERATURE : o + self.TEMPERATURE + 4].view(torch.float32) for o in r]
        self.seeds = [b[o + self.SEED : o + self.SEED + 8].view(torch.int64) for o in r]
        # [steps, 12] int64: column 0 holds each record's token (a burst's outputs, see above)
        self.records = b[: self.BLOCK_TABLE].view(torch.int64).view(steps, self.RECORD // 8)
        self.token, self.position, self.slot, self.seq_len = self.tokens[0], self.positions[0], self.slots[0], self.seq_lens[0]
        self.block_table = b[self.BLOCK_TABLE :].view(torch.int32).view(1, max_blocks)
        self.store_nothing()
        self.max_model_len = max_model_len
        self._query_start_loc = torch.arange(2, dtype=torch.int32, device=device)

    def store_nothing(self) -> None:
        """Make every record store no K/V (slot -1) and attend to its own token only (length
        1): what a warm-up launch before a capture may safely read."""
        for slot, seq_len in zip(self.slots, self.seq_lens):
            slot.fill_(-1)
            seq_len.fill_(1)

    def meta(self, step: int = 0) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[step], query_start_loc=self._query_start_loc, seq_lens=self.seq_lens[step],
            block_tables=self.block_table, num_decodes=1, max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_cpu=[1], seq_lens_cpu=[self.max_model_len],
        )

    def fill_host(self, host: np.ndarray, token: int, position: int, block_table: list[int], block_size: int,
                  steps: int = 1, temperature: float = 0.0, seeds: list[int] | None = None) -> None:
        """Write the inputs of `steps` decode steps from `position` on into `host` (nbytes uint8,
        the device buffer's layout); only the first step's token is known. temperature > 0: the
        steps sample at it, step i under seeds[i] (else greedy; EXACT_LOGITS: every logit stored)."""
        ints = host[: self.BLOCK_TABLE].view(np.int64)
        ints32 = host[: self.BLOCK_TABLE].view(np.int32)
        floats = host[: self.BLOCK_TABLE].view(np.float32)
        ints[self.TOKEN // 8] = token
        for i in range(steps):
            p = position + i
            r = i * self.RECORD
            ints[(r + self.POSITION) // 8] = p
            ints[(r + self.SLOT) // 8] = block_table[p // block_size] * block_size + p % block_size
            ints32[(r + self.SEQ_LEN) // 4] = p + 1
            floats[(r + self.TEMPERATURE) // 4] = temperature
            ints[(r + self.SEED) // 8] = seeds[i] if temperature > 0 else 0
        host[self.BLOCK_TABLE : self.BLOCK_TABLE + 4 * len(block_table)].view(np.int32)[:] = block_table


class BurstTokens:
    """A replayed decode burst's tokens, on their way to the host (CudaGraphRunner.replay_burst):
    pinned memory that the kernel writes (in_step_order) or that a copy of the burst's records
    fills after it (their tokens are steps K-1, 0, ..., K-2: see SingleDecodeInputs), complete
    at an event recorded behind them."""

    def __init__(self, host: torch.Tensor, in_step_order: bool) -> None:
        self.host = host
        self.in_step_order = in_step_order
        self.event = torch.cuda.Event()
        self.event.record()
        self._tokens: list[int] | None = None

    def tolist(self) -> list[int]:
        """The tokens in step order (waits for them; read once, then kept)."""
        if self._tokens is None:
            self.event.synchronize()
            ids = self.host.tolist()
            self._tokens = ids if self.in_step_order else self.in_order(ids)
        return self._tokens

    @staticmethod
    def in_order(record_tokens: list[int]) -> list[int]:
        """The records' tokens (steps K-1, 0, ..., K-2) in the order of the steps."""
        return record_tokens[1:] + record_tokens[:1]


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
        self, model: nn.Module, device: torch.device, max_batch: int, max_blocks_per_seq: int, max_model_len: int,
        burst: int = 1,
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
        self.single = SingleDecodeInputs(max_blocks_per_seq, max_model_len, device)
        self.single_logits: torch.Tensor | None = None
        # The decode bursts' graphs (capture_single(burst=K > 1)): per burst length (K, and the
        # shorter ones of scheduler.burst_sizes), two, each over its own inputs, taken in turn
        # (see replay_burst); bursts_to_host: the kernel writes each burst's tokens into
        # burst_tokens[j], pinned host memory.
        self.bursts = [SingleDecodeInputs(max_blocks_per_seq, max_model_len, device, steps=burst) for _ in range(2)] \
            if burst > 1 else []
        self.burst_tokens = [torch.zeros(burst, dtype=torch.int64, pin_memory=True) for _ in self.bursts]
        self.burst_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.burst_steps = 1
        self.bursts_to_host = False
        self._next_burst = 0
        self._upload_stream: torch.cuda.Stream | None = None  # made at the first burst
        self._uploaded = [torch.cuda.Event() for _ in self.bursts]  # burst j's inputs are in
        self._done_with = [torch.cuda.Event() for _ in self.bursts]  # the last replay of j (and its copy) read them
        self._last_tokens: list[BurstTokens | None] = [None for _ in self.bursts]  # burst j's last replay's
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None  # the graphs' shared memory pool
        self.device = device
        self._capture_stream: torch.cuda.Stream | None = None  # made at the first capture
        self.capture_seconds = 0.0

    def _capture(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], object]) -> object:
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
            self.outputs[bs] = self._capture(graph, lambda: self._forward(bs, meta))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch 1..%d) in %.1fs", len(self.sizes), self.max_batch, self.capture_seconds)

    @torch.inference_mode()
    def capture_single(
        self,
        step: Callable[..., torch.Tensor],
        burst: int = 1,
        one_launch: bool = False,
    ) -> None:
        """Capture `step` (`step(token, position, meta, next_token, temperature, seed) -> logits`:
        one decoding sequence's forward over `self.single`, its LM head and its greedy argmax (or
        its sample, where it can: see SingleDecodeInputs) into `self.single.token`, compiled
        already: ModelRunner._lone_step) as the graph of size 1, in the pool of the others; with
        burst > 1 (at most the records of `self.bursts`), also the graphs of decode bursts of
        each length in scheduler.burst_sizes(burst), two per length over `self.bursts` (see
        replay_burst): that many such steps, each step's token the next one's input (see
        SingleDecodeInputs); one_launch: `step` also takes `steps=n, record_bytes=...,
        host_tokens=...` and runs the n steps in one launch (the persistent kernel's MULTI_STEP),
        writing their tokens into `self.burst_tokens`, else the graph holds n launches. Runs between steps, on the
        thread that runs them: the warm-up launches read the static inputs, so they are first
        made to store nothing and attend to nothing cached."""
        t0 = time.perf_counter()
        if burst > 1 and (not self.bursts or burst > self.bursts[0].steps):
            raise ValueError(f"a decode burst of {burst} steps needs as many input records, there are "
                             f"{self.bursts[0].steps if self.bursts else 1}")
        for s in (self.single, *self.bursts):
            s.store_nothing()

        def steps(s: SingleDecodeInputs, n: int, last_token: torch.Tensor, host: torch.Tensor | None):
            metas = [s.meta(i) for i in range(n)]

            def forward() -> torch.Tensor:
                if one_launch and n > 1:
                    return step(s.tokens[0], s.positions[0], metas[0], last_token, s.temperatures[0], s.seeds[0],
                                steps=n, record_bytes=s.RECORD, host_tokens=host)
                for i in range(n):
                    logits = step(s.tokens[i], s.positions[i], metas[i], s.tokens[i + 1] if i + 1 < n else last_token,
                                  s.temperatures[i], s.seeds[i])
                return logits
            return forward

        def capture(forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
            forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            logits = self._capture(graph, forward)
            torch.cuda.synchronize()
            return graph, logits

        s = self.single
        self.graphs[1], self.single_logits = capture(steps(s, 1, s.tokens[0], None))
        self.burst_graphs, self.burst_steps, self.bursts_to_host = {}, 1, False
        if burst > 1:
            # One launch (the kernel's fused head): burst j's last token goes into the other
            # burst's first record, and every token into burst_tokens[j]. Else its own record 0.
            to_host = one_launch
            for n in burst_sizes(burst):
                self.burst_graphs[n] = [
                    capture(steps(b, n, self.bursts[1 - j].tokens[0] if to_host else b.tokens[0],
                                  self.burst_tokens[j] if to_host else None))[0]
                    for j, b in enumerate(self.bursts)
                ]
            self.burst_steps, self.bursts_to_host = burst, to_host
        logger.info("captured the persistent decode kernel's graphs (bursts of %d) in %.2fs", burst, time.perf_counter() - t0)

    def release(self) -> None:
        """Free the captured graphs. A graph that captured NCCL collectives holds a reference on
        the communicator, and destroying the process group waits for it forever (PyTorch issue
        115388), so tensor parallelism releases the graphs before it destroys the group."""
        for graph in [*self.graphs.values(), *(g for pair in self.burst_graphs.values() for g in pair)]:
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.single_logits = None
        self.burst_graphs, self.burst_steps = {}, 1

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and 0 < num_seqs <= self.max_batch

    @property
    def has_single(self) -> bool:
        """Whether a lone decoding sequence replays the graph of size 1 (`replay_single`)."""
        return 1 in self.graphs

    def graph_size(self, num_seqs: int) -> int:
        """The captured per-op batch size a step of num_seqs decodes replays in `run`."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def next_burst(self) -> tuple[int, SingleDecodeInputs]:
        """(j, inputs) of the next decode burst: the graphs take turns, so that the next burst's
        inputs can be copied in while the burst before it runs (uploading, replay_burst)."""
        return self._next_burst, self.bursts[self._next_burst]

    def last_token(self, j: int) -> torch.Tensor:
        """Where burst j leaves its last token ([1] int64 on the device): the next input."""
        return self.bursts[1 - j].token if self.bursts_to_host else self.bursts[j].token

    @contextmanager
    def uploading(self, j: int) -> Iterator[torch.cuda.Stream]:
        """The stream on which to copy burst j's inputs inside the block: a second stream, which
        first waits until the last replay of burst j is done with them; the replay of j waits
        for the copies issued here. On the replay's own stream the copy cost 2-11 us per burst
        between the kernels (the copy engine's turn between two graphs; H200, by host:
        benchmarks/burst_handoff.py, docs/benchmarks.md W5 session 21); here it runs during the
        burst before."""
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(self.device)
        self._upload_stream.wait_event(self._done_with[j])
        yield self._upload_stream
        self._uploaded[j].record(self._upload_stream)

    def replay_burst(self, j: int, n: int) -> BurstTokens:
        """Replay the graph of burst j of n steps (its inputs filled: uploading); returns its
        tokens, on their way to the host. The kernel writes them into the same pinned memory at
        every replay of a burst j, so the last one's tokens are read first (the engine has
        normally read them already: it reads a burst's tokens before it launches the one after
        next)."""
        if self._last_tokens[j] is not None:
            self._last_tokens[j].tolist()
        stream = torch.cuda.current_stream()
        stream.wait_event(self._uploaded[j])
        self.burst_graphs[n][j].replay()
        if self.bursts_to_host:
            tokens = BurstTokens(self.burst_tokens[j][:n], in_step_order=True)
        else:  # the records: step i's token in record i + 1, the last one's in record 0
            records = self.bursts[j].records[:n, 0]
            host = torch.empty(records.shape, dtype=records.dtype, pin_memory=True).copy_(records, non_blocking=True)
            tokens = BurstTokens(host, in_step_order=False)
        self._done_with[j].record(stream)
        self._next_burst = 1 - j
        self._last_tokens[j] = tokens
        return tokens

    def replay_single(self) -> torch.Tensor:
        """Replay the graph of size 1 over `self.single` (filled by the caller); returns its
        logits [1, vocab]. The greedy token is in `self.single.token` afterwards."""
        self.graphs[1].replay()
        return self.single_logits

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the per-op graph that fits these decodes (copied into its static inputs)."""
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
