"""The attention interface every backend implements, the layer that calls it, and the lazy
backend registry.

A backend does two things for one layer in one forward: store the step's new K/V into the
paged cache (by `slot_mapping`), then attend each query token over its sequence's cached
context (read through `block_tables`). Prefill chunks and decodes share one step. The model
applies its q/k norms and rotary before it calls the layer; where those run as the fused Triton
kernel, that launch stores K/V too and the backend is told so (`kv_stored`). The cache layout
and the per-forward metadata are in attention/metadata.py.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata, KVCacheWrite


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

    def cache_write(self, v: torch.Tensor, meta: AttentionMetadata) -> KVCacheWrite:
        """Where this step's K/V go, for the fused q/k norm + rotary launch that stores them."""
        if self.backend is None:
            raise RuntimeError("Attention layer has no backend bound; call bind_kv_cache() first")
        return KVCacheWrite(v, self.k_cache, self.v_cache, meta.slot_mapping)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv_stored: bool = False
    ) -> torch.Tensor:
        """Attention over the paged cache of q, k, v ([T, H * D] or [T, H, D], norms and rotary
        applied). kv_stored: the fused q/k norm + rotary launch has stored K/V already
        (KVCacheWrite), so the backend skips its own store."""
        if self.backend is None:
            raise RuntimeError("Attention layer has no backend bound; call bind_kv_cache() first")
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
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' runs on CUDA devices (on the CPU only under Triton's "
                             "interpreter, TRITON_INTERPRET=1, for tests); use 'torch' or 'auto' here")
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash-attn":
        try:
            from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        except ImportError as exc:
            raise ValueError("attention_backend='flash-attn' needs the flash-attn package installed") from exc
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, triton or flash-attn")
