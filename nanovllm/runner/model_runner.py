"""Runs one scheduled step on one rank: batch tensors in, sampled token ids out.

The runner owns the device side: the model (built, then loaded), the paged KV cache tensors,
the attention backend and the sampler. Per step it turns the scheduler's plain-data output into
tensors with vectorized numpy (no Python loop over tokens, one loop over sequences to fill the
block-table rows), runs the model, computes logits only for rows that sample, and samples on
the device. One device-to-host copy brings the sampled ids back.
"""
from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Callable, NamedTuple

import numpy as np
import torch

from nanovllm.attention.backend import bind_kv_cache, get_backend
from nanovllm.attention.metadata import AttentionMetadata, split_decodes
from nanovllm.config import EngineConfig
from nanovllm.distributed import tp_size
from nanovllm.layers.penalties import TokenBans
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors, make_generator, score_tokens, step_seed
from nanovllm.loaders.dummy import init_dummy_weights
from nanovllm.loaders.source import ModelSource
from nanovllm.models.registry import get_model_class
from nanovllm.precompile import compile_in_background, precompiling
from nanovllm.runner.device import int4_dense_copies, resolve_device, resolve_dtype, resolve_quantization
from nanovllm.runner.host_staging import HostStaging
from nanovllm.runner.penalty_state import PenaltyState
from nanovllm.step_result import Done, PendingOutput, ReadbackSlots, RunnerOutput, ScoredPrompts, StepResult, launched
from nanovllm.sampling_params import SamplingParams
from nanovllm.step import PLACEHOLDER_TOKEN, ScheduledSeq, SchedulerOutput

logger = logging.getLogger("nanovllm")

# The compiled CPU decode's default burst (decode_burst=None): a lone token takes a few
# milliseconds there, and the engine's scheduling and bookkeeping around each step, paid once
# per burst instead, are a few percent of it.
CPU_DECODE_BURST = 8
# The host arrays a step copies to the device, by dtype (ModelRunner._to_device_packed).
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
# Prompt logprobs are computed over at most this many positions' logits at a time, and no more
# than max_num_seqs (the rows whose logits and sampler temporaries start-up's profiling step
# measured): a long prompt's [positions, vocab] fp32 logits would not fit otherwise.
PROMPT_LOGPROB_ROWS = 256


