"""Benchmark helpers: checkpoints of real models' shapes with random weights (docs/benchmarks.md).

No model hub is reachable, so benchmarks use the real Qwen3-0.6B shape with random bf16
weights (std 0.02, norms 1), exactly as nano-vllm's bench.py measures speed: the numbers depend
on shapes, not on weight values. SmolLM2-135M's shape stands in for the embedded model where
its package is not installed (the CPU replica benchmark on another machine). A small trained BPE tokenizer is saved beside the weights so
string prompts (nano-vllm's bench.py warm-up) work too. Also: GPU time per call from CUDA-graph
replays (`graph_time_us`, `replay_us`), for the kernel benchmarks.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=40960, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
    bos_token_id=151643, eos_token_id=151645,
)
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
    hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
)


def make_qwen3_06b(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write config.json, random bf16 safetensors and a small tokenizer to `path` (once)."""
    return make_random_checkpoint(path, QWEN3_06B, seed)


def make_smollm2_135m(path: str | os.PathLike, seed: int = 0) -> Path:
    """SmolLM2-135M's shape (the embedded model's) with random weights, as make_qwen3_06b."""
    return make_random_checkpoint(path, SMOLLM2_135M, seed)


def make_random_checkpoint(path: str | os.PathLike, shape: dict, seed: int = 0) -> Path:
    """Write config.json for `shape` (a config dict with architectures and model_type), random
    bf16 safetensors and a small tokenizer to `path` (once)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(shape["model_type"], **fields)
    config.architectures = list(shape["architectures"])
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, size in shapes.items():
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(size, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors")
    config.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": shape["eos_token_id"]}))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from checkpoints import make_tokenizer_dir

    make_tokenizer_dir(path)
    return path


def graph_time_us(fn, calls: int = 1, replays: int = 20) -> float:
    """GPU microseconds per call of fn(i), i = 0..calls-1, captured in one CUDA graph (after
    three warm-up calls on a side stream) and replayed `replays` times back to back: the host's
    launch overhead, which eager timing would measure instead, stays out."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return replay_us(graph, replays, warmup=1) / calls


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 20, warmup: int = 1) -> float:
    """GPU microseconds per replay of a captured graph: `warmup` replays, then `replays` back to
    back between two CUDA events."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays
