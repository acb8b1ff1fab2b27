"""Runs one scheduled step on one rank: batch tensors in, sampled token ids out.

The runner owns the device side: the model (built, then loaded), the paged KV cache tensors,
the attention backend and the sampler. Per step it turns the scheduler's plain-data output into
tensors with vectorized numpy (no Python loop over tokens, one loop over sequences to fill the
block-table rows), runs the model, computes logits only for rows that sample, and samples on
the device. One device-to-host copy brings the sampled ids back.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from nanovllm.attention.backend import AttentionMetadata, bind_kv_cache, get_backend
from nanovllm.config import EngineConfig
from nanovllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER_TOKEN
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors, make_generator
from nanovllm.loaders.source import ModelSource
from nanovllm.models.registry import get_model_class
from nanovllm.precompile import compile_in_background, precompiling
from nanovllm.runner.host_staging import HostStaging
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.runner.cuda_graph import BurstTokens, SingleDecodeInputs

logger = logging.getLogger("nanovllm")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # fast and exact on CPUs; bf16 matmuls are slow on most of them
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


# Decode steps per burst where the persistent kernel's graphs serve a lone greedy (or, with
# its fused LM head, plain-temperature) sequence (EngineConfig.decode_burst=None): see
# docs/benchmarks.md, W5.
DEFAULT_DECODE_BURST = 8


@dataclass
class RunnerOutput:
    token_ids: list[int]  # one per sampling row, in scheduler order
    # Per sampling row: None, or (sampled logprob, {token_id: logprob} of the top k).
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None


class PendingOutput:
    """The sampled ids of a launched step, on their way to the host.

    The device-to-host copy is queued behind the step's kernels into pinned memory and marked
    with an event, so the host can launch the next step before it waits for this one.
    """

    def __init__(self, rows, sampled, device: torch.device) -> None:
        self.rows = rows
        self.has_logprobs = sampled.sampled_logprobs is not None
        tensors = [sampled.token_ids]
        if self.has_logprobs:
            tensors += [sampled.sampled_logprobs, sampled.top_token_ids, sampled.top_logprobs]
        self.event = None
        if device.type == "cuda":
            self.host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors

    def result(self) -> RunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host[0].tolist()
        if not self.has_logprobs:
            return RunnerOutput(token_ids)
        sampled_lp = self.host[1].tolist()
        top_ids = self.host[2].tolist() if self.host[2] is not None else None
        top_lp = self.host[3].tolist() if self.host[3] is not None else None
        logprobs: list = []
        for i, s in enumerate(self.rows):
            k = s.params.logprobs
            if k is None:
                logprobs.append(None)
                continue
            top = dict(zip(top_ids[i][:k], top_lp[i][:k])) if (k and top_ids is not None) else {}
            logprobs.append((sampled_lp[i], top))
        return RunnerOutput(token_ids, logprobs)


class BurstOutput:
    """The K tokens of a decode burst's graph (CudaGraphRunner.replay_burst), on their way to
    the host (cuda_graph.BurstTokens)."""

    def __init__(self, tokens: BurstTokens) -> None:
        self.tokens = tokens

    def result(self) -> RunnerOutput:
        return RunnerOutput(list(self.tokens.tolist()))


class _Done:
    """A PendingOutput that is already complete (nothing sampled, or a non-zero rank)."""

    def __init__(self, output: RunnerOutput) -> None:
        self.output = output

    def result(self) -> RunnerOutput:
        return self.output


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        rank: int = 0,
        agree_num_blocks: Callable[[int], int] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.hf_config = source.hf_config
        self.device = resolve_device(config.device)
        if config.quantization == "int4" and self.device.type != "cpu":
            raise ValueError("LLM(quantization='int4') runs on the CPU only (torch's int4 CPU kernel); "
                             f"this machine resolved device={config.device!r} to {self.device}: pass device='cpu'")
        self.dtype = resolve_dtype("bfloat16" if config.quantization == "int4" else config.dtype, source.hf_config, self.device)
        self.block_size = config.kvcache_block_size
        torch.manual_seed(config.seed)

        t0 = time.perf_counter()
        model_cls = get_model_class(source.hf_config)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = model_cls(source.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        variant = f"{model_cls.__name__}-{str(self.dtype).removeprefix('torch.')}-tp{rank}of{config.tensor_parallel_size}"
        source.load_into(self.model, variant)
        self.model.eval()
        if config.quantization == "int4":
            self._quantize_int4()
        self.load_seconds = time.perf_counter() - t0

        self.backend = get_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        # The last step's sampled ids stay on the device: with async scheduling the next step's
        # decode inputs are PLACEHOLDER_TOKEN on the host and are gathered from here.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[int, int] = {}
        self.graph_runner = None
        self.persistent_decoder = None
        self.greedy_row = None  # the persistent graphs' argmax (fused_sampler.GreedyRow)
        self._staging = HostStaging(self.device, slots=6) if self.device.type == "cuda" else None
        # The torch backend reads host-side lengths, so only the Triton / flash-attn backends are captured.
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch":
            from nanovllm.runner.cuda_graph import CudaGraphRunner

            self.persistent_decoder = self._build_persistent_decoder()
            if self.persistent_decoder is not None:
                from nanovllm.layers.fused_sampler import GreedyRow

                self.greedy_row = GreedyRow(self.model.lm_head.num_embeddings, self.device)
            self.graph_runner = CudaGraphRunner(
                self.model, self.device, min(config.max_num_seqs, 512),
                -(-config.max_model_len // self.block_size), config.max_model_len, burst=self._graph_burst,
            )
        t1 = time.perf_counter()
        # On CUDA the profiling run, a mixed step and a decode forward per graph size are dry
        # passes that only queue Triton compiles on a thread pool (nanovllm/precompile.py);
        # leaving the block waits for them. The profiling run measures allocations, which a dry
        # pass makes too.
        with self._precompiling() as dry:
            self.num_kvcache_blocks = self._decide_num_blocks()
            t_profiled = time.perf_counter()
            if dry:
                self._dry_decode_passes()
            t_dry_passes = time.perf_counter()
        t_compiled = time.perf_counter()
        if agree_num_blocks is not None:
            # Tensor parallelism: block ids must mean the same on every rank, so the executor
            # passes a hook that makes every rank use the smallest pool (an all_reduce MIN).
            self.num_kvcache_blocks = agree_num_blocks(self.num_kvcache_blocks)
        t2 = time.perf_counter()
        self._allocate_kv_cache(self.num_kvcache_blocks)
        t3 = time.perf_counter()
        if self.graph_runner is not None:
            self.graph_runner.capture()
        t4 = time.perf_counter()
        if self.device.type == "cuda":
            # The first large step must find its activations in the caching allocator (W1's
            # first run paid 6 cudaMallocs, +0.1-0.6 s on the H200, when `torch.cuda.graph`
            # still emptied it at capture). Capture keeps the cache now (capture_graph), and
            # running the largest step here makes sure of it whatever the dry passes left.
            self._run_largest_step()
            torch.cuda.synchronize(self.device)
        # The persistent decode kernel compiles off the start-up path (it alone took a first
        # start from ~19 to ~24 s when start-up waited for it), on a thread that the first decode
        # step starts (started here, its Python front end held the GIL against the first
        # request: first token 0.06 -> 0.67 s on an empty Triton cache, H200); execute_async
        # adopts the kernel once compiled.
        self._persistent_dry_pass: Callable[[], None] | None = None
        self._persistent_pending: Future | None = None
        if self.persistent_decoder is not None:
            g, decoder, greedy = self.graph_runner, self.persistent_decoder, self.greedy_row
            ids, pos, meta = g.single.token, g.single.position, g.single.meta()
            logits = torch.empty((1, greedy.vocab_size), dtype=self.dtype, device=self.device)

            def dry_pass() -> None:
                with torch.cuda.device(self.device), torch.inference_mode():
                    if decoder.fused_head:
                        decoder(ids, pos, meta, ids, g.single.temperatures[0], g.single.seeds[0])
                    else:
                        decoder(ids, pos, meta)
                        greedy(logits, ids)

            self._persistent_dry_pass = dry_pass
        # Start-up breakdown in seconds, reported by benchmarks/bench.py and benchmarks/startup.py.
        self.startup_seconds = {
            "load_weights": self.load_seconds,
            "profile": t_profiled - t1,
            "dry_passes": t_dry_passes - t_profiled,
            "compile_wait": t_compiled - t_dry_passes,
            "agree_blocks": t2 - t_compiled,
            "kv_alloc": t3 - t2,
            "graph_capture": t4 - t3,
            "allocator_warmup": time.perf_counter() - t4,
        }
        logger.info(
            "model %s loaded in %.1fs on %s (%s), %s attention, KV pool %d blocks x %d tokens",
            type(self.model).__name__, self.load_seconds, self.device, str(self.dtype).removeprefix("torch."),
            self.backend.name, self.num_kvcache_blocks, self.block_size,
        )

    def _quantize_int4(self) -> None:
        from nanovllm.layers import int4_linear

        if not int4_linear.available():
            raise ValueError(f"LLM(quantization='int4') needs torch's CPU int4 kernels, which torch {torch.__version__} lacks")
        done, kept = int4_linear.quantize_model(self.model)
        logger.info("int4 weights: %d layers quantized, %d kept dense (in-features not a multiple of %d)",
                    done, kept, int4_linear.GROUP_SIZE)

    def _lone_step(self, token: torch.Tensor, position: torch.Tensor, meta: AttentionMetadata,
                   next_token: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, steps: int = 1,
                   record_bytes: int = 0, host_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of a lone sequence through the persistent kernel, its greedy token
        into next_token; returns the logits (what the lone-sequence graphs capture). The kernel
        runs the LM head and the argmax itself where it can (fused_head), and then samples the
        token instead where `temperature` ([1] float32, SingleDecodeInputs) is above 0
        (`lone_sampling`); else cuBLAS and GreedyRow follow it. (A Triton kernel of the head and
        the argmax alone was no faster than those two: 80.5-113 us against 80.7 on the H200,
        docs/benchmarks.md, W5 session 16.) steps > 1: a decode burst in this one launch (the
        decoder's multi_step; inputs and host_tokens as PersistentDecoder.__call__ takes them)."""
        decoder = self.persistent_decoder
        if decoder.fused_head:
            decoder(token, position, meta, next_token, temperature, seed, steps, record_bytes, host_tokens)
            return decoder.logits
        if steps != 1:
            raise ValueError("several decode steps in one launch need the persistent kernel's fused head")
        logits = self.model.compute_logits(decoder(token, position, meta))
        self.greedy_row(logits, next_token)
        return logits

    @property
    def lone_sampling(self) -> bool:
        """Whether the lone-sequence graphs sample a plain-temperature stream themselves (the
        persistent kernel's fused head: SamplingParams.plain_temperature), so that such a stream
        takes decode bursts in one graph too. Else it samples after each graph, from its logits."""
        g = self.graph_runner
        return (g is not None and g.has_single and self.persistent_decoder is not None
                and self.persistent_decoder.fused_head)

    @property
    def _graph_burst(self) -> int:
        """The decode burst the persistent kernel's graphs are captured for (decode_burst)."""
        return self.config.decode_burst if self.config.decode_burst is not None else DEFAULT_DECODE_BURST

    def _build_persistent_decoder(self):
        """The one-sequence decode kernel (runner/persistent_decode.py), or None where it is
        turned off or the model is not one it supports (logged)."""
        if not self.config.persistent_decode or not getattr(getattr(self.model, "model", None), "fused_ops", False):
            return None
        from nanovllm.runner.persistent_decode import PersistentDecoder, unsupported_reason

        reason = unsupported_reason(self.model)
        if reason is not None:
            logger.info("persistent decode off: %s", reason)
            return None
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return PersistentDecoder(self.model, num_programs=sms)

    def finish_background_compile(self) -> None:
        """Start the persistent decode kernel's background compile if no step has, wait for it
        and adopt the kernel now (tests and benchmarks; serving adopts it at the first step
        after it is done). Call it on the thread that runs steps."""
        self._start_background_compile()
        if self._persistent_pending is not None:
            self._persistent_pending.exception()  # waits
            self._adopt_persistent_decoder()

    def _start_background_compile(self) -> None:
        if self._persistent_dry_pass is not None:
            self._persistent_pending = compile_in_background(self._persistent_dry_pass)
            self._persistent_dry_pass = None

    def _adopt_persistent_decoder(self) -> None:
        """Capture the compiled persistent kernel's graph: from now on a lone decode replays it.
        Anything that stops it (a compile error, a failed capture) leaves the per-op path on."""
        pending, self._persistent_pending = self._persistent_pending, None
        try:
            if not pending.result():
                raise RuntimeError("this Triton cannot compile in the background")
            self.graph_runner.capture_single(self._lone_step, burst=self._graph_burst,
                                             one_launch=self.persistent_decoder.multi_step)
        except Exception as e:  # noqa: BLE001 - an optional fast path: log it and serve without it
            logger.warning("persistent decode off: %s", e)
            self.graph_runner.graphs.pop(1, None)
            self.persistent_decoder = None

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (later decodes run eagerly). Called before a process group that
        the graphs' collectives use is destroyed: see CudaGraphRunner.release."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None

    def _precompiling(self) -> AbstractContextManager[bool]:
        """`precompiling()` on CUDA (yields whether passes inside are dry); a no-op elsewhere:
        the CPU runs Triton kernels only in the interpreter, which compiles nothing."""
        if self.device.type != "cuda":
            return nullcontext(False)
        return precompiling()

    # ---- KV cache ------------------------------------------------------------------------
    def _kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim)."""
        from nanovllm.distributed import tp_size

        cfg = self.hf_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cfg.num_hidden_layers, max(1, num_kv // tp_size()), head_dim

    def bytes_per_block(self) -> int:
        layers, kv_heads, head_dim = self._kv_shape()
        return 2 * layers * self.block_size * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            return cfg.num_kvcache_blocks
        enough = -(-cfg.max_num_seqs * cfg.max_model_len // self.block_size)
        if self.device.type == "cpu":
            budget = int(cfg.cpu_kvcache_space_gib * 2**30) // self.bytes_per_block()
            return max(1, min(enough, budget))
        return max(1, min(enough, self._profile_cuda_blocks()))

    def _profile_cuda_blocks(self) -> int:
        """Run a dummy step of max_num_batched_tokens to find this process's peak memory; the
        pool gets total * utilization - peak (memory held by other processes is not counted)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache(1)
        self._run_largest_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        free_for_kv = int(total * self.config.gpu_memory_utilization) - peak
        blocks = free_for_kv // self.bytes_per_block()
        logger.info(
            "KV sizing: total %.1f GiB x %.2f - peak %.2f GiB (this process) = %.2f GiB -> %d blocks",
            total / 2**30, self.config.gpu_memory_utilization, peak / 2**30, free_for_kv / 2**30, blocks,
        )
        if blocks < 1:
            raise RuntimeError("no GPU memory left for the KV cache; raise gpu_memory_utilization or lower max_num_batched_tokens")
        return blocks

    @torch.inference_mode()
    def _run_largest_step(self) -> None:
        """A prefill step of max_num_batched_tokens dummy tokens (nothing stored), its logits for
        max_num_seqs rows and every sampler path: the most memory a step can take."""
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.config.max_model_len)
        seq_len = min(num_tokens, self.config.max_model_len)
        num_seqs = max(1, num_tokens // seq_len)
        ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=self.device)
        pos = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        hidden = self.model(ids, pos, self._dummy_meta([seq_len] * num_seqs))
        logits = self.model.compute_logits(hidden[: self.config.max_num_seqs])
        if self.rank == 0:
            self._exercise_sampler(logits)

    def _exercise_sampler(self, logits: torch.Tensor) -> None:
        """Run each sampler path once on the profiling logits, so that its memory counts in the
        peak and its kernels are loaded (the fused one compiled) now, not in the middle of the
        first batch that samples (that cost the first W1 run ~0.3 s of its first step)."""
        rows, vocab = logits.shape
        every_control = [
            SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=5),
            SamplingParams(temperature=0.0),
        ]
        mixed = [every_control[i % 2] for i in range(rows)]
        self.sampler(logits, SamplingTensors.from_params(mixed, None, vocab, self.device))
        plain = [SamplingParams(temperature=1.0)] * rows  # the fused path, when the batch is large enough
        self.sampler(logits, SamplingTensors.from_params(plain, None, vocab, self.device))

    def _dummy_meta(self, query_lens: list[int], num_decodes: int = 0) -> AttentionMetadata:
        """Metadata of a step of fresh sequences with these query lengths (the first num_decodes
        of length 1), attending within themselves; nothing is stored (slot -1)."""
        dev = self.device
        max_len = max(query_lens)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        return AttentionMetadata(
            slot_mapping=torch.full((int(starts[-1]),), -1, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((len(query_lens), -(-max_len // self.block_size)), dtype=torch.int32, device=dev),
            num_decodes=num_decodes, max_query_len=max_len, max_seq_len=max_len,
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(query_lens),
        )

    @torch.inference_mode()
    def _dry_decode_passes(self) -> None:
        """The dry passes after the profiling run's (which covers prefills): a mixed step of two
        decodes and a prefill chunk (it launches the single-pass decode kernel even where every
        graph size takes the split-KV one), then one decode forward per graph size."""
        self._allocate_kv_cache(1)  # the passes store nothing and attend to block 0 at most
        query_lens = [1, 1, 16]
        ids = torch.zeros(sum(query_lens), dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in query_lens])
        self.model(ids, pos, self._dummy_meta(query_lens, num_decodes=2))
        if self.graph_runner is not None:
            self.graph_runner.forward_all_sizes()

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        layers, kv_heads, head_dim = self._kv_shape()
        shape = (num_blocks, self.block_size, kv_heads, head_dim)
        if self.device.type == "cpu":  # pages untouched until a block is written (runner/host_memory.py)
            from nanovllm.runner.host_memory import lazy_zeros

            caches = lazy_zeros(2 * layers, shape, self.dtype)
            self.k_caches, self.v_caches = caches[:layers], caches[layers:]
        else:
            self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
            self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        bind_kv_cache(self.model, self.k_caches, self.v_caches, self.backend)
        if self.persistent_decoder is not None:
            self.persistent_decoder.bind(self.k_caches, self.v_caches)

    # ---- one step ------------------------------------------------------------------------
    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor (see _to_device_packed)."""
        return self._to_device_packed([a], a.dtype)[0]

    def _to_device_packed(self, arrays: list[np.ndarray], dtype: type) -> list[torch.Tensor]:
        """Several host arrays of one dtype -> device views of one buffer, in one copy (each copy
        is a launch the GPU waits on between steps, so a step's arrays travel together). On CUDA
        the buffer is a pinned staging slot and the copy does not block the host
        (runner/host_staging.py); on the CPU the views are of host memory.

        Every view starts on a 16-byte boundary: Triton compiles a kernel variant per pointer
        alignment, so a view whose alignment followed the step's token count would compile a
        new variant in the middle of a run."""
        item = np.dtype(dtype).itemsize
        align = 16 // item
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.size // align) * align
        if self._staging is None:
            flat = np.empty(end, dtype=dtype)
        else:
            flat = self._staging.take(end * item).view(dtype)
        for a, offset in zip(arrays, offsets):
            flat[offset : offset + a.size] = a.reshape(-1)
        dev = torch.from_numpy(flat)
        if self._staging is not None:
            dev = self._staging.upload(0, flat.nbytes).view(dev.dtype)
        return [dev[offset : offset + a.size].view(a.shape) for a, offset in zip(arrays, offsets)]

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        seqs = out.seqs
        num_seqs = len(seqs)
        qlens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=num_seqs)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        total = int(cu[-1])
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64, count=total)
        seq_index = np.repeat(np.arange(num_seqs), qlens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][seq_index] + starts[seq_index]
        seq_lens = starts + qlens
        max_blocks = int(max(len(s.block_table) for s in seqs))
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, s in enumerate(seqs):
            block_tables[i, : len(s.block_table)] = s.block_table
        bs = self.block_size
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        sample_rows = np.fromiter((s.sample for s in seqs), dtype=bool, count=num_seqs)
        logits_indices = cu[1:][sample_rows] - 1
        # Tokens sampled by the previous step are not on the host yet (async scheduling): their
        # rows of input_ids are gathered on the device from the last step's sampled ids.
        pending = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
        src = np.fromiter((self._prev_rows[seqs[i].seq_id] for i in seq_index[pending]), dtype=np.int64, count=len(pending))

        input_ids_dev, positions_dev, slot_mapping_dev, pending_dev, src_dev = self._to_device_packed(
            [input_ids, positions, slot_mapping, pending, src], np.int64
        )
        qsl_dev, seq_lens_dev, block_tables_dev = self._to_device_packed([cu, seq_lens, block_tables], np.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping_dev,
            query_start_loc=qsl_dev,
            seq_lens=seq_lens_dev,
            block_tables=block_tables_dev,
            num_decodes=out.num_decodes,
            max_query_len=int(qlens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=qlens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        if len(pending):
            input_ids_dev[pending_dev] = self._prev_tokens[src_dev]
        return input_ids_dev, positions_dev, meta, logits_indices

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(out).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingOutput | _Done:
        """Launch one step; the result's `.result()` waits for its sampled ids."""
        for seq_id in out.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if out.is_empty:
            return _Done(RunnerOutput([]))
        if self._persistent_pending is not None and self._persistent_pending.done():
            self._adopt_persistent_decoder()
        elif self._persistent_dry_pass is not None and out.num_decodes:
            self._start_background_compile()  # the first decode step: every first token is out
        if out.num_decodes == 1 and out.seqs[0].num_steps > 1:
            return self._execute_burst(out.seqs[0])
        launched = self._launch(out)
        if launched is None:
            return _Done(RunnerOutput([]))
        return PendingOutput(*launched, self.device)

    def _launch(self, out: SchedulerOutput) -> tuple[list[ScheduledSeq], SamplerOutput] | None:
        """Launch one ordinary step; returns (sampling rows, SamplerOutput), or None where this
        rank samples nothing."""
        if self.graph_runner is not None and self.graph_runner.has_single and len(out.seqs) == 1 and out.num_decodes == 1:
            return self._execute_single(out.seqs[0])
        input_ids, positions, meta, logits_indices = self.prepare(out)
        if self.graph_runner is not None and self.graph_runner.can_run(len(out.seqs), out.num_decodes):
            hidden = self.graph_runner.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if len(logits_indices) == 0:
            return None
        if len(logits_indices) == hidden.shape[0]:  # every token samples (decodes): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[self._to_device(logits_indices)])
        if self.rank != 0:
            return None
        rows = [s for s in out.seqs if s.sample]
        sampled = self._sample(rows, logits)
        self._prev_tokens = sampled.token_ids
        self._prev_rows = {s.seq_id: i for i, s in enumerate(rows)}
        return rows, sampled

    @property
    def decode_burst(self) -> int:
        """How many decode steps of a lone greedy or plain-temperature sequence one engine step
        may run (Scheduler.schedule): config.decode_burst where given, else the burst graph's size once
        the persistent kernel's graphs are captured (1 before)."""
        if self.config.decode_burst is not None:
            return self.config.decode_burst
        g = self.graph_runner
        return g.burst_steps if g is not None and g.burst_graphs else 1

    def _execute_burst(self, item: ScheduledSeq) -> BurstOutput | PendingOutput:
        """A decode burst (ScheduledSeq.num_steps steps of one greedy or plain-temperature
        sequence): one replay of a burst graph where they have this size and its steps' tokens
        come from the graph (`_graph_picks_token`), its inputs copied on a second stream while
        the burst before runs (CudaGraphRunner.uploading); otherwise (the reference path,
        and any device) that many ordinary steps launched back to back, each one's input
        gathered on the device from the last one's token."""
        g = self.graph_runner
        if g is not None and item.num_steps in g.burst_graphs and self._graph_picks_token(item):
            j, s = g.next_burst()
            with g.uploading(j) as stream:
                self._upload_lone_inputs(item, steps=item.num_steps, s=s, stream=stream)
            tokens = g.replay_burst(j, item.num_steps)
            self._prev_tokens, self._prev_rows = g.last_token(j), {item.seq_id: 0}
            return BurstOutput(tokens)
        tokens = []
        for i in range(item.num_steps):
            step = ScheduledSeq(item.seq_id, item.token_ids if i == 0 else [PLACEHOLDER_TOKEN], item.start_pos + i,
                                item.block_table, True, item.params, item.seed, None)
            _, sampled = self._launch(SchedulerOutput([step], num_decodes=1, num_batched_tokens=1))
            tokens.append(sampled.token_ids.clone())  # the lone-sequence graph writes its argmax in place
        return PendingOutput([item], SamplerOutput(torch.cat(tokens), None, None, None), self.device)

    def _upload_lone_inputs(self, item: ScheduledSeq, steps: int = 1, s: SingleDecodeInputs | None = None,
                            stream: torch.cuda.Stream | None = None) -> None:
        """Copy the inputs of `steps` decode steps of `item` into lone-sequence graph inputs `s`
        (SingleDecodeInputs; None: the graph of one step's) in one copy, on `stream` (None: the
        current one). A greedy stream's input token is where the last replay wrote it, else it is
        copied or written there on the current stream (after the launch in flight, which may
        write it)."""
        s = self.graph_runner.single if s is None else s
        host = self._staging.take(s.nbytes)
        token = item.token_ids[0]
        p = item.params
        picks = self._graph_picks_token(item)
        seeds = None
        if not p.greedy and picks:  # the kernel samples: a seed per step
            temperature = p.temperature
            seeds = torch.randint(0, 2**31 - 1, (steps,)).tolist()  # torch.manual_seed governs them
        elif item.sample and not picks:  # the sampler needs every logit (a quantized head would not store them)
            temperature = s.EXACT_LOGITS
        else:
            temperature = 0.0  # greedy
        s.fill_host(host, token, item.start_pos, item.block_table, self.block_size, steps, temperature, seeds)
        if token == PLACEHOLDER_TOKEN:
            row = self._prev_rows[item.seq_id]
            if not (self._prev_tokens is s.token and row == 0):
                s.token.copy_(self._prev_tokens[row : row + 1])
        elif stream is None:
            self._staging.upload(0, s.nbytes, out=s.buffer)
            return
        else:
            s.token.fill_(token)
        self._staging.upload(s.POSITION, s.nbytes, out=s.buffer[s.POSITION :], stream=stream)

    def _execute_single(self, item: ScheduledSeq) -> tuple[list[ScheduledSeq], SamplerOutput] | None:
        """A lone decoding sequence: one copy of its inputs, one replay of the graph of the
        persistent kernel, LM head and greedy argmax or sample (CudaGraphRunner.capture_single);
        the sampler runs only for rows whose token the graph does not pick (`_graph_picks_token`).
        Returns (rows, SamplerOutput) as _launch does."""
        g = self.graph_runner
        s = g.single
        self._upload_lone_inputs(item)
        if not item.sample and self._prev_tokens is s.token:
            self._prev_tokens = s.token.clone()  # the replay's argmax overwrites them
        logits = g.replay_single()
        if not item.sample:
            return None
        if self._graph_picks_token(item):
            sampled = SamplerOutput(s.token, None, None, None)  # the graph's argmax (or sample)
        else:
            sampled = self._sample([item], logits)
        self._prev_tokens = sampled.token_ids
        self._prev_rows = {item.seq_id: 0}
        return [item], sampled

    def _graph_picks_token(self, item: ScheduledSeq) -> bool:
        """Whether the token the lone-sequence graphs leave in SingleDecodeInputs is this step's
        token: a sampling step without logprobs or banned ids that is greedy, or at a plain
        temperature (no filter, no seed of its own) where the kernel samples (`lone_sampling`)."""
        p = item.params
        if not item.sample or p.logprobs is not None or item.banned_token_ids:
            return False
        return p.greedy or (p.plain_temperature and self.lone_sampling)

    def _sample(self, rows, logits: torch.Tensor):
        banned = [(i, t) for i, s in enumerate(rows) if s.banned_token_ids for t in s.banned_token_ids]
        if banned:
            r, c = zip(*banned)
            logits = logits.float()
            logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = float("-inf")
        generators = []
        for s in rows:
            if s.seed is None:
                generators.append(None)
                continue
            gen = self.generators.get(s.seq_id)
            if gen is None:
                gen = self.generators[s.seq_id] = make_generator(s.seed, self.device)
            generators.append(gen)
        st = SamplingTensors.from_params([s.params for s in rows], generators, logits.shape[-1], self.device)
        return self.sampler(logits, st)