class Forward(NamedTuple):
    """What an ordinary step's forward pass gives rank 0: its sampling rows, their logits (None:
    nothing samples) and the prompt logprobs it computed (None: no row asked)."""
    rows: list[ScheduledSeq]
    logits: torch.Tensor | None
    prompt_logprobs: ScoredPrompts | None


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
        self.quantization = resolve_quantization(config, source.hf_config, self.device)
        self.dtype = resolve_dtype("bfloat16" if self.quantization == "int4" else config.dtype, source.hf_config, self.device)
        # int4: dense bf16 copies of the projections for prefill-sized steps, where they are faster and fit
        self.int4_dense = self.quantization == "int4" and int4_dense_copies(source.hf_config)
        self.block_size = config.kvcache_block_size
        torch.manual_seed(config.seed)

        t0 = time.perf_counter()
        model_cls = get_model_class(source.hf_config)

        def build() -> torch.nn.Module:
            default_dtype = torch.get_default_dtype()
            try:
                torch.set_default_dtype(self.dtype)
                with torch.device(self.device):
                    return model_cls(source.hf_config)
            finally:
                torch.set_default_dtype(default_dtype)

        variant = f"{model_cls.__name__}-{str(self.dtype).removeprefix('torch.')}-tp{rank}of{config.tensor_parallel_size}"
        if config.load_format == "dummy":
            self.model = build()
            init_dummy_weights(self.model, config.seed)
            if self.quantization == "int4":
                self._quantize_int4(self.model, False)
        elif self.quantization == "int4":
            self.model = source.load_model(build, variant + ("-int4-dense" if self.int4_dense else "-int4"),
                                           convert=self._quantize_int4)
        else:
            self.model = source.load_model(build, variant)
        if self.quantization == "int4":
            self.model.lm_head.quantize_int8()  # the dense LM head multiplied by int8 codes (embedding.py)
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0

        self.backend = get_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self.penalty_state = PenaltyState(source.hf_config.vocab_size, self.device)
        self.bitmask_staging = None  # structured/bitmask.BitmaskStaging, at the first grammar mask on CUDA
        self._background_compiles: list[Future] = []  # kernel variants compiling after start-up
        # The last step's sampled ids stay on the device: with async scheduling the next step's
        # decode inputs are PLACEHOLDER_TOKEN on the host and are gathered from here.
        self.prev_tokens: torch.Tensor | None = None
        self.prev_rows: dict[int, int] = {}
        self.graph_runner = None
        self.fastpath = None  # the lone-sequence fast path (nanovllm/fastpath/), asked once per step
        self.staging = HostStaging(self.device, slots=6) if self.device.type == "cuda" else None
        # Pinned buffers the sampled ids come back through (step_result.py); None on the CPU.
        self.readback = ReadbackSlots() if self.device.type == "cuda" else None
        self.cpu_decode = None  # runner/cpu_compiled_decode.py, where config.cpu_compile asks for it
        if self.device.type == "cpu" and config.cpu_compile is not False:
            from nanovllm.runner import cpu_compiled_decode

            if config.cpu_compile or cpu_compiled_decode.chosen_automatically(self.model, config.tensor_parallel_size):
                self.cpu_decode = cpu_compiled_decode.CompiledCpuDecode(self.model)
        # The torch backend reads host-side lengths, so only the Triton / flash-attn backends are captured.
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch":
            from nanovllm.fastpath.seam import FastPath
            from nanovllm.runner.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(
                self.model, self.device, min(config.max_num_seqs, 512),
                -(-config.max_model_len // self.block_size), config.max_model_len,
            )
            self.fastpath = FastPath.build(self)
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
        t_captured = time.perf_counter()
        cpu_decode_tried = self.cpu_decode is not None
        if cpu_decode_tried:
            self._prepare_cpu_decode()
        t4 = time.perf_counter()
        if self.device.type == "cuda":
            # The first large step must find its activations in the caching allocator, not
            # cudaMalloc them: capture keeps the cache (capture_graph), and running the largest
            # step here makes sure of it whatever the dry passes left.
            self._run_largest_step()
            torch.cuda.synchronize(self.device)
        # Start-up breakdown in seconds, reported by benchmarks/bench.py and benchmarks/startup.py.
        self.startup_seconds = {
            "load_weights": self.load_seconds,
            "profile": t_profiled - t1,
            "dry_passes": t_dry_passes - t_profiled,
            "compile_wait": t_compiled - t_dry_passes,
            "agree_blocks": t2 - t_compiled,
            "kv_alloc": t3 - t2,
            "graph_capture": t_captured - t3,
            "allocator_warmup": time.perf_counter() - t4,
        }
        if cpu_decode_tried:
            self.startup_seconds["cpu_decode_packages"] = t4 - t_captured
        logger.info(
            "model %s loaded in %.1fs on %s (%s), %s attention, KV pool %d blocks x %d tokens",
            type(self.model).__name__, self.load_seconds, self.device, str(self.dtype).removeprefix("torch."),
            self.backend.name, self.num_kvcache_blocks, self.block_size,
        )

    def _quantize_int4(self, model: torch.nn.Module, layout_only: bool) -> None:
        from nanovllm.layers import int4_linear
        from nanovllm.layers.linear import quantize_int4

        if not int4_linear.available():
            raise ValueError(f"LLM(quantization='int4') needs torch's CPU int4 kernels, which torch {torch.__version__} lacks")
        done, kept = quantize_int4(model, layout_only=layout_only, dense=self.int4_dense)  # the LM head stays dense
        logger.info("int4 weights: %d layers %s%s, %d kept dense (routers, and shapes int4 cannot pack)",
                    done, "laid out" if layout_only else "quantized", " (with bf16 copies for large steps)" if self.int4_dense else "",
                    kept)

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (later decodes run eagerly). Called before a process group that
        the graphs' collectives use is destroyed: see CudaGraphRunner.release."""
        if self.fastpath is not None:
            self.fastpath.release()
            self.fastpath = None
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None

    def release_compiled(self) -> None:
        """Drop the compiled CPU decode's loaded packages (later decodes run eagerly): their
        loaders delete the directories they unpacked into, which a process that ends with
        os._exit (the CLI, the engine core) would leave behind in the temporary directory."""
        if self.cpu_decode is not None:
            self.cpu_decode = None
            gc.collect()

    def finish_background_compile(self) -> None:
        """Compile and adopt the fast path's kernel now, and wait for the other kernel variants
        that compile after start-up (tests, benchmarks): FastPath's docstring."""
        if self.fastpath is not None:
            self.fastpath.finish_background_compile()
        for pending in self._background_compiles:
            pending.exception()  # waits; a variant that failed compiles again at its first launch
        self._background_compiles.clear()

    def _precompiling(self) -> AbstractContextManager[bool]:
        """`precompiling()` on CUDA (yields whether passes inside are dry); a no-op elsewhere:
        the CPU runs Triton kernels only in the interpreter, which compiles nothing."""
        if self.device.type != "cuda":
            return nullcontext(False)
        return precompiling()

    # ---- KV cache ------------------------------------------------------------------------
    def _kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim)."""
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
        first batch that samples."""
        rows, vocab = logits.shape
        every_control = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=5)
        mixed = [SamplingParams(temperature=0.0) if i % 2 else every_control for i in range(rows)]
        # On CUDA such a batch takes the filtered sampler's kernels: compiled here, not mid-run.
        seeds = [0] * rows if self.sampler.wants_step_seeds(mixed, self.device) else None
        self.sampler(logits, SamplingTensors.from_params(mixed, None, vocab, self.device, step_seeds=seeds))
        # Penalties and a logit bias on every row: their [rows, vocab] temporaries.
        edits = [SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                                repetition_penalty=1.1, logit_bias={0: 1.0})] * rows
        stats = (torch.zeros((rows, vocab), dtype=torch.int32, device=self.device),
                 torch.zeros((rows, vocab), dtype=torch.bool, device=self.device))
        seeds = [0] * rows if self.sampler.wants_step_seeds(edits, self.device) else None
        self.sampler(logits, SamplingTensors.from_params(edits, None, vocab, self.device, token_stats=stats,
                                                         step_seeds=seeds))
        plain = [SamplingParams(temperature=1.0)] * rows  # the fused path, when the batch is large enough
        self.sampler(logits, SamplingTensors.from_params(plain, None, vocab, self.device))
        if self.device.type in self.sampler.fused_devices:
            # Grammar masks: the masked kernels compile on a thread of their own
            # (finish_background_compile waits for them).
            self._background_compiles.append(compile_in_background(partial(self.sampler.masked_dry_pass, logits)))

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
    def _prepare_cpu_decode(self) -> None:
        """Build (or load from the cache) each variant of the compiled CPU decode now, through one
        step of dummy sequences that stores nothing, so that no request waits for a build. Where
        the decode was chosen automatically, a failed build leaves the eager model decoding."""
        try:
            for rows in self.cpu_decode.variant_rows():
                zeros = torch.zeros(rows, dtype=torch.long)
                self.cpu_decode(zeros, zeros, self._dummy_meta([1] * rows, num_decodes=rows))
        except Exception as e:
            if self.config.cpu_compile:  # asked for, not chosen automatically
                raise
            logger.warning("cpu_compile: the compiled decode could not be built (%s: %s); decoding with the eager "
                           "model (cpu_compile=False skips the attempt)", type(e).__name__, e)
            self.cpu_decode = None

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
        if self.fastpath is not None:
            self.fastpath.bind(self.k_caches, self.v_caches)

    # ---- one step ------------------------------------------------------------------------
    def _to_device(self, a: np.ndarray) -> torch.Tensor:  # see _to_device_packed
        return self._to_device_packed([a])[0]

    def _to_device_packed(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays (of any dtypes) -> device views of one buffer, in one copy (each copy is
        a launch the GPU waits on between steps, so a step's arrays travel together). On CUDA
        the buffer is a pinned staging slot and the copy does not block the host
        (runner/host_staging.py); on the CPU the views are of host memory.

        Every view starts on a 16-byte boundary: Triton compiles a kernel variant per pointer
        alignment, so a view whose alignment followed the step's token count would compile a
        new variant in the middle of a run."""
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // 16) * 16
        flat = np.empty(end, dtype=np.uint8) if self.staging is None else self.staging.take(end)
        for a, offset in zip(arrays, offsets):
            flat[offset : offset + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
        dev = torch.from_numpy(flat) if self.staging is None else self.staging.upload(0, end)
        return [dev[offset : offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, offset in zip(arrays, offsets)]

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """The step's inputs on the device: (input ids, positions, attention metadata, host
        indices of the rows whose logits are sampled)."""
        return self._gather_pending(self._prepare(out))

    def _gather_pending(self, prepared: tuple) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """`_prepare`'s inputs with the tokens sampled by the previous step (async scheduling:
        PLACEHOLDER_TOKEN on the host) gathered into the input ids on the device."""
        input_ids_dev, positions_dev, meta, logits_indices, pending_dev, src_dev = prepared
        if pending_dev is None:
            pass
        elif len(pending_dev) == len(input_ids_dev) and self.prev_tokens.dtype == input_ids_dev.dtype:
            # Every row is pending (decodes), so row i is pending row i: one gather, no scatter.
            torch.index_select(self.prev_tokens, 0, src_dev, out=input_ids_dev)
        else:
            input_ids_dev[pending_dev] = self.prev_tokens[src_dev]
        return input_ids_dev, positions_dev, meta, logits_indices

    def _prepare(self, out: SchedulerOutput) -> tuple:
        """`prepare` up to the gather of the previous step's tokens, which reads nothing yet:
        (..., where the pending rows are, which of the previous step's rows fill them)."""
        if len(out.seqs) == 1 and len(out.seqs[0].token_ids) == 1:
            return self._prepare_lone(out.seqs[0], out.num_decodes)
        return self._prepare_batch(out)

    def _prepare_batch(self, out: SchedulerOutput) -> tuple:
        """`_prepare` of any step."""
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
        src = np.fromiter((self.prev_rows[seqs[i].seq_id] for i in seq_index[pending]), dtype=np.int64, count=len(pending))

        return self._upload(out.num_decodes, [input_ids, positions, slot_mapping, pending, src],
                            [cu, seq_lens, block_tables], qlens.tolist(), seq_lens.tolist(), logits_indices)

    def _prepare_lone(self, item: ScheduledSeq, num_decodes: int) -> tuple:
        """`_prepare` of a step of one token of one sequence (a lone stream's every decode step,
        each of a burst's): the same inputs, written directly instead of derived for a batch.
        On the CPU, where a lone token's whole step takes a few milliseconds, the batch
        derivation is a noticeable share of it."""
        position = item.start_pos
        bs = self.block_size
        token = item.token_ids[0]
        pending = token == PLACEHOLDER_TOKEN
        ints = np.array([token, position, item.block_table[position // bs] * bs + position % bs,
                         0, self.prev_rows[item.seq_id] if pending else 0], dtype=np.int64)
        # input ids, positions, slot mapping; pending row and its source row where the token is pending
        int64s = [ints[0:1], ints[1:2], ints[2:3]] + ([ints[3:4], ints[4:5]] if pending else [ints[3:3], ints[4:4]])
        int32s = [np.array([0, 1], dtype=np.int32), np.array([position + 1], dtype=np.int32),
                  np.asarray(item.block_table, dtype=np.int32)[None]]
        logits_indices = np.zeros(1 if item.sample else 0, dtype=np.int64)
        return self._upload(num_decodes, int64s, int32s, [1], [position + 1], logits_indices)

    def _upload(self, num_decodes: int, int64s: list[np.ndarray], int32s: list[np.ndarray], query_lens_cpu: list[int],
                seq_lens_cpu: list[int], logits_indices: np.ndarray) -> tuple:
        """`_prepare`'s result from the step's host arrays: int64s (input ids, positions, slot
        mapping, pending rows, their source rows) and int32s (query start offsets, sequence
        lengths, block tables), all in one copy to the device."""
        (input_ids_dev, positions_dev, slot_mapping_dev, pending_dev, src_dev,
         qsl_dev, seq_lens_dev, block_tables_dev) = self._to_device_packed(
            [a.astype(np.int64, copy=False) for a in int64s] + [a.astype(np.int32, copy=False) for a in int32s])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping_dev,
            query_start_loc=qsl_dev,
            seq_lens=seq_lens_dev,
            block_tables=block_tables_dev,
            num_decodes=num_decodes,
            max_query_len=max(query_lens_cpu),
            max_seq_len=max(seq_lens_cpu),
            query_lens_cpu=query_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        if not len(int64s[3]):
            pending_dev = src_dev = None
        return input_ids_dev, positions_dev, meta, logits_indices, pending_dev, src_dev

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.execute_async(out).result()

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> StepResult:
        """Launch one step; the result's `.result()` waits for its sampled ids. The fast path,
        where there is one, is asked first whether it takes the step."""
        self._release_finished(out)
        if out.is_empty:
            return Done(RunnerOutput([]))
        taken = self.fastpath.take(out) if self.fastpath is not None else None
        if taken is not None:
            return taken
        if out.num_decodes == 1 and out.seqs[0].num_steps > 1:
            return self.run_steps(out.seqs[0], lambda step: self._launch(SchedulerOutput([step], 1, 1)))
        forward = self._forward(out)
        if forward is None:
            return Done(RunnerOutput([]))
        sampled = self.sample_rows(forward.rows, forward.logits) if forward.logits is not None else None
        return launched(forward.rows, sampled, self.readback, forward.prompt_logprobs)

    @torch.inference_mode()
    def launch_forward(self, out: SchedulerOutput) -> DeferredSample:
        """Launch an ordinary step's forward pass (no fast path, no burst), leaving its sampling
        to the `.sample()` of what it returns, so the host can prepare what the sampling reads
        (the rows' grammar masks, ScheduledSeq.token_bitmask) while the device runs the
        forward. Nothing else may launch on this runner in between."""
        if any(s.num_steps > 1 for s in out.seqs):
            raise ValueError("launch_forward: a decode burst samples inside its launch")
        self._release_finished(out)
        forward = None if out.is_empty else self._forward(out)
        return DeferredSample(self, forward if forward is not None else Forward([], None, None))

    def _release_finished(self, out: SchedulerOutput) -> None:
        """Drop what the runner kept for the sequences that finished before this step (their
        seeded generators, their penalty rows)."""
        for seq_id in out.finished_seq_ids:
            self.generators.pop(seq_id, None)
        self.penalty_state.release(out.finished_seq_ids)

    def _launch(self, out: SchedulerOutput) -> tuple[list[ScheduledSeq], SamplerOutput] | None:
        """Launch one ordinary step; returns (sampling rows, SamplerOutput), or None where this
        rank samples nothing."""
        forward = self._forward(out)
        if forward is None or forward.logits is None:
            return None
        return forward.rows, self.sample_rows(forward.rows, forward.logits)

    def sample_rows(self, rows: list[ScheduledSeq], logits: torch.Tensor) -> SamplerOutput:
        """`sample`, and its tokens become the next step's inputs (prev_tokens)."""
        sampled = self.sample(rows, logits)
        self.prev_tokens = sampled.token_ids
        self.prev_rows = {s.seq_id: i for i, s in enumerate(rows)}
        return sampled

    def _forward(self, out: SchedulerOutput) -> Forward | None:
        """The forward pass and LM head of one ordinary step, and the prompt logprobs its rows
        ask for; None where this rank samples nothing (a non-zero rank)."""
        input_ids, positions, meta, logits_indices = self.prepare(out)
        compute_logits = self.model.compute_logits
        if self.cpu_decode is not None and self.cpu_decode.takes(len(out.seqs), out.num_decodes, len(input_ids)):
            hidden = self.cpu_decode(input_ids, positions, meta)
            compute_logits = self.cpu_decode.compute_logits
        elif self.cpu_decode is not None and 0 < out.num_decodes < len(out.seqs):
            # Decodes beside prompt chunks: the decodes through the compiled step, the rest eagerly.
            decodes, rest = split_decodes(meta)
            n = out.num_decodes
            hidden = torch.cat((self.cpu_decode(input_ids[:n], positions[:n], decodes),
                                self.model(input_ids[n:], positions[n:], rest)))
        elif self.graph_runner is not None and self.graph_runner.can_run(len(out.seqs), out.num_decodes):
            hidden = self.graph_runner.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        prompt_logprobs = self._score_prompts(out.seqs, hidden, compute_logits)
        logits = None
        if len(logits_indices) == hidden.shape[0]:  # every token samples (decodes): no gather
            logits = compute_logits(hidden)
        elif len(logits_indices):
            logits = compute_logits(hidden[self._to_device(logits_indices)])
        if self.rank != 0:
            return None
        return Forward([s for s in out.seqs if s.sample], logits, prompt_logprobs)

    def _score_prompts(self, seqs: list[ScheduledSeq], hidden: torch.Tensor,
                       compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> ScoredPrompts | None:
        """The logprobs of the prompt tokens the step's rows score (ScheduledSeq.prompt_logprob_ids),
        from the logits of the positions before them, a slice of positions at a time
        (PROMPT_LOGPROB_ROWS, at most max_num_seqs).
        Every rank runs the LM head (tensor parallelism gathers its logits); rank 0 scores."""
        asking = [(i, s) for i, s in enumerate(seqs) if s.prompt_logprob_ids]
        if not asking:
            return None
        starts = np.cumsum([0] + [len(s.token_ids) for s in seqs])
        rows = np.concatenate([starts[i] + np.asarray(s.prompt_logprob_rows, dtype=np.int64) for i, s in asking])
        targets = np.fromiter((t for _, s in asking for t in s.prompt_logprob_ids), dtype=np.int64, count=len(rows))
        rows_dev, targets_dev = self._to_device_packed([rows, targets])
        scoring = self.rank == 0
        k = max(s.params.prompt_logprobs for _, s in asking) if scoring else 0
        pieces = []
        per_slice = min(PROMPT_LOGPROB_ROWS, self.config.max_num_seqs)
        for lo in range(0, len(rows), per_slice):
            logits = compute_logits(hidden[rows_dev[lo : lo + per_slice]])
            if scoring:
                pieces.append(score_tokens(logits, targets_dev[lo : lo + per_slice], k))
        if not scoring:
            return None
        asked = [(s.seq_id, s.prompt_logprobs_from, len(s.prompt_logprob_ids), s.params.prompt_logprobs)
                 for _, s in asking]
        return ScoredPrompts(asked, *(torch.cat(parts) for parts in zip(*pieces)))

    @property
    def decode_burst(self) -> int:
        """How many decode steps of a lone sequence one engine step
        may run (Scheduler.schedule): config.decode_burst where given, else the fast path's
        burst once its graphs are captured (1 before), CPU_DECODE_BURST for the compiled CPU
        decode, 1 otherwise."""
        if self.config.decode_burst is not None:
            return self.config.decode_burst
        if self.fastpath is not None:
            return self.fastpath.decode_burst
        return CPU_DECODE_BURST if self.cpu_decode is not None else 1

    def run_steps(self, item: ScheduledSeq,
                  launch: Callable[[ScheduledSeq], tuple[list[ScheduledSeq], SamplerOutput] | None]) -> StepResult:
        """A decode burst (ScheduledSeq.num_steps steps of one sequence) as that many one-step
        launches (`launch`) back to back, each one's input gathered on the device from the last
        one's token."""
        tokens = []
        for i in range(item.num_steps):
            step = ScheduledSeq(item.seq_id, item.token_ids if i == 0 else [PLACEHOLDER_TOKEN], item.start_pos + i,
                                item.block_table, True, item.params, item.seed, None,
                                penalty_prompt_ids=item.penalty_prompt_ids if i == 0 else None)
            _, sampled = launch(step)
            tokens.append(sampled.token_ids.clone())  # the lone-sequence graph writes its argmax in place
        return PendingOutput([item], SamplerOutput(torch.cat(tokens), None, None, None), self.readback)

    def _token_bitmask(self, num_rows: int, masks: list[tuple[int, torch.Tensor]]):
        """The step's grammar masks on this runner's device (structured/bitmask.py)."""
        from nanovllm.structured.bitmask import BitmaskStaging, TokenBitmask

        if self.device.type != "cuda":
            return TokenBitmask.from_rows(num_rows, masks, self.device)
        if self.bitmask_staging is None:
            self.bitmask_staging = BitmaskStaging(self.device)
        return self.bitmask_staging.build(num_rows, masks)

    def sample(self, rows: list[ScheduledSeq], logits: torch.Tensor) -> SamplerOutput:
        """Sample one token per row of `logits` under each row's parameters (and seed); a
        penalized row's token is added to its sequence's counts (runner/penalty_state.py); a row
        with a grammar samples only what its bitmask allows (structured/bitmask.py), a row with
        banned ids or allowed_token_ids only what they allow (layers/penalties.TokenBans). A
        batch of greedy rows and nothing else takes Sampler.greedy (no per-row tensors are
        built)."""
        masks = [(i, s.token_bitmask) for i, s in enumerate(rows) if s.token_bitmask is not None]
        if all(s.params.takes_argmax and s.params.logit_bias is None and not s.banned_token_ids
               and not s.params.restricts_tokens for s in rows):
            return self.sampler.greedy(logits, self._token_bitmask(len(rows), masks) if masks else None)
        params = [s.params for s in rows]
        step_seeds = None
        if self.sampler.wants_step_seeds(params, self.device):
            drawn = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()  # torch.manual_seed governs them
            step_seeds = [drawn[i] if s.seed is None else step_seed(s.seed, s.start_pos + len(s.token_ids) - 1)
                          for i, s in enumerate(rows)]
        generators = []
        for s in rows:
            if s.seed is None or step_seeds is not None:
                generators.append(None)
                continue
            gen = self.generators.get(s.seq_id)
            if gen is None:
                gen = self.generators[s.seq_id] = make_generator(s.seed, self.device)
            generators.append(gen)
        slots = token_stats = None
        if any(s.params.penalized for s in rows):
            slots, *token_stats = self.penalty_state.gather(rows)
        st = SamplingTensors.from_params(params, generators, logits.shape[-1], self.device, token_stats=token_stats,
                                         step_seeds=step_seeds)
        st.bans = TokenBans.from_rows([s.banned_token_ids for s in rows], [p.allowed_token_ids for p in params],
                                      self.device)
        if masks:  # xgrammar is imported only once a request has a grammar
            st.token_mask = self._token_bitmask(len(rows), masks)
        sampled = self.sampler(logits, st)
        if st.penalties is not None:
            self.penalty_state.record(slots, sampled.token_ids[st.penalties.rows])
        return sampled


class DeferredSample:
    """A step whose forward pass is launched and whose sampling is not yet
    (ModelRunner.launch_forward): `sample()` launches it and returns the step's result (logits
    None: the step samples nothing)."""

    def __init__(self, runner: ModelRunner, forward: Forward) -> None:
        self._runner = runner
        self._forward = forward

    def sample(self) -> StepResult:
        rows, logits, prompt_logprobs = self._forward
        sampled = None
        if logits is not None:
            with torch.inference_mode():
                sampled = self._runner.sample_rows(rows, logits)
        return launched(rows, sampled, self._runner.readback, prompt_logprobs)

