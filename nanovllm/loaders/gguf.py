"""Load llama.cpp GGUF files as a Hugging Face config, HF-named fp32 weights and a tokenizer.

The rest of the engine speaks Hugging Face: models are built from a `PretrainedConfig` and load
tensors by HF name. So a GGUF file is translated at the edge, once, and nothing downstream knows
it came from llama.cpp. The decisions:

- Config: built directly from the GGUF metadata (`{arch}.embedding_length`, `.block_count`, ...)
  rather than through `AutoConfig.from_pretrained(gguf_file=...)`, whose GGUF support lives in
  private transformers modules that move between releases. `head_dim` comes from
  `{arch}.attention.key_length` when present (Qwen3 and any model whose head_dim is not
  hidden/heads), `tie_word_embeddings` from the absence of `output.weight` (llama.cpp drops the
  duplicate), and the vocabulary size from `token_embd.weight` (the tensor is the ground truth).
  Floats are stored as f32 in GGUF; they are rounded to the shortest decimal (9.99999975e-06 ->
  1e-05) so the config reads like the original `config.json`. RoPE is passed as the classic
  `rope_theta` / `rope_scaling` kwargs, which transformers 4.x takes as is and 5.x folds into
  `config.rope_parameters`.
- RoPE scaling: `linear` and `yarn` come from `{arch}.rope.scaling.*`. Llama 3.1+ stores its
  scaling as a `rope_freqs` tensor of per-frequency divisors instead; we recover HF's `llama3`
  parameters from it (factor = the largest divisor, the other three are the values every Llama 3
  release uses) and refuse the file if recomputing the table does not reproduce the tensor.
- Weights: Q4_0, Q4_1 and Q8_0 blocks are dequantized here with torch, by gguf-py's operations
  (the same fp32 values, without its Python loop over rows); `gguf.quants.dequantize` handles
  every other type the gguf package implements (F32, F16, BF16, Q5_x, K-quants, IQ-quants);
  anything else raises ValueError naming the tensor. GGUF lists dims fastest-first, so HF shape is the reverse of `tensor.shape`.
- Llama q/k: llama.cpp's converter permutes the rows of q_proj/k_proj (per head, the two rotary
  halves are interleaved so GGML's adjacent-pair RoPE works). HF applies `rotate_half` to the
  halves, so for the `llama` architecture the permutation is undone (q with num_attention_heads,
  k with num_key_value_heads). Qwen2/Qwen3 are converted unpermuted and are passed through.
- Tokenizer: built by transformers from the GGUF vocabulary (`from_pretrained(gguf_file=...)`, a
  public entry point, of the class AutoTokenizer would pick, named directly: AutoTokenizer parses
  the whole file once more to choose it), then the chat template, EOS and add_bos/add_eos are set from the metadata
  explicitly so they do not depend on what a given transformers release copies over (5.17 drops
  `add_bos_token`, which Llama 3 files set).

The header is read by `loaders/gguf_header.py` (gguf-py's GGUFReader takes seconds over a large
vocabulary, which this loader does not read); each function accepts `reader=` to reuse one
`open_gguf(path)` across the three calls.
"""
from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from nanovllm.loaders.gguf_header import GGUFHeader

