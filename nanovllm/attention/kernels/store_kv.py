"""Triton kernel that writes a step's new K and V rows into the paged caches.

One program per token copies that token's `[num_kv_heads, head_dim]` K row and V row into cache
slot `slot_mapping[t]` (slot = block * block_size + offset, the layout of `attention/backend.py`).
K and V share one launch because they share the slot lookup and the launch overhead dominates at
decode sizes (one token per sequence). Slot -1 marks padding (CUDA-graph batches are padded) and
writes nothing; the check is a branch on the device, so the launch stays graph-capturable. Inputs
may be strided views (q/k/v are usually slices of one fused projection); only the head_dim axis
must be contiguous. The cast to the cache dtype happens in the kernel, so an fp32 k/v can be
stored into a bf16 cache without a temporary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.precompile import launch


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 = skip
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t] for every t with a slot >= 0."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"store_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match k {tuple(k.shape)}"
        )
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"store_kv: slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv: the caches' head_dim axis must be contiguous")
    block_size = k_cache.shape[1]
    launch(
        _store_kv_kernel, (num_tokens,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
