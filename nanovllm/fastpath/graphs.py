"""The lone-sequence graphs: CUDA graphs of the persistent decode kernel for one decoding
sequence, one step or a decode burst of K steps, over inputs that arrive in one copy.

The graph of one step holds the kernel, the LM head and the greedy argmax (inside the kernel
where it can, its fused head; else cuBLAS and fused_sampler.GreedyRow), which it writes over its
own input token, so that a greedy stream's next step finds its input in place; with the fused
head it samples a plain-temperature stream's token too (the temperature and a seed per step are
in the input record). Each launch left outside a graph costs the host time per token, so the
inputs are views of one byte buffer (SingleDecodeInputs) that one host-to-device copy fills.

Burst graphs hold K such steps in a row, each step's token the next one's input, so that a
greedy or plain-temperature stream pays the graph launch and the copies once per K tokens. Two
graphs per burst length take turns, so that a burst's inputs are copied on a second stream
while the one before runs, and with the fused head the kernel writes the tokens into pinned
host memory: no copy sits between two bursts' kernels.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.fastpath.head_refine import BOUNDS_TEMPERATURE
from nanovllm.step import burst_sizes

logger = logging.getLogger("nanovllm")

# A record's temperature below 0 tells the kernel to store every logit and pick their argmax
# (head.py): the record layout is the kernel's, so the flag travels in the temperature's word.
ALL_LOGITS_TEMPERATURE = -1.0


class SingleDecodeInputs:
    """The lone-sequence graphs' static inputs: typed views of one device byte buffer, so that a
    step's inputs arrive in one copy (`fill_host`, then copy the bytes from POSITION, or from 0
    when the host knows the input token). One 96-byte record (token, position, slot, context
    length, temperature, seed) per step of a decode burst (`steps` records; the graph of one
    step reads record 0), then the block table. A temperature above 0 makes the kernel's LM
    head sample the step's token under the record's seed (a plain-temperature stream; 0:
    greedy); `fill_host(all_logits=True)` asks for every logit instead, which the sampler needs
    where the graph does not pick the token (a quantized head picks without storing them).
    Each view starts 16 bytes apart: Triton compiles a kernel variant per pointer alignment,
    and the compile (dry pass) and every capture use such views.

    A burst's step i reads record i and writes its token into record i + 1's token, the
    last step where the next burst finds its input (CudaGraphRunner.last_token: the other burst
    graph's record 0, or with a graph of n launches its own record 0, so that its tokens in order
    are those of records 1..K-1, then record 0's: BurstTokens.in_order)."""

    TOKEN, POSITION, SLOT, SEQ_LEN, TEMPERATURE, SEED = 0, 16, 32, 48, 64, 80  # byte offsets in a record
    # A filtered stream's sampling controls (the filtered graphs' FilteredSampler reads them;
    # the kernel reads only the fields above).
    SAMPLE_TEMPERATURE, TOP_K, TOP_P, MIN_P = 68, 72, 76, 88
    # Its penalties, three float32 (presence, frequency, repetition; (0, 0, 1): none), which the
    # filtered graphs' penalty kernel reads (fastpath/penalties.py).
    PENALTY_KNOBS = 52
    RECORD = 96

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
        self.sample_temperatures = [b[o + self.SAMPLE_TEMPERATURE : o + self.SAMPLE_TEMPERATURE + 4].view(torch.float32)
                                    for o in r]
        self.top_ks = [b[o + self.TOP_K : o + self.TOP_K + 4].view(torch.int32) for o in r]
        self.top_ps = [b[o + self.TOP_P : o + self.TOP_P + 4].view(torch.float32) for o in r]
        self.min_ps = [b[o + self.MIN_P : o + self.MIN_P + 4].view(torch.float32) for o in r]
        self.penalty_knobs = [b[o + self.PENALTY_KNOBS : o + self.PENALTY_KNOBS + 12].view(torch.float32) for o in r]
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
                  steps: int = 1, temperature: float = 0.0, seeds: list[int] | None = None,
                  all_logits: bool = False, filters: tuple[float, int, float, float] | None = None,
                  penalties: tuple[float, float, float] = (0.0, 0.0, 1.0), bounds: bool = False) -> None:
        """Write the inputs of `steps` decode steps from `position` on into `host` (nbytes uint8,
        the device buffer's layout); only the first step's token is known. temperature > 0: the
        steps sample at it, step i under seeds[i] (else greedy). all_logits: the steps store
        every logit and pick their argmax (the temperature is then ignored). filters:
        (temperature, top_k, top_p, min_p) of a filtered stream, sampled by the filtered graphs
        under seeds[i] from every logit (stored as all_logits stores them), after the logit bias
        and `penalties` (presence, frequency, repetition) of fastpath/penalties.py; with `bounds`
        (a top-k filter, no logit edits) the kernel's int8 head stores the logits' bounds
        instead, which head_refine.py makes exact where the top-k sample looks."""
        floats = host[: self.BLOCK_TABLE].view(np.float32)
        ints32 = host[: self.BLOCK_TABLE].view(np.int32)
        if filters is not None:
            all_logits = True
            for i in range(steps):
                r = i * self.RECORD
                floats[(r + self.SAMPLE_TEMPERATURE) // 4] = filters[0]
                ints32[(r + self.TOP_K) // 4] = filters[1]
                floats[(r + self.TOP_P) // 4] = filters[2]
                floats[(r + self.MIN_P) // 4] = filters[3]
                floats[(r + self.PENALTY_KNOBS) // 4 : (r + self.PENALTY_KNOBS) // 4 + 3] = penalties
        if all_logits:
            temperature = BOUNDS_TEMPERATURE if bounds and filters is not None else ALL_LOGITS_TEMPERATURE
        ints = host[: self.BLOCK_TABLE].view(np.int64)
        ints[self.TOKEN // 8] = token
        for i in range(steps):
            p = position + i
            r = i * self.RECORD
            ints[(r + self.POSITION) // 8] = p
            ints[(r + self.SLOT) // 8] = block_table[p // block_size] * block_size + p % block_size
            ints32[(r + self.SEQ_LEN) // 4] = p + 1
            floats[(r + self.TEMPERATURE) // 4] = temperature
            ints[(r + self.SEED) // 8] = seeds[i] if temperature > 0 or filters is not None else 0
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


class LoneGraphs:
    """The lone-sequence graph and the decode bursts' graphs, captured in the per-op graphs'
    memory pool (`capture_in_pool`, CudaGraphRunner.capture_in_pool) once the persistent kernel
    is compiled (`capture`)."""

    def __init__(self, capture_in_pool: Callable[[torch.cuda.CUDAGraph, Callable[[], object]], object],
                 device: torch.device, max_blocks_per_seq: int, max_model_len: int, burst: int = 1) -> None:
        self._capture_in_pool = capture_in_pool
        self.device = device
        self.single = SingleDecodeInputs(max_blocks_per_seq, max_model_len, device)
        self.single_graph: torch.cuda.CUDAGraph | None = None
        self.single_logits: torch.Tensor | None = None
        # The decode bursts' graphs (capture(burst=K > 1)): per burst length (K, and the
        # shorter ones of step.burst_sizes), two, each over its own inputs, taken in turn
        # (see replay_burst); bursts_to_host: the kernel writes each burst's tokens into
        # burst_tokens[j], pinned host memory.
        self.bursts = [SingleDecodeInputs(max_blocks_per_seq, max_model_len, device, steps=burst) for _ in range(2)] \
            if burst > 1 else []
        self.burst_tokens = [torch.zeros(burst, dtype=torch.int64, pin_memory=True) for _ in self.bursts]
        self.burst_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # The filtered graphs (capture(filtered_step=...)): the same shapes, each step a
        # filtered stream's (every logit, then its top-k / top-p / min-p sample).
        self.filtered_single_graph: torch.cuda.CUDAGraph | None = None
        self.filtered_burst_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # The top-k graphs (capture(top_k_step=...)): the same shapes, each step a top-k stream's
        # (the int8 head's bounds, its top rows' exact logits, the pick: head_refine.py).
        self.top_k_single_graph: torch.cuda.CUDAGraph | None = None
        self.top_k_burst_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.burst_steps = 1
        self.bursts_to_host = False
        self._next_burst = 0
        self._upload_stream: torch.cuda.Stream | None = None  # made at the first burst
        self._uploaded = [torch.cuda.Event() for _ in self.bursts]  # burst j's inputs are in
        self._done_with = [torch.cuda.Event() for _ in self.bursts]  # the last replay of j (and its copy) read them
        self._last_tokens: list[BurstTokens | None] = [None for _ in self.bursts]  # burst j's last replay's

    @property
    def has_single(self) -> bool:
        """Whether a lone decoding sequence replays the lone-sequence graph (`replay_single`)."""
        return self.single_graph is not None

    @torch.inference_mode()
    def capture(
        self,
        step: Callable[..., torch.Tensor],
        burst: int = 1,
        one_launch: bool = False,
        filtered_step: Callable[[SingleDecodeInputs, int, torch.Tensor], None] | None = None,
        top_k_step: Callable[[SingleDecodeInputs, int, torch.Tensor], None] | None = None,
    ) -> None:
        """Capture `step` (`step(token, position, meta, next_token, temperature, seed) -> logits`:
        one decoding sequence's forward over `self.single`, its LM head and its greedy argmax (or
        its sample, where it can: see SingleDecodeInputs) into `self.single.token`, compiled
        already: FastPath._lone_step) as the lone-sequence graph, in the per-op graphs' pool; with
        burst > 1 (at most the records of `self.bursts`), also the graphs of decode bursts of
        each length in step.burst_sizes(burst), two per length over `self.bursts` (see
        replay_burst): that many such steps, each step's token the next one's input (see
        SingleDecodeInputs); one_launch: `step` also takes `steps=n, record_bytes=...,
        host_tokens=...` and runs the n steps in one launch (the persistent kernel's MULTI_STEP),
        writing their tokens into `self.burst_tokens`, else the graph holds n launches. Runs
        between steps, on the thread that runs them: the warm-up launches read the static
        inputs, so they are first made to store nothing and attend to nothing cached.

        filtered_step(inputs, i, next_token): step i of a filtered stream over record i of
        `inputs` (logit bias and penalties included), its token into next_token; captured the
        same way as the filtered graphs (one launch per step; a burst's tokens stay in its
        records). top_k_step: the same for a top-k stream, captured as the top-k graphs."""
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
            logits = self._capture_in_pool(graph, forward)
            torch.cuda.synchronize()
            return graph, logits

        s = self.single
        self.single_graph, self.single_logits = capture(steps(s, 1, s.tokens[0], None))
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

        def sampling_graphs(sampled_step: Callable[[SingleDecodeInputs, int, torch.Tensor], None] | None, name: str):
            """(single graph, burst graphs) of `sampled_step` (None, {} where it is None or its
            capture fails: those streams then sample on the runner's path)."""
            if sampled_step is None:
                return None, {}

            def sampled_steps(s: SingleDecodeInputs, n: int, last_token: torch.Tensor):
                def forward() -> None:
                    for i in range(n):
                        sampled_step(s, i, s.tokens[i + 1] if i + 1 < n else last_token)
                return forward

            try:
                return (capture(sampled_steps(s, 1, s.tokens[0]))[0],
                        {n: [capture(sampled_steps(b, n, b.tokens[0]))[0] for b in self.bursts]
                         for n in (burst_sizes(burst) if burst > 1 else [])})
            except Exception as e:  # noqa: BLE001 - an optional fast path: log it and serve without it
                logger.warning("%s lone-sequence graphs off: %s", name, e)
                return None, {}

        self.filtered_single_graph, self.filtered_burst_graphs = sampling_graphs(filtered_step, "filtered")
        self.top_k_single_graph, self.top_k_burst_graphs = sampling_graphs(top_k_step, "top-k")
        logger.info("captured the persistent decode kernel's graphs (bursts of %d) in %.2fs", burst, time.perf_counter() - t0)

    def release(self) -> None:
        """Free the captured graphs (see CudaGraphRunner.release)."""
        graphs = [g for family in (self.burst_graphs, self.filtered_burst_graphs, self.top_k_burst_graphs)
                  for pair in family.values() for g in pair]
        graphs += [g for g in (self.single_graph, self.filtered_single_graph, self.top_k_single_graph) if g is not None]
        for graph in graphs:
            graph.reset()
        self.single_graph, self.single_logits, self.filtered_single_graph, self.top_k_single_graph = None, None, None, None
        self.burst_graphs, self.filtered_burst_graphs, self.top_k_burst_graphs, self.burst_steps = {}, {}, {}, 1

    def next_burst(self) -> tuple[int, SingleDecodeInputs]:
        """(j, inputs) of the next decode burst: the graphs take turns, so that the next burst's
        inputs can be copied in while the burst before it runs (uploading, replay_burst)."""
        return self._next_burst, self.bursts[self._next_burst]

    @property
    def has_filtered(self) -> bool:
        """Whether a lone filtered stream replays the filtered graphs (`replay_single(filtered=True)`)."""
        return self.filtered_single_graph is not None

    @property
    def has_top_k(self) -> bool:
        """Whether a lone top-k stream replays the top-k graphs (`replay_single(top_k=True)`)."""
        return self.top_k_single_graph is not None

    def burst_family(self, filtered: bool = False, top_k: bool = False) -> dict[int, list[torch.cuda.CUDAGraph]]:
        """The decode bursts' graphs by length: the top-k graphs', else the filtered ones', else
        the greedy / plain-temperature ones."""
        return self.top_k_burst_graphs if top_k else self.filtered_burst_graphs if filtered else self.burst_graphs

    def last_token(self, j: int, filtered: bool = False) -> torch.Tensor:
        """Where burst j leaves its last token ([1] int64 on the device): the next input."""
        return self.bursts[1 - j].token if self.bursts_to_host and not filtered else self.bursts[j].token

    @contextmanager
    def uploading(self, j: int) -> Iterator[torch.cuda.Stream]:
        """The stream on which to copy burst j's inputs inside the block: a second stream, which
        first waits until the last replay of burst j is done with them; the replay of j waits
        for the copies issued here. On the replay's own stream the copy would sit between the two
        graphs' kernels (the copy engine's turn); here it runs during the burst before."""
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(self.device)
        self._upload_stream.wait_event(self._done_with[j])
        yield self._upload_stream
        self._uploaded[j].record(self._upload_stream)

    def replay_burst(self, j: int, n: int, filtered: bool = False, top_k: bool = False) -> BurstTokens:
        """Replay the graph of burst j of n steps (its inputs filled: uploading); returns its
        tokens, on their way to the host. The kernel writes them into the same pinned memory at
        every replay of a burst j, so the last one's tokens are read first (the engine has
        normally read them already: it reads a burst's tokens before it launches the one after
        next). filtered: the filtered graph of burst j (its tokens come from its records); top_k:
        the top-k graph (the same)."""
        if self._last_tokens[j] is not None:
            self._last_tokens[j].tolist()
        stream = torch.cuda.current_stream()
        stream.wait_event(self._uploaded[j])
        self.burst_family(filtered, top_k)[n][j].replay()
        if self.bursts_to_host and not (filtered or top_k):
            tokens = BurstTokens(self.burst_tokens[j][:n], in_step_order=True)
        else:  # the records: step i's token in record i + 1, the last one's in record 0
            records = self.bursts[j].records[:n, 0]
            host = torch.empty(records.shape, dtype=records.dtype, pin_memory=True).copy_(records, non_blocking=True)
            tokens = BurstTokens(host, in_step_order=False)
        self._done_with[j].record(stream)
        self._next_burst = 1 - j
        self._last_tokens[j] = tokens
        return tokens

    def replay_single(self, filtered: bool = False, top_k: bool = False) -> torch.Tensor:
        """Replay the graph of size 1 over `self.single` (filled by the caller); returns its
        logits [1, vocab]. The greedy token (filtered: the filtered sample; top_k: the top-k
        graph's) is in `self.single.token` afterwards."""
        (self.top_k_single_graph if top_k else self.filtered_single_graph if filtered else self.single_graph).replay()
        return self.single_logits
