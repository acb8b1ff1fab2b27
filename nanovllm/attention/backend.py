"""The attention interface every backend implements, and the per-forward metadata.

A backend does two things for one layer in one forward: store the step's new K/V into the
paged cache (by `slot_mapping`), then attend each query token over its sequence's cached
context (read through `block_tables`). Prefill chunks and decodes share one step. The `Attention`
layer also applies the model's q/k norms and rotary first; where those run as the fused Triton
kernel, that launch stores K/V too and the backend is told so (`kv_stored`).

Layout (all backends):
- KV cache per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
  Token `t` of a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`.
- The batch is ordered decodes first: the first `num_decodes` sequences have query length 1.
- `AttentionMetadata` is built by the model runner for one forward and passed down the model
  explicitly (no module-level mutable state), so CUDA graphs can capture it as static buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding, apply_qk_norm_rope


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 means "padding, do not store"
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies (Python ints) so a backend never has to sync to learn shapes.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # What a backend derives from this metadata once and every layer reuses (the torch
    # backend's decode plan on the CPU). The metadata describes one step: its tensors are not
    # changed after the first layer has read them.
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class KVCacheWrite(NamedTuple):
    """A step's V rows and where they (and the rotated K rows) go: handed to the fused q/k
    norm + rotary kernel so that it stores K/V in the same launch (layers/fused.py)."""

    v: torch.Tensor  # [num_tokens, num_kv_heads * head_dim] or [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens]; -1 = padding, nothing stored


class AttentionBackend(Protocol):
    """Stores k/v into the cache and returns attention output, [T, H, D] in and out."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,  # True: k/v are already in the cache (stored by the fused rotary kernel)
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    """Paged attention for one layer. The runner binds the backend and this layer's cache
    after the model is built (`bind_kv_cache`), so model files know nothing of devices."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend | None = None
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Attention over the paged cache. With `rotary_emb` (and `positions`), q and k first get
        the optional per-head norms and rotary; where that runs as the fused kernel, the same
        launch stores K/V in the cache and the backend skips its own store."""
        if self.backend is None:
            raise RuntimeError("Attention layer has no backend bound; call bind_kv_cache() first")
        kv_stored = False
        if rotary_emb is not None:
            if positions is None:
                raise ValueError("Attention: rotary_emb needs positions")
            kv_write = None
            if rotary_emb.is_fused_for(positions):
                kv_write = KVCacheWrite(v, self.k_cache, self.v_cache, meta.slot_mapping)
            q, k = apply_qk_norm_rope(rotary_emb, positions, q, k, q_norm, k_norm, kv_write)
            kv_stored = kv_write is not None
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, kv_stored)
        return out.reshape(-1, self.num_heads * self.head_dim)


def bind_kv_cache(model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], backend: AttentionBackend) -> int:
    """Give each Attention layer of `model` (in module order) its cache and the backend."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(k_caches):
        raise ValueError(f"model has {len(layers)} attention layers but {len(k_caches)} caches were given")
    for layer, kc, vc in zip(layers, k_caches, v_caches):
        layer.k_cache, layer.v_cache, layer.backend = kc, vc, backend
    return len(layers)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """Lazy registry: import only the backend asked for ("auto" picks by device)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        try:
            from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        except ImportError as exc:
            raise ValueError("attention_backend='flash-attn' needs the flash-attn package installed") from exc
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, triton or flash-attn")
