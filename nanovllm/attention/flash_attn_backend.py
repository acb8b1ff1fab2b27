"""Attention through flash-attn's paged kernels, used only when flash-attn is installed.

flash-attn is never a dependency: `attention_backend="flash-attn"` imports it here and fails
with a clear message otherwise (get_backend turns the ImportError into a ValueError). K/V are
stored with our Triton kernel; decodes go through `flash_attn_with_kvcache` and prefill chunks
through `flash_attn_varlen_func`, both reading the cache through the block table. flash-attn's
paged path needs a KV block size that is a multiple of 256 (`kvcache_block_size=256`).

Not exercised on our machines (flash-attn cannot be installed there); tests/test_triton_attention
style parity is in tests/test_flash_attn.py and runs wherever flash-attn is importable.
"""
from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401  (ImportError = not installed)

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.kernels.store_kv import store_kv


class FlashAttnBackend:
    name = "flash-attn"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_stored: bool = False) -> torch.Tensor:
        if k_cache.shape[1] % 256:
            raise ValueError("attention_backend='flash-attn' needs kvcache_block_size to be a multiple of 256")
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = flash_attn_with_kvcache(
                q[:nd].unsqueeze(1), k_cache, v_cache,
                cache_seqlens=meta.seq_lens[:nd], block_table=meta.block_tables[:nd],
                softmax_scale=scale, causal=True,
            ).squeeze(1)
        if nd < meta.num_seqs:
            qsl = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
            cu_k = torch.zeros(meta.num_seqs - nd + 1, dtype=torch.int32, device=q.device)
            torch.cumsum(meta.seq_lens[nd:], 0, out=cu_k[1:])
            out[nd:] = flash_attn_varlen_func(
                q[nd:], k_cache, v_cache,
                cu_seqlens_q=qsl, cu_seqlens_k=cu_k,
                max_seqlen_q=max(meta.query_lens_cpu[nd:]), max_seqlen_k=max(meta.seq_lens_cpu[nd:]),
                softmax_scale=scale, causal=True, block_table=meta.block_tables[nd:],
            )
        return out