GGUF_ARCHITECTURES = {  # general.architecture -> (config class, HF architecture)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CONSUMED_BY_CONFIG = ("rope_freqs.weight",)
# Tensor types that hold plain floats; every other one is a quantized block format.
DENSE_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
# Llama 3.1/3.2/3.3 all use these with only `factor` varying (8 or 32).
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def open_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Open (memory-map) a GGUF file; FileNotFoundError / ValueError with the path on failure."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFHeader(path)
    # A truncated or corrupt header surfaces from the reader's parsing as any of these.
    except (ValueError, IndexError, KeyError, struct.error, OverflowError, MemoryError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e


def _meta(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value."""
    kind = reader.types.get(key)
    if kind is None:
        return default
    if kind == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata key {key!r} is an array; expected a single value")
    return reader.values[key]


def metadata_value(reader: GGUFHeader, key: str) -> Any:
    """A scalar or string metadata value, None where the key is absent; ValueError for an array."""
    return _meta(reader, key)


def _require(reader: GGUFHeader, key: str) -> Any:
    value = _meta(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value


def _decimal(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores f32 metadata)."""
    return float(str(np.float32(x)))


def load_gguf_config(
    path: str | os.PathLike[str], *, reader: GGUFHeader | None = None
) -> transformers.PretrainedConfig:
    """A transformers config (LlamaConfig, Qwen2Config or Qwen3Config) from the GGUF metadata."""
    config_class, kwargs, extras = _config_parts(path, reader)
    config = getattr(transformers, config_class)(**kwargs)
    for name, value in extras.items():
        setattr(config, name, value)
    return config


# What the transformers 5 config classes hold, beyond the arguments _config_parts gives them, of
# what the engine reads (tests/test_startup_cache.py, CONFIG_ATTRIBUTES).
_CONFIG_DEFAULTS = {
    "llama": {"model_type": "llama", "hidden_act": "silu", "mlp_bias": False, "dtype": None},
    "qwen2": {"model_type": "qwen2", "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None, "dtype": None},
    "qwen3": {"model_type": "qwen3", "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None, "dtype": None},
}  # fmt: skip


def gguf_config_values(path: str | os.PathLike[str], *, reader: GGUFHeader | None = None) -> dict[str, Any] | None:
    """What the engine reads of load_gguf_config(path), as the values of a config.json (the
    cache's SavedConfig), without the transformers config class, whose import takes seconds
    (it pulls in most of transformers and torch.distributed). Transformers 5's layout: RoPE as
    `rope_parameters` (theta and scaling in one dict, `rope_scaling` an alias of it). None
    under transformers 4, whose classes keep another layout: use load_gguf_config there."""
    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    _, kwargs, extras = _config_parts(path, reader)
    arch = kwargs["architectures"][0]
    family = next(name for name, (_, hf_arch) in GGUF_ARCHITECTURES.items() if hf_arch == arch)
    values = {**_CONFIG_DEFAULTS[family], **kwargs, **extras}
    theta, scaling = values.pop("rope_theta"), values.pop("rope_scaling")
    values["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    values["rope_scaling"] = dict(values["rope_parameters"])
    return values


def _config_parts(
    path: str | os.PathLike[str], reader: GGUFHeader | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(transformers config class name, its arguments, values set on it after) of a GGUF file."""
    reader = reader if reader is not None else open_gguf(path)
    arch = _require(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    config_class, hf_arch = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")

    hidden = int(_require(reader, f"{arch}.embedding_length"))
    heads = int(_require(reader, f"{arch}.attention.head_count"))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    context = int(_meta(reader, f"{arch}.context_length", 4096))
    theta = _decimal(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF dims: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=context,
        rms_norm_eps=_decimal(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, theta, head_dim, tensors),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "qwen2":
        if head_dim != hidden // heads:  # Qwen2Config derives head_dim; it cannot be overridden
            raise ValueError(f"qwen2 GGUF with head_dim {head_dim} != hidden_size / num_heads is not supported")
    else:
        kwargs["head_dim"] = head_dim
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    extras = {
        # The file's general.sampling.* values ride on the config, so that a start-up from the
        # converted-file cache (which never opens the file) sees them too (loaders/generation_config.py).
        "gguf_sampling": sampling_metadata(reader),
        # Whether the layers' weights are stored quantized (the engine then keeps them quantized
        # on the CPU by default: runner/device.py, resolve_quantization).
        "gguf_quantized": any(t.tensor_type not in DENSE_TYPES for t in reader.tensors
                              if t.name.startswith("blk.") and len(t.shape) == 2),
    }
    return config_class, kwargs, extras


def sampling_metadata(reader: GGUFHeader) -> dict[str, Any]:
    """The file's `general.sampling.*` scalars (f32 values as their shortest decimal)."""
    out = {}
    for key in reader.values:
        if key.startswith("general.sampling."):
            try:
                value = _meta(reader, key)
            except ValueError:
                continue
            out[key] = _decimal(value) if isinstance(value, float) else value
    return out


def _rope_scaling(
    reader: GGUFHeader, arch: str, theta: float, head_dim: int, tensors: dict
) -> dict[str, Any] | None:
    """HF `rope_scaling` (None for plain RoPE) from the metadata or Llama 3's rope_freqs tensor."""
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope(_dequantize(tensors["rope_freqs.weight"]), theta, head_dim)
    if scaling == "linear":
        return {"rope_type": "linear", "factor": _decimal(_require(reader, f"{arch}.rope.scaling.factor"))}
    if scaling == "yarn":
        return {
            "rope_type": "yarn",
            "factor": _decimal(_require(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                _require(reader, f"{arch}.rope.scaling.original_context_length")
            ),
        }
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")
    return None


def _llama3_rope_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling ([head_dim // 2]), as stored in `rope_freqs`."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    factor = _decimal(divisors.max())
    args = (_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT)
    expected = _llama3_rope_divisors(theta, head_dim, factor, *args)
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match Llama 3 RoPE scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": args[0],
        "high_freq_factor": args[1],
        "original_max_position_embeddings": args[2],
    }


def _blocks_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    return d * (_nibbles(blocks[:, 2:]).float() - 8)


def _blocks_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return d * _nibbles(blocks[:, 4:]).float() + m


def _blocks_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's 32 4-bit codes [blocks, 32] (uint8) from its 16 bytes: byte j holds code j in
    its low half and code j + 16 in its high half."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


# Block formats dequantized here with torch, by the operations gguf.quants does them in numpy (so
# to the same fp32 values: tests/test_gguf.py), without its Python loop over groups of 16 rows
# (seconds for the embedded model's Q4_1 projections).
_TORCH_BLOCKS = {
    gguf.GGMLQuantizationType.Q4_0: _blocks_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _blocks_q4_1,
    gguf.GGMLQuantizationType.Q8_0: _blocks_q8_0,
}
_BLOCK_ROWS = 1 << 16  # blocks dequantized at a time: the temporaries stay in the CPU's caches


def _dequantize_blocks(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """fp32 values of a tensor stored in one of _TORCH_BLOCKS's formats, flat."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, type_size))  # a copy: the map is read-only
    out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32)
    for start in range(0, blocks.shape[0], _BLOCK_ROWS):
        out[start : start + _BLOCK_ROWS] = _TORCH_BLOCKS[kind](blocks[start : start + _BLOCK_ROWS])
    return out.reshape(-1).numpy()


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """fp32, C-contiguous, writable, in HF shape (GGUF lists dims in reverse)."""
    try:
        if tensor.tensor_type in _TORCH_BLOCKS:
            data = _dequantize_blocks(tensor.data, tensor.tensor_type)
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantized: {e}"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.require(data.reshape(shape), np.float32, ["C", "W"])  # copies the read-only F32 memmap


def _hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent known to this loader")


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave: GGUF row 2*i + j <- HF row j*half + i."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot undo the q/k permutation: {rows} rows for {num_heads} heads")
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(
    path: str | os.PathLike[str],
    hf_config: transformers.PretrainedConfig,
    *,
    reader: GGUFHeader | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF tensor name, fp32 tensor) for every weight, one dequantized tensor at a time."""
    reader = reader if reader is not None else open_gguf(path)  # fail now, not at the first next()
    unpermute = _require(reader, "general.architecture") == "llama"
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            if tensor.name in _CONSUMED_BY_CONFIG:
                continue
            name = _hf_name(tensor.name)
            w = _dequantize(tensor)
            proj = name.split(".")[-2]
            if unpermute and proj in heads:
                w = _unpermute_rows(w, heads[proj])
            yield name, torch.from_numpy(w)

    return weights()


def load_gguf_tokenizer(
    path: str | os.PathLike[str], *, reader: GGUFHeader | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The transformers tokenizer of a GGUF file, with its chat template and EOS from the metadata."""
    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    tokenizer_class = _tokenizer_class(reader)
    tokenizer = tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)
    template = _meta(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    eos_id = _meta(reader, "tokenizer.ggml.eos_token_id")
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos_id))
    for attr in ("add_bos_token", "add_eos_token"):  # transformers 5.17 ignores these keys
        value = _meta(reader, f"tokenizer.ggml.{attr}")
        if value is not None and hasattr(tokenizer, attr) and getattr(tokenizer, attr) != bool(value):
            setattr(tokenizer, attr, bool(value))  # rebuilds the post-processor
    return tokenizer


def _tokenizer_class(reader: GGUFHeader):
    """The class AutoTokenizer picks for this file (the architecture's registered tokenizer, else
    TokenizersBackend), found without AutoTokenizer, which first parses the whole file again (4 s
    for the embedded model's vocabulary) to build the config it picks by. AutoTokenizer itself
    where the mapping is not a class name (other transformers releases) or the file is a Mistral
    one (transformers reads those as another architecture)."""
    arch = _meta(reader, "general.architecture")
    name = _meta(reader, "general.name") or ""
    backend = getattr(transformers, "TokenizersBackend", None)
    if arch not in GGUF_ARCHITECTURES or "mistral" in str(name).lower() or backend is None:
        return transformers.AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    registered = TOKENIZER_MAPPING_NAMES.get(arch)
    if registered is None:
        return backend
    found = getattr(transformers, registered, None) if isinstance(registered, str) else None
    return found or transformers.AutoTokenizer
