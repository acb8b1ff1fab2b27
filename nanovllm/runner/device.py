"""Which device and dtype an engine runs on, from the user's "auto" / names and the model config."""
from __future__ import annotations

import torch

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


def resolve_quantization(config, hf_config, device: torch.device) -> str | None:
    """The weight quantization an engine runs: `config.quantization` where given; else "int4" for a
    GGUF file whose projections are quantized (Q4_0, Q4_1, Q8_0, K-quants...: `gguf_quantized` on
    its config, loaders/gguf.py) on the CPU, one rank, dtype "auto": the file's 4-bit codes are
    kept (layers/int4_linear.py) instead of being widened to fp32, which reads 8x the bytes per
    token. dtype="float32" keeps the dequantized fp32 model, which matches transformers."""
    if config.quantization is not None:
        return config.quantization
    if (device.type == "cpu" and config.dtype == "auto" and config.tensor_parallel_size == 1
            and getattr(hf_config, "gguf_quantized", False)):
        from nanovllm.layers import int4_linear

        return "int4" if int4_linear.available() else None
    return None


# The largest dense bf16 copy of an int4 model's projections kept for large steps.
INT4_DENSE_MAX_BYTES = 1 << 30


def int4_dense_copies(hf_config) -> bool:
    """Whether an int4 model keeps dense bf16 copies of its projections for prefill-sized steps
    (layers/int4_linear.py): on a CPU with native bf16 dot products, where the copies (2 bytes a
    weight, beside the codes' half byte) take at most INT4_DENSE_MAX_BYTES."""
    from nanovllm.layers import int4_linear

    if not int4_linear.native_bf16():
        return False
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = getattr(hf_config, "intermediate_size", 0) or 0
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return 2 * layers * per_layer <= INT4_DENSE_MAX_BYTES
