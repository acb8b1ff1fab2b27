"""Engine configuration: every user-facing knob of `LLM(...)`, validated once.

`EngineConfig` is plain data (no torch), so the scheduler and block manager can read it in
tests without a model. Values that depend on the model or the device (dtype, KV pool size) are
resolved later by the runner and written back into the fields marked "resolved".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from nanovllm.sampling_params import is_int, is_number

DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = (None, "int4")
GENERATION_CONFIGS = ("auto", "none")
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineConfig:
    model: str | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # Multi-node tensor parallelism (executor/multinode.py): the tensor_parallel_size ranks are
    # spread over nnodes machines, tensor_parallel_size // nnodes on each. This process is node 0
    # (the engine); every other node runs `nanovllm worker --node-rank K` against master_addr:
    # master_port, where node 0 opens the rendezvous. join_timeout_s bounds how long node 0 waits
    # for every rank to join (and a node for node 0), so a node that never comes is an error.
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    join_timeout_s: float = 300.0
    # The ranks are torchrun's processes (`torchrun ... -m nanovllm serve`: executor/multinode.py,
    # torchrun_env): this process is rank 0 and spawns no ranks; every other rank, on this node or
    # another, joins through the store at master_addr:master_port.
    torchrun: bool = False
    dtype: str = "auto"
    # The longest sequence (prompt and output). None: the model's context length, at most
    # DEFAULT_MAX_MODEL_LEN (LLMEngine resolves it, resolve_max_model_len); longer than the
    # model's context is a ValueError, as in vLLM.
    max_model_len: int | None = None
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # CUDA graphs on, one rank: a decode step of exactly one sequence runs as one persistent
    # Triton kernel (nanovllm/fastpath/) instead of the per-op graph, once its compile, started
    # in the background after start-up, is done.
    persistent_decode: bool = True
    # Decode steps a lone greedy or plain-temperature sequence runs per engine step, back to
    # back on the device (a decode burst: engine/scheduler.py). None = 8 once the persistent
    # kernel's graphs are captured (CUDA) and with the compiled CPU decode, else 1; any value
    # > 1 also runs elsewhere, as steps launched in a loop.
    decode_burst: int | None = None
    seed: int = 0
    # Schedule step N+1 while step N runs on the device (outputs trail by one step). None = on
    # where there is a device to overlap with (CUDA); on the CPU the host *is* the device.
    async_scheduling: bool | None = None
    # CPU only: a step in which every sequence decodes one token runs each decoder layer as code
    # compiled ahead of time by AOTInductor (runner/cpu_compiled_decode.py), built at start-up
    # the first time for a model shape and cached. None = on for a one-rank CPU engine whose
    # model it covers where a C++ compiler is found (a failed build falls back to the eager
    # model, with a warning); the environment's NANOVLLM_CPU_COMPILE=0 or 1 decides instead.
    cpu_compile: bool | None = None
    # CPU only: memory for the KV pool when num_kvcache_blocks is not given.
    cpu_kvcache_space_gib: float = 1.0
    # CPU only: "int4" keeps the projections' weights as 4-bit codes with a bf16 scale and
    # offset per 32 weights, multiplied by torch's CPU int4 kernel, the model in bf16 and the LM
    # head dense (layers/int4_linear.py): the projections read ~8x fewer bytes than in fp32.
    quantization: str | None = None
    # vLLM's --generation-config: "auto" takes the model's sampling defaults (its
    # generation_config.json or GGUF sampling metadata: loaders/generation_config.py) for every
    # field a request leaves unset; "none" ignores them.
    generation_config: str = "auto"
    # vLLM's --load-format: "auto" reads the checkpoint's weights; "dummy" builds the model from
    # config.json alone with small random weights, drawn on the target device (benchmarks).
    load_format: str = "auto"
    # Accepted for nano-vllm compatibility: a preloaded HF config and an EOS override.
    hf_config: Any = field(default=None, repr=False)
    eos: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"LLM({name}=...): {why} (got {getattr(self, name)!r})")

        if self.device not in DEVICES:
            raise bad("device", f"must be one of {DEVICES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        for name in ("tensor_parallel_size", "nnodes", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue
            if not is_int(value) or value < 1:
                raise bad(name, "must be a positive integer")
        if self.tensor_parallel_size % self.nnodes:
            raise bad("nnodes", f"must divide tensor_parallel_size={self.tensor_parallel_size} (ranks per node)")
        if self.nnodes > 1 and not (isinstance(self.master_port, int) and 1 <= self.master_port < 65536):
            raise bad("master_port", "multi-node needs the rendezvous port every node connects to, in [1, 65535]")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port < 65536:
            raise bad("master_port", "must be in [0, 65535] (0 = a free one, single node only)")
        if self.torchrun and not (self.tensor_parallel_size > 1 and self.master_port >= 1):
            raise bad("torchrun", "a torchrun launch needs tensor_parallel_size > 1 and master_port (torchrun's "
                      "WORLD_SIZE and MASTER_PORT)")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise bad("master_addr", "must be a host name or address of node 0")
        if not isinstance(self.join_timeout_s, (int, float)) or not self.join_timeout_s > 0:
            raise bad("join_timeout_s", "must be a positive number of seconds")
        if self.decode_burst is not None:
            if not is_int(self.decode_burst) or not 1 <= self.decode_burst <= 64:
                raise bad("decode_burst", "must be an integer in [1, 64] (a graph holds that many steps) or None")
            if self.decode_burst > 1 and self.tensor_parallel_size != 1:
                raise bad("decode_burst", "decode bursts run on one rank (tensor_parallel_size=1)")
        if self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise bad("kvcache_block_size", "must be a power of two")
        if self.num_kvcache_blocks is not None and (not is_int(self.num_kvcache_blocks) or self.num_kvcache_blocks < 1):
            raise bad("num_kvcache_blocks", "must be a positive integer or None")
        if not is_number(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be a number in (0, 1]")
        if not is_number(self.cpu_kvcache_space_gib) or self.cpu_kvcache_space_gib <= 0:
            raise bad("cpu_kvcache_space_gib", "must be a positive number of GiB")
        if not is_int(self.seed) or self.seed < 0:
            raise bad("seed", "must be a non-negative integer")
        if self.eos is not None and (not is_int(self.eos) or self.eos < 0):
            raise bad("eos", "must be a token id (a non-negative integer) or None")
        for name in ("enable_prefix_caching", "enforce_eager", "persistent_decode", "torchrun"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad("async_scheduling", "must be True, False or None (automatic)")
        if self.generation_config not in GENERATION_CONFIGS:
            raise bad("generation_config", f"must be one of {GENERATION_CONFIGS}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}")
        if self.cpu_compile is not None and not isinstance(self.cpu_compile, bool):
            raise bad("cpu_compile", "must be True, False or None (automatic)")
        if self.cpu_compile is None and os.environ.get("NANOVLLM_CPU_COMPILE") is not None:
            choice = os.environ["NANOVLLM_CPU_COMPILE"]
            if choice not in ("0", "1"):
                raise bad("cpu_compile", f"NANOVLLM_CPU_COMPILE must be 0 or 1, not {choice!r}")
            # The environment speaks for CPU engines of one rank; it does not make others invalid.
            self.cpu_compile = choice == "1" and self.device != "cuda" and self.tensor_parallel_size == 1
        if self.cpu_compile and self.device == "cuda":
            raise bad("cpu_compile", "compiles the CPU's decode steps; on CUDA they run as CUDA graphs (device='cpu')")
        if self.cpu_compile and self.tensor_parallel_size != 1:
            raise bad("cpu_compile", "runs on one process (tensor_parallel_size=1)")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {QUANTIZATIONS}")
        if self.quantization == "int4":
            if self.device == "cuda":
                raise bad("quantization", "'int4' runs on the CPU only (torch's int4 CPU kernel); use device='cpu'")
            if self.dtype not in ("auto", "bfloat16"):
                raise ValueError(f"LLM(quantization='int4') runs the model in bfloat16; got dtype={self.dtype!r}")
            if self.tensor_parallel_size != 1:
                raise ValueError("LLM(quantization='int4') runs on one process; got tensor_parallel_size="
                                 f"{self.tensor_parallel_size}")

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)


DEFAULT_MAX_MODEL_LEN = 4096


def resolve_max_model_len(requested: int | None, model_len: int | None) -> int:
    """EngineConfig.max_model_len for a model whose context is model_len positions (None:
    unknown): the request as it is, or, for None, the model's context up to
    DEFAULT_MAX_MODEL_LEN; ValueError if the request is longer than the model's context."""
    if requested is None:
        return DEFAULT_MAX_MODEL_LEN if model_len is None else min(DEFAULT_MAX_MODEL_LEN, model_len)
    if model_len is not None and requested > model_len:
        raise ValueError(f"LLM(max_model_len={requested}): longer than the model's context, {model_len} positions "
                         "(its max_position_embeddings, extended by its rope scaling); pass at most that, or "
                         "leave max_model_len unset")
    return requested
